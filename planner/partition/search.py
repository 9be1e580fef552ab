"""Exact order *and* split of one virtual worker: a DP over GPU-class multisets, pruned by bounds.

The problem (paper Sec. 4, 7; the cost model is :class:`planner.costmodel.CostModel`): choose the
VW's GPU order and its ``K - 1`` cut positions so that the slowest stage is as fast as possible,
every stage fitting its GPU's memory. Stage ``j`` on a GPU of class ``u`` over positions ``[p, q)``
takes ``comp_u[q] - comp_u[p] + recv(p) + send(q)`` ms, where ``recv``/``send`` are the link times
to its neighbours. A link depends only on the two GPUs' classes (interchangeable GPUs: same type,
node and memory), so a partial pipeline is summarised by a *state*: the multiset of classes used,
the class ``u`` of its last (open) stage and the link into it. Per state a vector ``F[p]`` holds the
smallest possible slowest *closed* stage when the open stage starts at ``p``. Choosing the next
class ``s`` closes the open stage::

    F'[q] = min_{p < q, stage fits} max(F[p], comp_u[q] - comp_u[p] + recv(p) + send_{u,s}(q))

This is exact for every order at once (orders of identical GPUs are never told apart), and its
size is polynomial: ``prod(n_t + 1)`` multisets x classes x links, not ``K! / prod(n_t!)`` orders.

Bounds keep it fast. A few heuristic orders (fixed-order DPs through the same code) give an
incumbent ``UB``; an ``F`` entry ``>= UB`` is dropped, and so is a start ``p`` whose work bound
exceeds ``UB``::

    LB(p) = (W[p..C] + recv(p) / rho_u) / (1 / rho_u + sum over the GPUs still unused of 1 / rho_g)

with ``W`` the per-segment minimum over classes of compute and ``rho_t >= 1`` class ``t``'s smallest
slowdown against it (a GPU of class ``t`` does at most ``T / rho_t`` of that work in ``T`` ms).
The surviving starts form narrow windows, so each step is a small matrix. When a time limit is
hit, the incumbent is returned with the proven lower bound: the smallest bound of any state not
yet expanded (every pipeline passes through one of them). (Bisecting on a target between the
lower bound and the incumbent was tried: measured side by side it was 0-2x slower.)
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence

import numpy as np

from planner.cluster import Device
from planner.costmodel import CostModel
from planner.partition.bounds import heuristic_orders
from planner.partition.dp import InfeasiblePartition, Partition, class_key
from planner.partition.memory import (
    check_stage_count,
    feasible_order,
    min_memory_shortfall,
)
from planner.partition.search_tables import SearchTables, State
from profiler.errors import PlanError
from profiler.units import format_bytes

__all__ = ["lower_bound_ms", "partition_exact"]

log = logging.getLogger(__name__)

_TOL = 1e-9  # relative: a partition must beat the incumbent by more than this to replace it


_Part = tuple[int, np.ndarray, int, np.ndarray]
"""Closed stages reaching a state from one parent: window start, ``F``, parent id, argmin ``p``."""


class _Timeout(Exception):
    def __init__(self, bound: float) -> None:
        super().__init__("time limit")
        self.bound = bound


class _Search(SearchTables):
    """Tables of one VW at one Nm, and the layered DP over states."""

    def __init__(self, cm: CostModel, gpus: Sequence[Device], nm: int, memory: bool) -> None:
        super().__init__(cm, gpus, nm, memory)
        self.states: list[State] = []

    def close(
        self, st: State, j: int, out: np.ndarray, inc: float
    ) -> tuple[int, np.ndarray, np.ndarray] | None:
        """Close ``st``'s open stage ``j`` (send times ``out``): window start, ``F'``, argmin ``p``."""
        rows = np.flatnonzero(st.f < inc)
        if not rows.size:
            return None
        p = st.lo + rows
        comp = self.comp[st.u]  # a lower bound on the busy time: prunes the ends
        a = comp[p] - self.recv(st)[p]  # stage cost >= comp[q] - a + out[q]
        qm = self.qmax(st.u, j)[p]
        if np.isfinite(inc):
            qm = np.minimum(qm, np.searchsorted(comp, a + inc, side="left") - 1)
        q_lo, q_hi = int(p[0]) + 1, min(self.c - (self.k - 1 - j), int(qm.max()))
        if q_hi < q_lo:
            return None
        cols = np.arange(q_lo, q_hi + 1)
        cost = self.busy(st.u, j, p[:, None], cols[None, :]) + self.recv(st)[p][:, None]
        cand = np.maximum(st.f[rows][:, None], cost + out[cols][None, :])
        valid = (cols[None, :] > p[:, None]) & (cols[None, :] <= qm[:, None])
        cand = np.where(valid, cand, np.inf)
        arg = np.argmin(cand, axis=0)
        val = cand[arg, np.arange(len(cols))]
        val[val >= inc] = np.inf
        keep = np.flatnonzero(np.isfinite(val))
        if not keep.size:
            return None
        sl = slice(int(keep[0]), int(keep[-1]) + 1)
        return q_lo + sl.start, val[sl], p[arg][sl]

    def finish(self, st: State, inc: float) -> tuple[float, int]:
        """Best value and start of the last stage (``inf`` if none beats ``inc``)."""
        p = np.arange(st.lo, st.lo + len(st.f))
        val = np.maximum(st.f, self.busy(st.u, self.k - 1, p, np.array(self.c)) + self.recv(st)[p])
        val[self.qmax(st.u, self.k - 1)[p] < self.c] = np.inf
        i = int(np.argmin(val))
        return (float(val[i]), int(p[i])) if val[i] < inc else (np.inf, -1)

    # ------------------------------------------------------------ the layered DP
    def _materialize(self, key: tuple[tuple[int, ...], int, int], parts: list[_Part]) -> int:
        """One state from the closed stages reaching ``key`` (elementwise best); its id."""
        used, u, link = key
        if len(parts) == 1:
            lo, f, sid, arg = parts[0]
            st = State(used, u, link, lo, f, np.full(len(f), sid), arg)
        else:
            lo = min(x[0] for x in parts)
            width = max(x[0] + len(x[1]) for x in parts) - lo
            vals = np.full((len(parts), width), np.inf)
            starts = np.full((len(parts), width), -1, dtype=np.int64)
            for i, (plo, f, _, arg) in enumerate(parts):
                vals[i, plo - lo : plo - lo + len(f)] = f
                starts[i, plo - lo : plo - lo + len(f)] = arg
            pick = np.argmin(vals, axis=0)
            cols = np.arange(width)
            sids = np.array([x[2] for x in parts], dtype=np.int64)
            st = State(used, u, link, lo, vals[pick, cols], sids[pick], starts[pick, cols])
        self.states.append(st)
        return len(self.states) - 1

    def run(
        self, inc: float, seq: Sequence[int] | None = None, deadline: float | None = None
    ) -> tuple[float, int, int]:
        """Best value ``< inc``, its final state id and last-stage start (``inf, -1, -1``: none).

        ``seq`` fixes the class order (a fixed-order DP); ``deadline`` (perf_counter) may raise
        :class:`_Timeout` carrying the proven lower bound.
        """
        n_cls = len(self.counts)
        pending: dict[tuple[tuple[int, ...], int, int], list[_Part]] = {}
        firsts = [seq[0]] if seq is not None else [t for t in range(n_cls) if self.counts[t]]
        for u in firsts:
            used = tuple(int(t == u) for t in range(n_cls))
            pending[used, u, -1] = [(0, np.zeros(1), -1, np.full(1, -1, dtype=np.int64))]
        best = (np.inf, -1, -1)
        back = self.back_table(inc * (1 - _TOL)) if np.isfinite(inc) and seq is None else None
        for j in range(self.k):
            ids = [self._materialize(key, parts) for key, parts in pending.items()]
            pending = {}
            for n, sid in enumerate(ids):
                if deadline is not None and time.perf_counter() > deadline:
                    rest = ids[n:] + [self._materialize(k, v) for k, v in pending.items()]
                    bound = min([self.state_bound(self.states[i]) for i in rest] + [inc])
                    raise _Timeout(bound)
                st = self.states[sid]
                cut = min(inc, best[0]) * (1 - _TOL)  # improvements below 1e-9 do not count
                if np.isfinite(cut):
                    st.f = np.where(self.bound(st) >= cut, np.inf, st.f)
                if back is not None and j < self.k - 1:
                    st.f = np.where(self.reach(st, cut) < back[self.rest(st)], np.inf, st.f)
                if j == self.k - 1:
                    val, p = self.finish(st, cut)
                    if val < best[0]:
                        best = (val, sid, p)
                    continue
                nexts = [seq[j + 1]] if seq is not None else range(n_cls)
                by_link: dict[int, list[int]] = {}
                for s in nexts:
                    if st.used[s] < self.counts[s]:
                        by_link.setdefault(self.link_of[st.u, s], []).append(s)
                for link, group in by_link.items():
                    res = self.close(st, j, self.comm[link], cut)
                    if res is None:
                        continue
                    lo, f, arg = res
                    for s in group:
                        used = tuple(x + (i == s) for i, x in enumerate(st.used))
                        pending.setdefault((used, s, link), []).append((lo, f, sid, arg))
        return best

    def solution(self, sid: int, p: int) -> tuple[list[int], list[int]]:
        """Class order and stage bounds ending in state ``sid`` with the last stage from ``p``."""
        order, starts = [], []
        while sid >= 0:
            st = self.states[sid]
            order.append(st.u)
            starts.append(p)
            sid, p = int(st.prev[p - st.lo]), int(st.prev_p[p - st.lo])
        return order[::-1], [*starts[::-1], self.c]


def lower_bound_ms(cm: CostModel, gpus: Sequence[Device]) -> float:
    """A proven lower bound on the bottleneck of any order and partition of ``gpus`` (work bound)."""
    search = _Search(cm, gpus, 1, memory=False)
    return float(search.work[-1] / sum(search.inv_rho[i] * n for i, n in enumerate(search.counts)))


def _incumbent(
    search: _Search, cm: CostModel, gpus: Sequence[Device], nm: int, memory: bool
) -> tuple[float, tuple[int, int]]:
    """The best of a few heuristic orders (fixed-order DPs): its value, final state and start."""
    inc, found = np.inf, (-1, -1)
    for order in [*heuristic_orders(search.cls, cm, gpus), None]:
        if order is None:  # no heuristic order fits memory: take one that does, if any
            fit = feasible_order(cm, gpus, nm) if memory and not np.isfinite(inc) else None
            if fit is None:
                break
            order = tuple(fit)
        seq = [search.cls.keys.index(class_key(d)) for d in order]
        val, sid, p = search.run(inc, seq=seq)
        if val < inc:
            inc, found = val, (sid, p)
    return inc, found


def _no_partition(
    cm: CostModel, gpus: Sequence[Device], nm: int, bound: float, time_limit_s: float | None
) -> PlanError:
    """Why no partition was found: the time limit, or memory (with the smallest shortfall)."""
    if np.isfinite(bound):
        return PlanError(
            f"the partition search hit its time limit ({time_limit_s:g} s) before finding a "
            f"partition that fits memory; raise the time limit (--time-limit)"
        )
    short = min_memory_shortfall(cm, gpus, nm)
    letters = "".join(g.letter for g in gpus)
    return InfeasiblePartition(
        f"no order and partition of {cm.num_layers} layers over {letters} fits memory with "
        f"Nm={nm} (smallest shortfall {format_bytes(short)} on one stage)",
        short,
    )


def partition_exact(
    cm: CostModel,
    gpus: Sequence[Device],
    nm: int = 1,
    memory: bool = True,
    time_limit_s: float | None = None,
) -> Partition:
    """Optimal GPU order and partition of one VW (every distinct order), proven by the DP's bounds.

    Args:
        cm: cost model.
        gpus: the VW's GPUs (any order).
        nm: minibatches in flight (sets each stage's memory need).
        memory: enforce the memory limits.
        time_limit_s: stop after this long; the best partition found is returned with
            ``bound_ms`` the proven lower bound (``None``: no limit).

    Raises:
        InfeasiblePartition: no order and partition fit memory (names the smallest shortfall).
        PlanError: more GPUs than candidate segments, a bad profile, or the time limit hit
            before any partition that fits was found.
    """
    t0 = time.perf_counter()
    check_stage_count(cm, len(gpus))
    search = _Search(cm, gpus, nm, memory)
    deadline = None if time_limit_s is None else t0 + time_limit_s
    inc, found = _incumbent(search, cm, gpus, nm, memory)
    label, lo = "dp", search.root_bound()
    try:
        val, sid, p = search.run(inc, deadline=deadline)
        if val < inc:
            inc, found = val, (sid, p)
        bound = inc
    except _Timeout as exc:
        bound, label = min(inc, max(lo, exc.bound)), "dp (time limit)"
        log.info("exact partition: time limit %.1f s hit; bound %.4f ms", time_limit_s, bound)
    if found[0] < 0:
        raise _no_partition(cm, gpus, nm, bound, time_limit_s)
    class_order, bounds = search.solution(*found)
    pools = [list(m) for m in search.cls.members]
    order = tuple(pools[t].pop(0) for t in class_order)
    stage_ms = tuple(
        cm.stage_cost(order, j, bounds[j], bounds[j + 1], nm).time_ms for j in range(len(order))
    )
    return Partition(
        gpus=order,
        bounds=tuple(bounds),
        cuts=tuple(int(cm.positions[b]) for b in bounds),
        stage_ms=stage_ms,
        objective_ms=float(inc),
        solver=label,
        solve_s=time.perf_counter() - t0,
        bound_ms=float(min(bound, inc)),
    )
