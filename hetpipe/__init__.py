"""hetpipe: HetPipe (USENIX ATC'20) on torch.distributed.

Pipelined model parallelism inside *virtual workers* of heterogeneous GPUs, and Wave
Synchronous Parallel data parallelism across them through sharded parameter servers.

The public Python API re-exports the pieces a user needs; data flows
model + cluster.yaml -> profile table -> plan file -> processes. Names are imported on first
use, so ``import hetpipe`` (and the CLI's start-up) does not pay for torch until it is needed.
"""

from __future__ import annotations

import importlib
from importlib.metadata import PackageNotFoundError, version
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from hetpipe.api import train
    from hetpipe.planning import plan
    from planner.cluster import Cluster, load_cluster, parse_cluster
    from planner.plan import Plan
    from planner.plan_file import load_plan
    from profiler.errors import (
        ConfigError,
        HetPipeError,
        HetPipeRuntimeError,
        ModelError,
        PlanError,
        ProfileError,
    )
    from profiler.graph import ModelGraph
    from profiler.models import ModelSpec, resolve_model
    from profiler.stages import StageModule
    from profiler.table import Profile, load_profile
    from runtime.config import ModelSource, OptimizerConfig, RunConfig
    from runtime.results.run_result import RunResult

try:
    __version__ = version("hetpipe")
except PackageNotFoundError:  # running from a source tree without installation
    __version__ = "0.0.0+source"

_WHERE = {
    "Cluster": "planner.cluster",
    "load_cluster": "planner.cluster",
    "parse_cluster": "planner.cluster",
    "Plan": "planner.plan",
    "load_plan": "planner.plan_file",
    "plan": "hetpipe.planning",
    "ConfigError": "profiler.errors",
    "HetPipeError": "profiler.errors",
    "HetPipeRuntimeError": "profiler.errors",
    "ModelError": "profiler.errors",
    "PlanError": "profiler.errors",
    "ProfileError": "profiler.errors",
    "ModelGraph": "profiler.graph",
    "StageModule": "profiler.stages",
    "ModelSpec": "profiler.models",
    "resolve_model": "profiler.models",
    "Profile": "profiler.table",
    "load_profile": "profiler.table",
    "train": "hetpipe.api",
    "ModelSource": "runtime.config",
    "OptimizerConfig": "runtime.config",
    "RunConfig": "runtime.config",
    "RunResult": "runtime.results.run_result",
}

__all__ = [
    "Cluster",
    "ConfigError",
    "HetPipeError",
    "HetPipeRuntimeError",
    "ModelError",
    "ModelGraph",
    "ModelSource",
    "ModelSpec",
    "OptimizerConfig",
    "Plan",
    "PlanError",
    "Profile",
    "ProfileError",
    "RunConfig",
    "RunResult",
    "StageModule",
    "__version__",
    "load_cluster",
    "load_plan",
    "load_profile",
    "parse_cluster",
    "plan",
    "resolve_model",
    "train",
]


def __getattr__(name: str) -> Any:
    if name in _WHERE:
        value = getattr(importlib.import_module(_WHERE[name]), name)
        globals()[name] = value  # later look-ups skip this hook
        return value
    raise AttributeError(f"module 'hetpipe' has no attribute {name!r}")


def __dir__() -> list[str]:
    return __all__
