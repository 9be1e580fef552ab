"""The per-VW solver: the largest feasible Nm and the optimal partition of one VW's GPUs.

:class:`VWSolver` answers, for a VW's GPUs, the largest Nm that fits memory (bisection with
the exact every-order check) and the optimal GPU order and split at an Nm (the exact DP search
or the MILP), under the memory placements ``--memory`` allows. Both are cached over
isomorphic VWs (same GPU types and node pattern, e.g. the four ED VWs: solved once), and an
optimum at a smaller Nm that still fits is reused (:meth:`VWSolver._reusable`).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from planner.cluster import Cluster, Device
from planner.costmodel import CostModel
from planner.memory_choice import memory_candidates, memory_ladder, refined_ms
from planner.offload import MemoryPlacement
from planner.partition.dp import Partition
from planner.partition.memory import fits_memory, min_memory_shortfall
from planner.partition.milp import partition_milp
from planner.partition.search import lower_bound_ms, partition_exact
from planner.plan import StagePlan
from profiler.errors import PlanError

if TYPE_CHECKING:
    from planner.planner import PlanOptions

__all__ = ["VWSolver", "letters", "pipeline_key"]

log = logging.getLogger(__name__)


@dataclass
class VWSolver:
    """One planning run's solver of VWs (with its caches); ``make_plan`` builds one."""

    cluster: Cluster
    cm: CostModel
    opts: PlanOptions
    original: Cluster  # the cluster as given (stored in the plan)
    full: CostModel | None = None  # the uncoarsened model when --max-cuts coarsened ``cm``
    cache: dict[tuple[object, ...], tuple[tuple[int, ...], tuple[int, ...], float, str]] = field(
        default_factory=dict
    )
    nm_cache: dict[tuple[object, ...], tuple[int, int]] = field(default_factory=dict)
    cms: dict[MemoryPlacement, CostModel] = field(default_factory=dict)
    stage_cache: dict[tuple[object, ...], tuple[StagePlan, ...]] = field(default_factory=dict)

    # ------------------------------------------------------------ memory placements
    @property
    def ladder(self) -> tuple[MemoryPlacement, ...]:
        """Uniform placements the partitioner may use, cheapest first (``opts.memory``)."""
        return memory_ladder(self.opts.memory)

    @property
    def candidates(self) -> tuple[MemoryPlacement, ...]:
        """Placements one stage may take after partitioning."""
        return memory_candidates(self.opts.memory)

    def cm_for(self, placement: MemoryPlacement) -> CostModel:
        """The cost model with every stage under ``placement``."""
        if placement not in self.cms:
            self.cms[placement] = self.cm.with_placement(placement)
        return self.cms[placement]

    # ------------------------------------------------------------ isomorphic VWs
    @staticmethod
    def canonical(gpus: Sequence[Device]) -> tuple[tuple[object, ...], list[Device]]:
        """A key equal for VWs that differ only by node names/indices, and the GPUs in key order."""
        ordered = sorted(gpus, key=lambda d: (d.type, d.memory_bytes, d.node, d.index))
        ids: dict[str, int] = {}
        key = tuple((d.type, d.memory_bytes, ids.setdefault(d.node, len(ids))) for d in ordered)
        return key, ordered

    def nm_max(self, gpus: Sequence[Device]) -> tuple[int, int]:
        """Largest feasible Nm (0 if none) and the Nm=1 shortfall in bytes when infeasible."""
        key, ordered = self.canonical(gpus)
        if key not in self.nm_cache:
            self.nm_cache[key] = self._nm_max(ordered)
        return self.nm_cache[key]

    def _nm_max(self, gpus: Sequence[Device]) -> tuple[int, int]:
        """The largest Nm over the ladder's placements, and the smallest Nm=1 shortfall."""
        found, host_error = [], None
        for pl in self.ladder:
            try:
                found.append(self._nm_max_under(self.cm_for(pl), gpus))
            except PlanError as exc:  # its offloaded bytes exceed host memory at any size
                host_error = host_error or exc
        if not found and host_error is not None:
            raise host_error
        best = max(nm for nm, _ in found)
        return (best, 0) if best else (0, min(short for _, short in found))

    def _nm_max_under(self, cm: CostModel, gpus: Sequence[Device]) -> tuple[int, int]:
        """Bisection on Nm with the exact every-order memory check (:mod:`planner.partition.memory`)."""
        if not fits_memory(cm, gpus, 1):
            return 0, min_memory_shortfall(cm, gpus, 1)
        lo, hi = 1, 2
        while hi <= self.opts.nm_limit and fits_memory(cm, gpus, hi):
            lo, hi = hi, hi * 2
        hi = min(hi, self.opts.nm_limit + 1)
        while hi - lo > 1:  # lo fits, hi does not (or exceeds the limit)
            mid = (lo + hi) // 2
            if fits_memory(cm, gpus, mid):
                lo = mid
            else:
                hi = mid
        return lo, 0

    def partition(self, gpus: Sequence[Device], nm: int, screen: bool = False) -> Partition:
        """Optimal order and split of ``gpus`` at ``nm`` (cached over isomorphic VWs).

        With several ladder placements (``--memory auto``) each one under which the VW fits is
        partitioned, and the partition whose slowest stage is fastest once each stage takes its
        own best placement (:meth:`refined_ms`) wins; ties go to the cheaper ladder entry.

        ``screen``: use the exact DP search whatever the partitioner, for comparing Nm
        candidates; the final plan uses ``opts.partitioner``.
        """
        best: tuple[float, Partition] | None = None
        for pl in self.ladder:
            if len(self.ladder) > 1 and not fits_memory(self.cm_for(pl), gpus, nm):
                continue
            part = self._partition_under(gpus, nm, screen, pl)
            ms = (
                refined_ms(self.cm, self.cluster, part, nm, self.candidates)
                if len(self.ladder) > 1
                else part.bottleneck_ms
            )
            if best is None or ms < best[0]:
                best = (ms, part)
        if best is None:  # nothing fits: the partitioner's own error names the shortfall
            return self._partition_under(gpus, nm, screen, self.ladder[-1])
        return best[1]

    def _partition_under(
        self, gpus: Sequence[Device], nm: int, screen: bool, placement: MemoryPlacement
    ) -> Partition:
        """Optimal order and split of ``gpus`` at ``nm`` with every stage under ``placement``."""
        key, ordered = self.canonical(gpus)
        use_dp = self.opts.partitioner == "dp" or screen
        cm = self.cm_for(placement)
        ck = (key, nm, use_dp, placement)
        if ck not in self.cache:
            reuse = self._reusable(key, ordered, nm, use_dp, placement)
            if reuse is not None:
                self.cache[ck] = reuse
        if ck not in self.cache:
            limit = self.opts.time_limit_s
            if use_dp:
                part = partition_exact(cm, ordered, nm, time_limit_s=limit)
            elif self.opts.partitioner == "milp":
                part = partition_milp(cm, ordered, nm, solver=self.opts.solver, time_limit_s=limit)
            else:
                raise PlanError(f"unknown partitioner {self.opts.partitioner!r}; use dp or milp")
            bound = part.lower_bound_ms
            if self.full is not None:  # coarsened (--max-cuts): bound the exact optimum instead
                bound = min(bound, lower_bound_ms(self.full, ordered))
            where = {id(d): i for i, d in enumerate(ordered)}
            perm = tuple(where[id(d)] for d in part.gpus)
            entry = (perm, part.bounds, bound, part.solver)
            if part.gap > 1e-9:  # stopped by its time limit: a later solve with more time
                return self._rebuild(cm, ordered, nm, entry)  # may do better: not cached
            self.cache[ck] = entry
            log.info(
                "partitioned %s at Nm=%d with %s in %.3f s (gap %.2g)",
                letters(part.gpus),
                nm,
                part.solver,
                part.solve_s,
                part.gap,
            )
        return self._rebuild(cm, ordered, nm, self.cache[ck])

    @staticmethod
    def _rebuild(
        cm: CostModel,
        ordered: Sequence[Device],
        nm: int,
        entry: tuple[tuple[int, ...], tuple[int, ...], float, str],
    ) -> Partition:
        """The partition of a solved (perm, bounds, bound, solver) entry for these GPUs."""
        perm, bounds, bound, solver = entry
        order = tuple(ordered[i] for i in perm)
        stage_ms = tuple(
            cm.stage_cost(order, j, bounds[j], bounds[j + 1], nm).time_ms for j in range(len(order))
        )
        cuts = tuple(int(cm.positions[b]) for b in bounds)
        return Partition(order, bounds, cuts, stage_ms, max(stage_ms), solver, 0.0, bound)

    def _reusable(
        self,
        key: tuple[object, ...],
        ordered: Sequence[Device],
        nm: int,
        use_dp: bool,
        placement: MemoryPlacement,
    ) -> tuple[tuple[int, ...], tuple[int, ...], float, str] | None:
        """An optimum at a smaller Nm that still fits memory at ``nm`` (then it is optimal here too).

        Memory only grows with Nm, so the feasible partitions at ``nm`` are a subset of those
        at any smaller Nm: the smaller Nm's optimum, when it fits and the stage times are the
        same at both (the placement moves the same bytes), is optimal at ``nm``; its lower
        bound stays valid.
        """
        same = (key, use_dp, placement)
        done = sorted(
            ((ck[1], v) for ck, v in self.cache.items() if (ck[0], ck[2], ck[3]) == same),
            key=lambda item: item[0] if isinstance(item[0], int) else 0,
        )
        cm = self.cm_for(placement)
        for small, (perm, bounds, bound, solver) in reversed(done):
            if not isinstance(small, int) or small >= nm:
                continue
            if not cm.same_times(len(ordered), small, nm):  # more moves at ``nm``: re-solve
                continue
            order = [ordered[i] for i in perm]
            if all(
                cm.stage_cost(order, j, bounds[j], bounds[j + 1], nm).memory_bytes
                <= order[j].memory_bytes
                for j in range(len(order))
            ):
                return perm, bounds, bound, solver
        return None


def pipeline_key(cluster: Cluster, gpus: Sequence[Device]) -> tuple[object, ...]:
    """A key equal for pipelines (GPUs in stage order) that differ only by node names: each GPU's
    type and memory, its node's first-appearance number, GPU count and host memory."""
    ids: dict[str, int] = {}
    out = []
    for d in gpus:
        node = cluster.node(d.node)
        out.append(
            (
                d.type,
                d.memory_bytes,
                ids.setdefault(d.node, len(ids)),
                node.count,
                node.host_memory_bytes,
            )
        )
    return tuple(out)


def letters(gpus: Sequence[Device]) -> str:
    """The GPUs' type letters in order, e.g. ``VVRQ``."""
    return "".join(d.letter for d in gpus)
