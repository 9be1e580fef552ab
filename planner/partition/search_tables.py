"""The tables and bounds of the exact partition search (:mod:`planner.partition.search`).

:class:`SearchTables` holds, for one VW at one Nm, each GPU class's cumulative compute, the
link classes and their transfer times, the memory limits and the work bound's ingredients;
its methods bound a partial pipeline (:class:`State`) from below, which is what prunes the
search (see the search module's docstring for the bound's formula).
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from planner.cluster import Device, Link
from planner.costmodel import CostModel
from planner.partition.bounds import classes
from planner.partition.memory import MemoryLimits
from profiler.errors import PlanError

__all__ = ["SearchTables", "State"]


@dataclass
class State:
    """A partial pipeline: classes used, its open stage's class and link, ``F`` per start."""

    used: tuple[int, ...]
    u: int  # class of the open stage
    link: int  # link into the open stage (index into _Search.links; -1: first stage)
    lo: int  # position of f[0]
    f: np.ndarray  # smallest slowest closed stage per start position
    prev: np.ndarray  # predecessor state id per position (-1: none)
    prev_p: np.ndarray  # start of the predecessor's open stage


class SearchTables:
    """Tables of one VW at one Nm, and lower bounds on partial pipelines."""

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

    # ------------------------------------------------------------ bounds of one state
    def recv(self, st: State) -> np.ndarray:
        """Receive time into ``st``'s open stage per boundary position (0 for the first stage)."""
        return self.zero if st.link < 0 else self.comm[st.link]

    def qmax(self, u: int, j: int) -> np.ndarray:
        """Per start position: the furthest end of stage ``j`` on class ``u`` that fits memory."""
        if self.mem is None:
            return np.full(self.c + 1, self.c, dtype=np.int64)
        rep = self.cls.reps[u]
        host = self.cm.host_share(rep).memory_bytes
        return self.mem.qmax(float(rep.memory_bytes), self.cm.in_flight(j, self.k, self.nm), host)

    def busy(self, u: int, j: int, p: np.ndarray, q: np.ndarray) -> np.ndarray:
        """Busy ms of stage ``j`` on class ``u`` over ``[p, q)`` (:meth:`CostModel.busy_ms`)."""
        k = self.cm.in_flight(j, self.k, self.nm)
        return self.cm.busy_ms(self.cls.reps[u], k, self.nm, p, q)

    def largest(self, st: State) -> np.ndarray:
        """``out[p]``: the longest segment after ``p`` on the fastest class still available."""
        avail = tuple(
            n > u or t == st.u for t, (n, u) in enumerate(zip(self.counts, st.used, strict=True))
        )
        if avail not in self._largest:
            seg = np.min(np.stack([s for s, a in zip(self.segs, avail, strict=True) if a]), axis=0)
            self._largest[avail] = np.concatenate([np.maximum.accumulate(seg[::-1])[::-1], [0.0]])
        return self._largest[avail]

    def bound(self, st: State) -> np.ndarray:
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

    def rest(self, st: State) -> tuple[int, ...]:
        """The GPUs (per class) not yet in the pipeline of ``st``."""
        return tuple(n - u for n, u in zip(self.counts, st.used, strict=True))

    def reach(self, st: State, limit: float) -> np.ndarray:
        """Per start position: the furthest end of the open stage with compute + receive ``< limit``."""
        pos = np.arange(st.lo, st.lo + len(st.f))
        comp = self.comp[st.u]
        reach: np.ndarray = np.searchsorted(comp, comp[pos] - self.recv(st)[pos] + limit) - 1
        return reach

    def root_bound(self) -> float:
        """A lower bound on every pipeline: the best of the first stage's states' bounds."""
        states = [
            State(
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

    def state_bound(self, st: State) -> float:
        """The smallest :meth:`bound` over ``st``'s window (``inf`` for an empty one)."""
        return float(self.bound(st).min()) if len(st.f) else np.inf
