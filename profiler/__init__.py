"""hetpipe profiler: per-layer profiles per GPU type (measured, analytic, scaled or imported).

Public API (imported lazily, so ``import profiler.errors`` stays cheap)::

    from profiler import resolve_model, measure_profile, analytic_profile, import_pipedream
    prof = measure_profile(resolve_model("resnet", 32))          # this machine
    est = analytic_profile("vgg19", 32, "TITAN V")               # no GPU needed
    pd = import_pipedream("graph.txt")                           # PipeDream profile
    prof.save("profiles/resnet_cpu_b32.csv"); load_profile("profiles/resnet_cpu_b32.csv")
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = [
    "ModelGraph",
    "Profile",
    "ProfileMeta",
    "analytic_profile",
    "calibrate",
    "import_pipedream",
    "load_profile",
    "load_profile_set",
    "lookup_gpu",
    "measure_links",
    "measure_profile",
    "resolve_model",
    "scale_profile",
    "step_time_ms",
]

_WHERE = {
    "ModelGraph": "profiler.graph",
    "Profile": "profiler.table",
    "ProfileMeta": "profiler.table",
    "load_profile": "profiler.table",
    "load_profile_set": "profiler.table",
    "analytic_profile": "profiler.analytic",
    "calibrate": "profiler.analytic",
    "scale_profile": "profiler.analytic",
    "import_pipedream": "profiler.pipedream",
    "lookup_gpu": "profiler.catalog",
    "measure_links": "profiler.links",
    "measure_profile": "profiler.measure",
    "step_time_ms": "profiler.measure",
    "resolve_model": "profiler.models",
}


def __getattr__(name: str) -> Any:
    if name in _WHERE:
        return getattr(importlib.import_module(_WHERE[name]), name)
    raise AttributeError(f"module 'profiler' has no attribute {name!r}")
