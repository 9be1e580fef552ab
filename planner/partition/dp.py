"""Exact dynamic program for partitioning a model over a *fixed* GPU order (paper Sec. 4, 7).

The partition minimising the slowest stage is a bottleneck shortest path over the candidate
cut positions ``0..C``: ``best_j[q] = min_p max(best_{j-1}[p], cost_j[p, q])`` with
``cost_j[p, q] = inf`` when stage ``j`` over ``[p, q)`` does not fit its GPU's memory. Each
stage is one numpy ``(C+1) x (C+1)`` matrix, so the DP costs ``O(K C^2)`` and takes
milliseconds for hundreds of layers. It is the MILP's cross-check, upper bound and warm start.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np

from planner.cluster import Device
from planner.costmodel import CostModel
from planner.plan import StageCost
from profiler.errors import PlanError

__all__ = [
    "InfeasiblePartition",
    "Partition",
    "class_key",
    "distinct_orders",
    "partition_dp",
    "partition_dp_best_order",
]

log = logging.getLogger(__name__)


class InfeasiblePartition(PlanError):
    """No partition fits the GPUs' memory; ``shortfall_bytes`` is the smallest overflow of a stage."""

    def __init__(self, message: str, shortfall_bytes: int) -> None:
        super().__init__(message)
        self.shortfall_bytes = shortfall_bytes


@dataclass(frozen=True)
class Partition:
    """A partition of the model over one virtual worker.

    Attributes:
        gpus: the VW's GPUs in pipeline order.
        bounds: candidate positions ``0 = b_0 < b_1 < ... < b_K = C`` (stage ``j`` is ``[b_j, b_{j+1})``).
        cuts: the same bounds as layer indices (``0 .. L``).
        stage_ms: each stage's time per minibatch (cost model), ms.
        objective_ms: the optimum the solver reported (equals ``max(stage_ms)`` up to tolerance).
        solver: ``dp``, ``milp-cbc`` or ``milp-highs``.
        solve_s: wall-clock seconds the solve took.
        bound_ms: proven lower bound on the optimum bottleneck (``nan``: the exact solvers'
            own result, i.e. ``objective_ms``; smaller when a time limit or ``--max-cuts`` made
            the result an approximation).
    """

    gpus: tuple[Device, ...]
    bounds: tuple[int, ...]
    cuts: tuple[int, ...]
    stage_ms: tuple[float, ...]
    objective_ms: float
    solver: str
    solve_s: float
    bound_ms: float = float("nan")

    @property
    def lower_bound_ms(self) -> float:
        """Proven lower bound on the optimum bottleneck, ms."""
        return self.objective_ms if self.bound_ms != self.bound_ms else self.bound_ms

    @property
    def gap(self) -> float:
        """Relative gap ``bottleneck / lower bound - 1`` (0: proven optimal; float noise below
        1e-9 counts as 0)."""
        lb = self.lower_bound_ms
        gap = self.bottleneck_ms / lb - 1.0 if lb > 0 else 0.0
        return gap if gap > 1e-9 else 0.0

    @property
    def bottleneck_ms(self) -> float:
        """Time of the slowest stage, ms."""
        return max(self.stage_ms)

    def stages(self, cm: CostModel, nm: int) -> list[StageCost]:
        """The cost of every stage with ``nm`` minibatches in flight."""
        return [
            cm.stage_cost(self.gpus, j, self.bounds[j], self.bounds[j + 1], nm)
            for j in range(len(self.gpus))
        ]


def class_key(d: Device) -> tuple[str, str, int]:
    """GPUs with the same key are interchangeable in a pipeline: same type, node and memory."""
    return (d.type, d.node, d.memory_bytes)


def distinct_orders(gpus: Sequence[Device]) -> Iterator[tuple[Device, ...]]:
    """Every pipeline order of ``gpus`` up to swapping interchangeable GPUs (multiset permutations)."""
    groups: dict[tuple[str, str, int], list[Device]] = {}
    for g in gpus:
        groups.setdefault(class_key(g), []).append(g)
    keys = sorted(groups)
    counts = {k: len(v) for k, v in groups.items()}
    n = len(gpus)

    def rec(prefix: list[tuple[str, str, int]]) -> Iterator[list[tuple[str, str, int]]]:
        if len(prefix) == n:
            yield prefix
            return
        for k in keys:
            if counts[k]:
                counts[k] -= 1
                yield from rec([*prefix, k])
                counts[k] += 1

    for seq in rec([]):
        used = dict.fromkeys(keys, 0)
        order = []
        for k in seq:
            order.append(groups[k][used[k]])
            used[k] += 1
        yield tuple(order)


