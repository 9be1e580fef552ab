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

import bisect
import itertools
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from planner.cluster import Device, Link
from planner.costmodel import CostModel
from planner.partition.bounds import classes, heuristic_orders
from planner.partition.dp import InfeasiblePartition, Partition, class_key
from planner.partition.memory import (
    MemoryLimits,
    check_stage_count,
    feasible_order,
    min_memory_shortfall,
)
from planner.schedule import in_flight_bound
from profiler.errors import PlanError
from profiler.units import format_bytes

__all__ = ["lower_bound_ms", "partition_exact"]

log = logging.getLogger(__name__)

_TOL = 1e-9  # relative: a partition must beat the incumbent by more than this to replace it


@dataclass
class _State:
    used: tuple[int, ...]
    u: int  # class of the open stage
    link: int  # link into the open stage (index into _Search.links; -1: first stage)
    lo: int  # position of f[0]
    f: np.ndarray  # smallest slowest closed stage per start position
    prev: np.ndarray  # predecessor state id per position (-1: none)
    prev_p: np.ndarray  # start of the predecessor's open stage


_Part = tuple[int, np.ndarray, int, np.ndarray]
"""Closed stages reaching a state from one parent: window start, ``F``, parent id, argmin ``p``."""


class _Timeout(Exception):
    def __init__(self, bound: float) -> None:
        super().__init__("time limit")
        self.bound = bound


