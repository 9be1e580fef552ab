"""The planner's choice of memory placements (``hetpipe plan --memory``, :mod:`planner.offload`).

``--memory keep`` (the default) keeps every class of data on the device, as before the memory
manager. ``--memory auto`` lets the partitioners work under each uniform placement of
:data:`planner.offload.LADDER` (the cost model's multipliers change, :meth:`CostModel.with_placement`)
and then gives every stage of a partition its own fastest placement among all 24 that fits its
GPU and its share of the node's host memory (:func:`stage_placements`); :func:`refined_ms` scores
a partition that way, so the planner keeps the best partition over the ladder. Any other value
is one placement for every stage (``activations:recompute``).
"""

from __future__ import annotations

from collections.abc import Sequence

from planner.cluster import Cluster
from planner.costmodel import CostModel
from planner.offload import CANDIDATES, KEEP_ALL, LADDER, MemoryPlacement
from planner.partition.dp import Partition
from planner.stagecost import StageMemory
from profiler.errors import PlanError
from profiler.units import format_bytes

__all__ = ["memory_candidates", "memory_ladder", "refined_ms", "stage_placements"]


def memory_ladder(memory: str) -> tuple[MemoryPlacement, ...]:
    """The uniform placements ``--memory`` allows the partitioner, cheapest first.

    Raises:
        PlanError: neither ``keep``, ``auto`` nor a placement.
    """
    if memory == "keep":
        return (KEEP_ALL,)
    if memory == "auto":
        return LADDER
    try:
        return (MemoryPlacement.parse(memory),)
    except ValueError as exc:
        raise PlanError(f"--memory {memory[:40]!r}: {exc}; or use keep or auto") from None


def memory_candidates(memory: str) -> tuple[MemoryPlacement, ...]:
    """The placements one stage may take after partitioning under ``--memory``."""
    return CANDIDATES if memory == "auto" else memory_ladder(memory)


def _choose(
    cm: CostModel,
    cluster: Cluster,
    part: Partition,
    nm: int,
    candidates: Sequence[MemoryPlacement],
    j: int,
) -> StageMemory | None:
    p, q = part.bounds[j], part.bounds[j + 1]
    return cm.choose_placement(part.gpus, j, p, q, nm, candidates)


def refined_ms(
    cm: CostModel,
    cluster: Cluster,
    part: Partition,
    nm: int,
    candidates: Sequence[MemoryPlacement],
) -> float:
    """Slowest stage of ``part`` once every stage takes its fastest fitting placement
    (``inf``: some stage fits none)."""
    worst = 0.0
    for j in range(len(part.gpus)):
        mem = _choose(cm, cluster, part, nm, candidates, j)
        if mem is None:
            return float("inf")
        p, q = part.bounds[j], part.bounds[j + 1]
        worst = max(worst, cm.stage_cost(part.gpus, j, p, q, nm, mem.placement).time_ms)
    return worst


def stage_placements(
    cm: CostModel,
    cluster: Cluster,
    part: Partition,
    nm: int,
    candidates: Sequence[MemoryPlacement],
) -> list[StageMemory]:
    """Every stage's fastest placement that fits (:meth:`CostModel.choose_placement`).

    Raises:
        PlanError: a stage fits no placement (its node's host memory is too small).
    """
    out = []
    for j, gpu in enumerate(part.gpus):
        mem = _choose(cm, cluster, part, nm, candidates, j)
        if mem is None:
            host = cluster.host_memory_bytes(gpu.node)
            raise PlanError(
                f"stage {j} on {gpu.label} fits no memory placement with Nm={nm} (host memory "
                f"{format_bytes(host)} per GPU of node {gpu.node}); raise host_memory of "
                "that node in the cluster file or lower --nm"
            )
        out.append(mem)
    return out