def _bottleneck(mats: Sequence[np.ndarray]) -> tuple[float, list[int]]:
    """Min over partitions of the max stage cost; ``mats[j][p, q]`` is stage ``j``'s cost."""
    c = mats[0].shape[0] - 1
    best = np.full(c + 1, np.inf)
    best[0] = -np.inf
    args = []
    cols = np.arange(c + 1)
    for m in mats:
        cand = np.maximum(best[:, None], m)
        arg = np.argmin(cand, axis=0)
        best = cand[arg, cols]
        args.append(arg)
    value = float(best[c])
    if not np.isfinite(value):
        return value, []
    bounds = [c]
    for arg in reversed(args):
        bounds.append(int(arg[bounds[-1]]))
    return value, bounds[::-1]


def _result(
    cm: CostModel,
    gpus: Sequence[Device],
    bounds: list[int],
    obj: float,
    nm: int,
    solver: str,
    t0: float,
) -> Partition:
    stage_ms = tuple(
        cm.stage_cost(gpus, j, bounds[j], bounds[j + 1], nm).time_ms for j in range(len(gpus))
    )
    return Partition(
        gpus=tuple(gpus),
        bounds=tuple(bounds),
        cuts=tuple(int(cm.positions[b]) for b in bounds),
        stage_ms=stage_ms,
        objective_ms=obj,
        solver=solver,
        solve_s=time.perf_counter() - t0,
    )


def _check_size(cm: CostModel, gpus: Sequence[Device]) -> None:
    if not gpus:
        raise PlanError("a virtual worker needs at least one GPU")
    if len(gpus) > cm.num_segments:
        raise PlanError(
            f"{len(gpus)} GPUs but the model has only {cm.num_segments} candidate cut segments; "
            f"use fewer GPUs per virtual worker"
        )


def _shortfall_mats(cm: CostModel, gpus: Sequence[Device], nm: int) -> list[np.ndarray]:
    k = len(gpus)
    return [cm.memory_matrix(k, j, nm) - gpus[j].memory_bytes for j in range(k)]


def partition_dp(
    cm: CostModel, gpus: Sequence[Device], nm: int = 1, memory: bool = True
) -> Partition:
    """Optimal partition of the model over ``gpus`` in this exact order.

    Args:
        cm: cost model.
        gpus: GPUs in pipeline order; stage ``j`` runs on ``gpus[j]``.
        nm: minibatches in flight (sets each stage's memory need).
        memory: enforce the memory limits.

    Raises:
        InfeasiblePartition: no partition fits (message names the smallest shortfall).
    """
    t0 = time.perf_counter()
    _check_size(cm, gpus)
    k = len(gpus)
    mats = []
    for j in range(k):
        m = cm.time_matrix(gpus, j, nm)
        if memory:
            m = np.where(cm.fits_matrix(gpus, j, nm), m, np.inf)
        mats.append(m)
    value, bounds = _bottleneck(mats)
    if not bounds:
        short, _ = _bottleneck(_shortfall_mats(cm, gpus, nm))
        order = "".join(g.letter for g in gpus)
        if short <= 0:  # device memory would do: the offloaded bytes exceed host memory
            raise InfeasiblePartition(
                f"no partition of {cm.num_layers} layers over {order} fits host memory with "
                f"Nm={nm} under {cm.placement}; raise the nodes' host_memory or lower --nm",
                0,
            )
        raise InfeasiblePartition(
            f"no partition of {cm.num_layers} layers over {order} fits memory with Nm={nm} "
            f"(smallest shortfall {int(np.ceil(short))} bytes on one stage)",
            int(np.ceil(short)),
        )
    return _result(cm, gpus, bounds, value, nm, "dp", t0)


def partition_dp_best_order(
    cm: CostModel, gpus: Sequence[Device], nm: int = 1, memory: bool = True, max_orders: int = 5040
) -> Partition:
    """Best partition over every distinct GPU order (enumerated; the MILP's reference optimum).

    Raises:
        InfeasiblePartition: no order admits a partition that fits.
        PlanError: more than ``max_orders`` distinct orders.
    """
    t0 = time.perf_counter()
    best: Partition | None = None
    shortfall: int | None = None
    for n, order in enumerate(distinct_orders(gpus)):
        if n >= max_orders:
            raise PlanError(f"more than {max_orders} distinct GPU orders; use the MILP partitioner")
        try:
            part = partition_dp(cm, order, nm, memory)
        except InfeasiblePartition as exc:
            shortfall = (
                exc.shortfall_bytes if shortfall is None else min(shortfall, exc.shortfall_bytes)
            )
            continue
        if best is None or part.objective_ms < best.objective_ms - 1e-12:
            best = part
    if best is None:
        raise InfeasiblePartition(
            f"no order of {len(gpus)} GPUs admits a partition that fits memory with Nm={nm} "
            f"(smallest shortfall {shortfall} bytes)",
            shortfall or 0,
        )
    return Partition(
        best.gpus,
        best.bounds,
        best.cuts,
        best.stage_ms,
        best.objective_ms,
        "dp",
        time.perf_counter() - t0,
    )