class _Search:
    """Tables of one VW at one Nm, and the layered DP over states."""

    def __init__(self, cm: CostModel, gpus: Sequence[Device], nm: int, memory: bool) -> None:
        self.cm, self.nm, self.k, self.c = cm, nm, len(gpus), cm.num_segments
        self.cls = classes(gpus)
        reps = self.cls.reps
        self.counts = tuple(len(m) for m in self.cls.members)
        self.comp = [cm.compute_ms(r.type) for r in reps]
        for r, comp in zip(reps, self.comp, strict=True):
            if np.any(np.diff(comp) < 0) or not np.all(np.isfinite(comp)):
                raise PlanError(
                    f"the profile for {r.type!r} has negative or non-finite layer times; re-profile"
                )
        self.links: list[Link] = []
        self.link_of: dict[tuple[int, int], int] = {}
        for t, a in enumerate(self.cls.members):
            for u, b in enumerate(self.cls.members):
                if t == u and len(a) < 2:
                    continue
                link = cm.link(a[0], b[1] if t == u else b[0])
                if link not in self.links:
                    self.links.append(link)
                self.link_of[t, u] = self.links.index(link)
        self.comm = [cm.comm_ms(link) for link in self.links]
        self.zero = np.zeros(self.c + 1)
        self.mem = MemoryLimits(cm, nm) if memory else None
        segs = [np.diff(c) for c in self.comp]
        fast = np.min(np.stack(segs), axis=0)
        pos = fast > 0
        self.inv_rho = [float(1.0 / np.min(s[pos] / fast[pos])) if pos.any() else 1.0 for s in segs]
        self.work = np.concatenate([[0.0], np.cumsum(fast)])
        self.comm_sums = self._comm_sums()
        self.segs = segs
        self._largest: dict[tuple[bool, ...], np.ndarray] = {}
        self.states: list[_State] = []

    def back_table(self, limit: float) -> dict[tuple[int, ...], int]:
        """``out[R]``: the earliest position from which the GPUs of multiset ``R`` can cover the
        model's end with every stage's compute ``< limit`` (transfers and memory ignored).

        For a fixed order, covering greedily from the end reaches furthest (compute is monotone
        in a stage's range), so a DP over multisets gives the best over their orders: a state
        whose open stage cannot reach ``out[rest]`` cannot beat ``limit``.
        """
        out: dict[tuple[int, ...], int] = {tuple(0 for _ in self.counts): self.c}
        grid = sorted(itertools.product(*(range(n + 1) for n in self.counts)), key=sum)
        for rest in grid[1:]:
            best = self.c
            for t, n in enumerate(rest):
                if n:
                    q = out[tuple(x - (i == t) for i, x in enumerate(rest))]
                    comp = self.comp[t]
                    best = min(best, int(np.searchsorted(comp, comp[q] - limit, side="right")))
            out[rest] = best
        return out

    def _comm_sums(self) -> np.ndarray:
        """``out[r, p]``: the sum of the ``r`` cheapest boundary transfers at positions ``> p``.

        Every boundary costs its transfer time twice (send on one side, receive on the other),
        on some link, at a distinct position: ``2 * out[r, p]`` bounds the transfer time of the
        ``r`` boundaries still to place after ``p``.
        """
        cheapest = np.min(np.stack(self.comm), axis=0) if self.comm else self.zero
        out = np.zeros((self.k + 1, self.c + 1))
        smallest: list[float] = []
        for p in range(self.c - 1, -1, -1):  # boundaries lie in 1 .. C-1
            if p + 1 < self.c:
                bisect.insort(smallest, float(cheapest[p + 1]))
                del smallest[self.k :]
            out[1 : len(smallest) + 1, p] = np.cumsum(smallest)
            out[len(smallest) + 1 :, p] = (
                np.inf if len(smallest) < self.k else out[len(smallest), p]
            )
        return out

    # ------------------------------------------------------------ one state
    def recv(self, st: _State) -> np.ndarray:
        return self.zero if st.link < 0 else self.comm[st.link]

    def qmax(self, u: int, j: int) -> np.ndarray:
        if self.mem is None:
            return np.full(self.c + 1, self.c, dtype=np.int64)
        rep = self.cls.reps[u]
        host = self.cm.host_share(rep).memory_bytes
        return self.mem.qmax(float(rep.memory_bytes), in_flight_bound(j, self.k, self.nm), host)

    def busy(self, u: int, j: int, p: np.ndarray, q: np.ndarray) -> np.ndarray:
        """Busy ms of stage ``j`` on class ``u`` over ``[p, q)`` (:meth:`CostModel.busy_ms`)."""
        k = in_flight_bound(j, self.k, self.nm)
        return self.cm.busy_ms(self.cls.reps[u], k, self.nm, p, q)

    def largest(self, st: _State) -> np.ndarray:
        """``out[p]``: the longest segment after ``p`` on the fastest class still available."""
        avail = tuple(
            n > u or t == st.u for t, (n, u) in enumerate(zip(self.counts, st.used, strict=True))
        )
        if avail not in self._largest:
            seg = np.min(np.stack([s for s, a in zip(self.segs, avail, strict=True) if a]), axis=0)
            self._largest[avail] = np.concatenate([np.maximum.accumulate(seg[::-1])[::-1], [0.0]])
        return self._largest[avail]

    def bound(self, st: _State) -> np.ndarray:
        """Lower bound on the whole pipeline's bottleneck per start position of ``st``'s window.

        The largest of: the closed stages (``F``), the work bound (transfers included: the
        open stage's receive and the cheapest positions for the boundaries still to place), the
        longest segment still to place on the fastest class available, and the open stage's
        first segment plus its receive.
        """
        pos = np.arange(st.lo, st.lo + len(st.f))
        rest = sum((n - u) * r for n, u, r in zip(self.counts, st.used, self.inv_rho, strict=True))
        iu = self.inv_rho[st.u]
        recv = self.recv(st)[pos]
        boundaries = self.k - sum(st.used)  # the open stage's end and every later one
        comm = 2.0 * self.comm_sums[boundaries, pos] * min(self.inv_rho)
        lb = (self.work[-1] - self.work[pos] + recv * iu + comm) / (iu + rest)
        first = np.concatenate([self.segs[st.u], [0.0]])[pos] + recv
        return np.maximum(np.maximum(st.f, lb), np.maximum(self.largest(st)[pos], first))

    def rest(self, st: _State) -> tuple[int, ...]:
        """The GPUs (per class) not yet in the pipeline of ``st``."""
        return tuple(n - u for n, u in zip(self.counts, st.used, strict=True))

    def reach(self, st: _State, limit: float) -> np.ndarray:
        """Per start position: the furthest end of the open stage with compute + receive ``< limit``."""
        pos = np.arange(st.lo, st.lo + len(st.f))
        comp = self.comp[st.u]
        reach: np.ndarray = np.searchsorted(comp, comp[pos] - self.recv(st)[pos] + limit) - 1
        return reach

    def root_bound(self) -> float:
        """A lower bound on every pipeline: the best of the first stage's states' bounds."""
        states = [
            _State(
                tuple(int(t == u) for t in range(len(self.counts))),
                u,
                -1,
                0,
                np.zeros(1),
                np.zeros(1),
                np.zeros(1),
            )
            for u in range(len(self.counts))
        ]
        return min(self.state_bound(st) for st in states)

    def state_bound(self, st: _State) -> float:
        return float(self.bound(st).min()) if len(st.f) else np.inf

    def close(
        self, st: _State, j: int, out: np.ndarray, inc: float
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

    def finish(self, st: _State, inc: float) -> tuple[float, int]:
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
            st = _State(used, u, link, lo, f, np.full(len(f), sid), arg)
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
            st = _State(used, u, link, lo, vals[pick, cols], sids[pick], starts[pick, cols])
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
        if np.isfinite(bound):
            raise PlanError(
                f"the partition search hit its time limit ({time_limit_s:g} s) before finding a "
                f"partition that fits memory; raise the time limit (--time-limit)"
            )
        short = min_memory_shortfall(cm, gpus, nm)
        letters = "".join(g.letter for g in gpus)
        raise InfeasiblePartition(
            f"no order and partition of {cm.num_layers} layers over {letters} fits memory with "
            f"Nm={nm} (smallest shortfall {format_bytes(short)} on one stage)",
            short,
        )
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
