"""hetpipe planner: allocation policies, partitioners, cost model, plan file (paper Sec. 4, 7, 8.1).

Public API (imported lazily, so ``import planner.plan`` stays cheap)::

    from planner import load_cluster, make_plan, load_plan
    plan = make_plan(load_cluster("examples/paper_cluster.yaml"), model="vgg19", batch_size=32, policy="hd")
    plan.save("plan.yaml")
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = [
    "Allocation",
    "Cluster",
    "CostModel",
    "Partition",
    "Plan",
    "PlanOptions",
    "allocate",
    "candidate_allocations",
    "load_cluster",
    "load_links",
    "load_plan",
    "make_plan",
    "partition_dp",
    "partition_dp_best_order",
    "partition_milp",
    "place_shards",
    "resolve_profiles",
]

_WHERE = {
    "Allocation": "planner.allocation",
    "allocate": "planner.allocation",
    "candidate_allocations": "planner.allocation",
    "Cluster": "planner.cluster",
    "load_cluster": "planner.cluster",
    "CostModel": "planner.costmodel",
    "load_links": "planner.costmodel",
    "Partition": "planner.partition.dp",
    "partition_dp": "planner.partition.dp",
    "partition_dp_best_order": "planner.partition.dp",
    "partition_milp": "planner.partition.milp",
    "place_shards": "planner.placement",
    "Plan": "planner.plan",
    "load_plan": "planner.plan_file",
    "PlanOptions": "planner.planner",
    "make_plan": "planner.planner",
    "resolve_profiles": "planner.profiles",
}


def __getattr__(name: str) -> Any:
    if name in _WHERE:
        return getattr(importlib.import_module(_WHERE[name]), name)
    raise AttributeError(f"module 'planner' has no attribute {name!r}")
