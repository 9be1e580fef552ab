"""hetpipe: HetPipe (USENIX ATC'20) on torch.distributed.

Pipelined model parallelism inside *virtual workers* of heterogeneous GPUs, and Wave
Synchronous Parallel data parallelism across them through sharded parameter servers.

The public Python API re-exports the pieces a user needs; data flows
model + cluster.yaml -> profile table -> plan file -> processes.
"""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

from planner.cluster import Cluster, load_cluster, parse_cluster
from planner.plan import Plan, load_plan
from planner.planner import plan
from profiler.errors import (
    ConfigError,
    HetPipeError,
    HetPipeRuntimeError,
    ModelError,
    PlanError,
    ProfileError,
)
from profiler.graph import ModelGraph, StageModule
from profiler.models import ModelSpec, resolve_model
from profiler.table import Profile, load_profile
from runtime.api import train
from runtime.config import ModelSource, OptimizerConfig, RunConfig
from runtime.metrics import RunResult

try:
    __version__ = version("hetpipe")
except PackageNotFoundError:  # running from a source tree without installation
    __version__ = "0.0.0+source"

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
