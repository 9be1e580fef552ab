"""Bounds that make the partition MILP fast: GPU classes, DP upper bound, boundary windows.

All helpers are pure functions of the cost model. ``UB`` is a feasible bottleneck (ms), so any
optimal solution has every stage's compute ``<= UB``; since compute is monotone in a stage's
layer range, the furthest position a sequence of GPUs can cover greedily bounds where each
stage boundary can lie. The MILP fixes every staircase variable outside these windows.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from planner.cluster import Device
from planner.costmodel import CostModel
from planner.partition.dp import (
    InfeasiblePartition,
    Partition,
    class_key,
    distinct_orders,
    partition_dp,
)

__all__ = [
    "EPS",
    "Classes",
    "classes",
    "heuristic_orders",
    "order_reach",
    "reach_table",
    "upper_bound",
    "windows",
]

EPS = 1e-7
"""Relative slack on the upper bound (solver tolerances)."""


@dataclass(frozen=True)
class Classes:
    keys: tuple[tuple[str, str, int], ...]
    reps: tuple[Device, ...]  # one device per class
    members: tuple[tuple[Device, ...], ...]


def classes(gpus: Sequence[Device]) -> Classes:
    """Group interchangeable GPUs (same type, node and memory) into classes."""
    groups: dict[tuple[str, str, int], list[Device]] = {}
    for g in gpus:
        groups.setdefault(class_key(g), []).append(g)
    keys = tuple(sorted(groups))
    return Classes(keys, tuple(groups[k][0] for k in keys), tuple(tuple(groups[k]) for k in keys))


def heuristic_orders(
    cls: Classes, cm: CostModel, gpus: Sequence[Device]
) -> list[tuple[Device, ...]]:
    """A few natural orders: as given, fastest first/last, by memory, grouped by node."""
    speed = {t: float(cm.compute_ms(t)[-1]) for t in {r.type for r in cls.reps}}
    keyfns = [
        lambda d: (speed[d.type], d.node),
        lambda d: (-speed[d.type], d.node),
        lambda d: (-d.memory_bytes, d.node),
        lambda d: (d.memory_bytes, d.node),
    ]
    orders = [tuple(gpus)] + [tuple(sorted(gpus, key=f)) for f in keyfns]
    return list(dict.fromkeys(orders))


def upper_bound(
    cm: CostModel, cls: Classes, gpus: Sequence[Device], nm: int, memory: bool, max_orders: int = 24
) -> Partition | None:
    """Best DP partition over every distinct order when there are at most ``max_orders`` of them,
    else over a few heuristic orders (``None`` if none fits memory)."""
    orders = list(itertools.islice(distinct_orders(gpus), max_orders + 1))
    if len(orders) > max_orders:
        orders = heuristic_orders(cls, cm, gpus)
    best: Partition | None = None
    for order in orders:
        try:
            part = partition_dp(cm, order, nm, memory)
        except InfeasiblePartition:
            continue
        if best is None or part.objective_ms < best.objective_ms:
            best = part
    return best


def reach_table(
    comp: Sequence[np.ndarray], counts: Sequence[int], ub: float
) -> dict[tuple[int, ...], int]:
    """Furthest position the GPUs of each class multiset (count vector) can cover from position 0.

    For a fixed order the greedy furthest reach is optimal (compute is monotone in the range),
    so a DP over class multisets gives the exact maximum over their orders, ignoring comm and
    memory (a relaxation: valid bounds for the MILP).
    """
    slack = ub * (1 + EPS) + 1e-9
    zero = tuple(0 for _ in counts)
    reach: dict[tuple[int, ...], int] = {zero: 0}
    frontier = [zero]
    for _ in range(sum(counts)):
        nxt: dict[tuple[int, ...], int] = {}
        for state in frontier:
            p = reach[state]
            for t, n in enumerate(counts):
                if state[t] >= n:
                    continue
                q = int(np.searchsorted(comp[t], comp[t][p] + slack, side="right")) - 1
                st = tuple(c + (1 if i == t else 0) for i, c in enumerate(state))
                nxt[st] = max(nxt.get(st, 0), q)
        reach.update(nxt)
        frontier = list(nxt)
    return reach


def _reach(comp: Sequence[np.ndarray], counts: Sequence[int], ub: float, k: int) -> list[int]:
    """``out[m]``: furthest position any ``m`` of the GPUs can cover from position 0."""
    table = reach_table(comp, counts, ub)
    return [max((r for st, r in table.items() if sum(st) == m), default=0) for m in range(k + 1)]


def order_reach(
    comp: Sequence[np.ndarray], order: Sequence[int], ub: float
) -> tuple[list[int], list[int]]:
    """Boundary bounds for a fixed class ``order``: greedy reach from the end and from the start.

    With every stage's compute ``<= UB``, boundary ``j`` lies in ``[lo[j], hi[j]]``.
    """
    slack = ub * (1 + EPS) + 1e-9
    c = len(comp[0]) - 1
    p, hi = 0, []
    for t in order[:-1]:
        p = int(np.searchsorted(comp[t], comp[t][p] + slack, side="right")) - 1
        hi.append(min(p, c))
    q, lo = c, []
    for t in reversed(order[1:]):
        q = int(np.searchsorted(comp[t], comp[t][q] - slack, side="left"))
        lo.append(max(q, 0))
    return lo[::-1], hi


def windows(
    cm: CostModel, cls: Classes, k: int, ub: float | None, order: Sequence[int] | None = None
) -> list[tuple[int, int]]:
    """Feasible positions ``[lo_j, hi_j]`` of every boundary ``j = 0..K-2`` (``order``: fixed classes)."""
    c = cm.num_segments
    out = [(j + 1, c - (k - 1 - j)) for j in range(k - 1)]
    if ub is not None:
        comp = [cm.compute_ms(r.type) for r in cls.reps]
        if order is not None:
            lo_o, hi_o = order_reach(comp, order, ub)
            out = [(max(lo, a), min(hi, b)) for (lo, hi), a, b in zip(out, lo_o, hi_o, strict=True)]
        counts = [len(m) for m in cls.members]
        fwd = _reach(comp, counts, ub, k)
        rev = _reach([(x[-1] - x)[::-1] for x in comp], counts, ub, k)
        out = [(max(lo, c - rev[k - 1 - j]), min(hi, fwd[j + 1])) for j, (lo, hi) in enumerate(out)]
    for j in range(1, len(out)):  # boundaries strictly increase
        out[j] = (max(out[j][0], out[j - 1][0] + 1), out[j][1])
    for j in range(len(out) - 2, -1, -1):
        out[j] = (out[j][0], min(out[j][1], out[j + 1][1] - 1))
    if any(lo > hi for lo, hi in out):
        return []
    return out
