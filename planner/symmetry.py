"""Simulate a large plan once per distinct group of VWs: identical node-disjoint groups run alike.

In the simulator (:mod:`planner.sim.engine`) virtual workers interact in two ways only: VWs
whose GPUs share a node share that node's network card, and every VW waits on the global
clock (the minimum of the VWs' clocks). Split the VWs into *groups* that share no node
(connected components of "shares a node"); two groups whose pipeline specs are equal up to
node names then follow the same event times, and the global clock is the same with one copy
of each distinct group as with all of them. So the plan is simulated with one representative
per distinct group, and each VW takes its representative's completion times; the throughput
is then measured over all VWs with the simulator's own definition
(:func:`planner.throughput.measured_throughput`). On a 10,240-GPU cluster of 1,280 HD VWs this
simulates 2 VWs instead of 1,280; :func:`simulate_distinct` equals the full simulation
(``tests/planner/test_symmetry.py``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace

from planner.plan import Plan
from planner.sim.engine import simulate_pipelines
from planner.sim.simulator import pipeline_specs
from planner.throughput import measured_throughput

__all__ = ["simulate_distinct", "vw_groups"]

Rate = Callable[[Sequence[Sequence[float]], int, int], float]
"""Samples/s from per-VW completion times (ms), Nm and the batch size."""


def vw_groups(plan: Plan) -> list[list[int]]:
    """The plan's VWs split into groups that share no node (each sorted; groups by first VW)."""
    parent = list(range(len(plan.virtual_workers)))

    def root(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    owner: dict[str, int] = {}
    for v, vw in enumerate(plan.virtual_workers):
        for gpu in vw.gpus:
            if gpu.node in owner:
                parent[root(v)] = root(owner[gpu.node])
            else:
                owner[gpu.node] = v
    groups: dict[int, list[int]] = {}
    for v in range(len(plan.virtual_workers)):
        groups.setdefault(root(v), []).append(v)
    return sorted(groups.values())


def _shape(plan: Plan, group: list[int]) -> tuple[object, ...]:
    """What the simulator sees of a group, with node names replaced by first-appearance numbers:
    each VW's stages and GPUs (with their node's GPU count and host memory), and the shards
    on the group's nodes (the shards elsewhere are then the same set too)."""
    names: dict[str, int] = {}
    vws = []
    for v in group:
        vw = plan.virtual_workers[v]
        gpus = []
        for g in vw.gpus:
            node = plan.cluster.node(g.node)
            gpus.append((names.setdefault(g.node, len(names)), g.type, g.memory_bytes, g.speed,
                         node.count, node.host_memory_bytes))  # fmt: skip
        vws.append((vw.stages, tuple(gpus)))
    shards = sorted(
        (names[sh.node], sh.layers, sh.param_bytes) for sh in plan.shards if sh.node in names
    )
    return (tuple(vws), tuple(shards))


def simulate_distinct(
    plan: Plan, waves: int, rate: Rate = measured_throughput
) -> tuple[float, tuple[float, ...]]:
    """``plan``'s simulated throughput (samples/s) and per-VW throughput, simulating one copy of
    each distinct group of VWs (module doc). ``rate`` turns every VW's completion times into
    the throughput: the window a run of ``waves`` measures (default), or
    :func:`planner.throughput.steady_throughput` (the planner's prediction).

    Raises:
        PlanError: the simulator refuses the plan.
    """
    reps: dict[tuple[object, ...], int] = {}  # shape -> index of its first VW in ``picked``
    picked: list[int] = []
    of_vw: list[int] = [0] * len(plan.virtual_workers)  # each VW's position in ``picked``
    for group in vw_groups(plan):
        shape = _shape(plan, group)
        if shape not in reps:
            reps[shape] = len(picked)
            picked.extend(group)
        for j, v in enumerate(group):
            of_vw[v] = reps[shape] + j
    reduced = replace(plan, virtual_workers=tuple(plan.virtual_workers[v] for v in picked))
    specs = pipeline_specs(reduced)
    res = simulate_pipelines(specs, plan.nm, plan.D, waves, plan.batch_size)
    completions = [res.completions_ms[i] for i in of_vw]
    throughput = rate(completions, plan.nm, plan.batch_size)
    return throughput, tuple(res.per_vw_throughput[i] for i in of_vw)
