"""The MILP of :func:`planner.partition.milp.partition_milp`: a VW's GPU order *and* layer split.

Formulation (``K`` stages, ``C`` candidate segments, GPU classes ``t`` of interchangeable GPUs):

- ``s[j, i]`` binary, 1 iff segment ``i`` belongs to stages ``0..j`` (a staircase: non-increasing
  in ``i``, non-decreasing in ``j``); stage ``j`` holds ``s[j, i] - s[j-1, i]``, and boundary ``j``
  sits at position ``p`` iff ``s[j, p-1] - s[j, p] = 1``. Prefix sums make every stage quantity
  linear in ``s``; there are no layer-to-stage assignment variables.
- ``x[j, t]`` binary, 1 iff stage ``j`` runs on a GPU of class ``t`` (``sum_j x[j, t] = n_t``).
  Identical GPUs form one class, so the model never orders them (symmetry breaking).
- ``y[j]`` >= 0: receive time at boundary ``j``; for every link class ``l``,
  ``y[j] >= comm_l(j) - M (1 - r[j, l])`` with ``r[j, l] >= x[j, t] + x[j+1, u] - 1`` over the
  class pairs ``(t, u)`` joined by ``l``.
- ``z >= comp_t(j) + y[j-1] + y[j] - M (1 - x[j, t])``; minimise ``z``.
- memory: ``static(j) + in_flight(j) * (saved(j) + recv_bytes(j)) <= sum_t cap_t x[j, t]``
  (the multipliers of the cost model's placement, :func:`planner.offload.coefficients`), and
  the same form for the offloaded bytes against each class's host share.
- a placement that recomputes adds the forward to ``comp_t(j)`` of the stages holding more
  than one minibatch; one that moves bytes adds ``z >= host(j) + y[j-1] + y[j]``, ``host(j)``
  the host-link ms of the stage's transfer bytes on its class's share of the link (the stage
  is busy ``max(compute, host)``, :func:`planner.offload.busy_ms`).

Speed (helpers in :mod:`planner.partition.bounds`): the DP optimum over every distinct GPU order when
there are at most 24 (else over a few heuristic orders; the given order when it is fixed) is an
upper bound ``UB`` (``z <= UB``); the MILP still has to prove the lower bound. Every stage's
compute is then ``<= UB``, so the furthest position a GPU sequence covers greedily bounds each
boundary: per class multiset (a small DP) in general, per position for a fixed order. That fixes
every staircase variable outside the windows and makes every big-M the largest value inside them.
With several classes, binaries ``w[j, m]`` select the class multiset of stages ``0..j`` and bound
boundary ``j`` by that multiset's reach; prefix/suffix work cuts tie positions to the classes'
capacities. ``disaggregate=True`` replaces the compute big-M by ``v[j, t, i]`` variables and a
work-per-class cut (a stronger LP bound, slower branch-and-bound in our measurements).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pulp

from planner.cluster import Device, Link
from planner.costmodel import CostModel
from planner.offload import host_coefficients, recompute_factor, transfer_coefficients
from planner.partition.bounds import EPS, classes, reach_table, windows
from planner.partition.dp import InfeasiblePartition, class_key
from profiler.errors import PlanError

__all__ = ["MilpModel"]

_GIB = float(2**30)


class MilpModel:
    """Builds the MILP for one VW (see the module docstring)."""

    def __init__(
        self,
        cm: CostModel,
        gpus: Sequence[Device],
        nm: int,
        memory: bool,
        fixed: bool,
        ub: float | None,
        disaggregate: bool,
    ) -> None:
        self.disaggregate = disaggregate
        self.cm, self.nm, self.k, self.c = cm, nm, len(gpus), cm.num_segments
        self.cls = classes(gpus)
        self.fixed = tuple(gpus) if fixed else None
        self.prob = pulp.LpProblem("hetpipe_partition", pulp.LpMinimize)
        fixed_classes = [self.cls.keys.index(class_key(d)) for d in gpus] if fixed else None
        if len(self.cls.keys) == 1:
            fixed_classes = [0] * self.k
        self.win = windows(cm, self.cls, self.k, ub, fixed_classes)
        if self.k > 1 and not self.win:
            raise InfeasiblePartition("no boundary position is compatible with the upper bound", 0)
        self._staircase()
        self._assignment()
        self.z = pulp.LpVariable("z", lowBound=0)
        if ub is not None:
            self.prob += self.z <= ub * (1 + EPS) + 1e-9
        self.prob += self.z
        self._times()
        if ub is not None and self.fixed is None and len(self.cls.keys) > 1:
            self._reach_cuts(ub)
            self._state_windows(ub)
        if memory:
            self._memory()

    # s[j, i]: constant or variable
    def _staircase(self) -> None:
        self.s: dict[tuple[int, int], pulp.LpVariable] = {}
        for j, (lo, hi) in enumerate(self.win):
            for i in range(lo, hi):  # segments lo .. hi-1 may flip; earlier ones are 1, later 0
                self.s[j, i] = pulp.LpVariable(f"s_{j}_{i}", cat=pulp.LpBinary)
        for (j, i), v in self.s.items():
            if (j, i + 1) in self.s:
                self.prob += v >= self.s[j, i + 1]
            if (j + 1, i) in self.s:
                self.prob += v <= self.s[j + 1, i]
        for j in range(len(self.win) - 1):  # stage j+1 is not empty: boundary j+1 > boundary j
            self.prob += self._position(j + 1) - self._position(j) >= 1

    def _position(self, j: int) -> pulp.LpAffineExpression:
        """Position of boundary ``j`` (segments in stages ``0..j``)."""
        lo, hi = self.win[j]
        return lo + pulp.lpSum(self.s[j, i] for i in range(lo, hi))

    def S(self, j: int, i: int) -> pulp.LpAffineExpression | float:
        """Segment ``i`` is in stages ``0..j``."""
        if j < 0:
            return 0.0
        if j >= self.k - 1:
            return 1.0
        if (j, i) in self.s:
            return self.s[j, i]
        lo, _ = self.win[j]
        return 1.0 if i < lo else 0.0

    def _span(self, j: int) -> range:
        """Segments that may belong to stage ``j``."""
        lo = self.win[j - 1][0] if j > 0 else 0
        hi = self.win[j][1] if j < self.k - 1 else self.c
        return range(lo, hi)

    def stage_sum(self, j: int, seg: np.ndarray) -> pulp.LpAffineExpression:
        """Sum of per-segment ``seg`` over stage ``j``'s segments."""
        return pulp.lpSum(
            float(seg[i]) * (self.S(j, i) - self.S(j - 1, i)) for i in self._span(j) if seg[i] != 0
        )

    def boundary_sum(self, j: int, per_pos: np.ndarray) -> pulp.LpAffineExpression:
        """``per_pos[p]`` at the position of boundary ``j``."""
        lo, hi = self.win[j]
        return pulp.lpSum(
            float(per_pos[p]) * (self.S(j, p - 1) - self.S(j, p))
            for p in range(lo, hi + 1)
            if per_pos[p] != 0
        )

    def _assignment(self) -> None:
        n_cls = len(self.cls.keys)
        self.x: dict[tuple[int, int], pulp.LpVariable | float] = {}
        if self.fixed is not None or n_cls == 1:
            for j in range(self.k):
                key = class_key(self.fixed[j]) if self.fixed is not None else self.cls.keys[0]
                for t in range(n_cls):
                    self.x[j, t] = 1.0 if self.cls.keys[t] == key else 0.0
            return
        for j in range(self.k):
            for t in range(n_cls):
                self.x[j, t] = pulp.LpVariable(f"x_{j}_{t}", cat=pulp.LpBinary)
            self.prob += pulp.lpSum(self.x[j, t] for t in range(n_cls)) == 1
        for t, members in enumerate(self.cls.members):
            self.prob += pulp.lpSum(self.x[j, t] for j in range(self.k)) == len(members)

    def _link_terms(self, j: int) -> list[tuple[Link, list[tuple[int, int]]]]:
        """Distinct links at boundary ``j`` and the class pairs that use them."""
        pairs: dict[Link, list[tuple[int, int]]] = {}
        n_cls = len(self.cls.keys)
        for t in range(n_cls):
            for u in range(n_cls):
                if isinstance(self.x[j, t], float) and self.x[j, t] == 0.0:
                    continue
                if isinstance(self.x[j + 1, u], float) and self.x[j + 1, u] == 0.0:
                    continue
                if t == u and len(self.cls.members[t]) < 2:
                    continue
                a, b = self.cls.reps[t], self.cls.reps[u]
                if t == u:
                    b = self.cls.members[t][1]
                pairs.setdefault(self.cm.link(a, b), []).append((t, u))
        return list(pairs.items())

    def _times(self) -> None:
        cm = self.cm
        self.y: list[pulp.LpAffineExpression | pulp.LpVariable] = []
        self.v: dict[tuple[int, int, int], pulp.LpVariable] = {}
        for j in range(self.k - 1):
            lo, hi = self.win[j]
            terms = self._link_terms(j)
            comms = [(cm.comm_ms(link), cls_pairs) for link, cls_pairs in terms]
            if len(comms) == 1:
                self.y.append(self.boundary_sum(j, comms[0][0]))
                continue
            y = pulp.LpVariable(f"y_{j}", lowBound=0)
            r = [pulp.LpVariable(f"r_{j}_{n}", lowBound=0, upBound=1) for n in range(len(comms))]
            self.prob += pulp.lpSum(r) == 1
            for n, (comm, cls_pairs) in enumerate(comms):
                for t, u in cls_pairs:
                    self.prob += r[n] >= self.x[j, t] + self.x[j + 1, u] - 1
                big = float(comm[lo : hi + 1].max())
                self.prob += y >= self.boundary_sum(j, comm) - big * (1 - r[n])
            fastest = np.min(np.stack([c for c, _ in comms]), axis=0)
            self.prob += y >= self.boundary_sum(j, fastest)
            self.y.append(y)
        seg = [np.diff(cm.compute_ms(r.type)) for r in self.cls.reps]
        fwd = [np.diff(cm.fwd_prefix[r.type]) for r in self.cls.reps]
        for j in range(self.k):
            comm_in = self.y[j - 1] if j > 0 else 0.0
            comm_out = self.y[j] if j < self.k - 1 else 0.0
            rf = recompute_factor(cm.placement, self.cm.in_flight(j, self.k, self.nm))
            seg_j = [s + rf * f for s, f in zip(seg, fwd, strict=True)] if rf else seg
            self.prob += self.z >= self._stage_compute(j, seg_j) + comm_in + comm_out
            host = self._host_ms(j)
            if host is not None:
                self.prob += self.z >= host + comm_in + comm_out
        if self.v:  # total work on class t fits its n_t GPUs: a strong valid cut
            for t, members in enumerate(self.cls.members):
                work = pulp.lpSum(
                    float(seg[t][i]) * v for (_, tt, i), v in self.v.items() if tt == t
                )
                self.prob += work <= len(members) * self.z

    def _host_ms(self, j: int) -> pulp.LpAffineExpression | pulp.LpVariable | None:
        """Host-link ms of stage ``j``'s transfer bytes on its class's share of the link
        (``None``: the placement moves nothing there)."""
        cm = self.cm
        k = self.cm.in_flight(j, self.k, self.nm)
        tc = transfer_coefficients(cm.placement, self.nm, k, cm.optimizer_state_factor)
        if tc.zero:
            return None
        link = cm.host_link
        seg = tc.param * np.diff(cm.param_prefix) + tc.saved * np.diff(cm.saved_prefix)
        cut_b = tc.cut * cm.cut_bytes.astype(np.float64)
        per: list[tuple[int, pulp.LpAffineExpression, float]] = []
        for t, r in enumerate(self.cls.reps):
            xt = self.x[j, t]
            if isinstance(xt, float) and xt == 0.0:
                continue
            ms_per_byte = 1e3 * cm.host_share(r).sharers / link.bandwidth_bps
            cut = ms_per_byte * cut_b
            expr = self.stage_sum(j, ms_per_byte * seg) + 1e3 * link.latency_s
            expr = expr + (self.boundary_sum(j - 1, cut) if j > 0 else float(cut[0]))
            span = self._span(j)
            big = float(ms_per_byte * seg[span.start : span.stop].sum() + cut.max()) + 1.0
            per.append((t, expr, big))
        if len(per) == 1:
            return per[0][1]
        h = pulp.LpVariable(f"h_{j}", lowBound=0)
        for t, expr, big in per:
            self.prob += h >= expr - big * (1 - self.x[j, t])
        return h

    def _stage_compute(self, j: int, seg: Sequence[np.ndarray]) -> pulp.LpAffineExpression:
        """Compute ms of stage ``j`` on its class, linearised without big-M.

        With a free order, ``v[j, t, i]`` = (segment ``i`` in stage ``j``) AND (stage ``j`` is class
        ``t``): ``sum_t v[j, t, i] = S(j, i) - S(j-1, i)`` and ``v[j, t, i] <= x[j, t]``.
        """
        fixed = [
            t for t in range(len(seg)) if isinstance(self.x[j, t], float) and self.x[j, t] == 1.0
        ]
        if fixed:
            return self.stage_sum(j, seg[fixed[0]])
        if not self.disaggregate:
            return self._stage_compute_bigm(j, seg)
        allowed = [t for t in range(len(seg)) if not isinstance(self.x[j, t], float)]
        terms = []
        for i in self._span(j):
            vs = []
            for t in allowed:
                v = pulp.LpVariable(f"v_{j}_{t}_{i}", lowBound=0, upBound=1)
                self.v[j, t, i] = v
                self.prob += v <= self.x[j, t]
                vs.append(v)
                terms.append(float(seg[t][i]) * v)
            self.prob += pulp.lpSum(vs) == self.S(j, i) - self.S(j - 1, i)
        return pulp.lpSum(terms)

    def _state_windows(self, ub: float) -> None:
        """Boundary ``j``'s position given *which* classes run stages ``0..j``.

        ``w[j, m]`` (binary) selects the class multiset ``m`` of the first ``j+1`` stages
        (``sum_m w[j, m] m_t = sum_{j' <= j} x[j', t]``); the boundary lies between
        ``C - reach_from_end(rest)`` and ``reach(m)`` (see :func:`planner.partition.bounds.reach_table`).
        """
        comp = [self.cm.compute_ms(r.type) for r in self.cls.reps]
        counts = tuple(len(m) for m in self.cls.members)
        fwd = reach_table(comp, counts, ub)
        rev = reach_table([(x[-1] - x)[::-1] for x in comp], counts, ub)
        for j in range(self.k - 1):
            states = [st for st in fwd if sum(st) == j + 1]
            w = {
                st: pulp.LpVariable(f"w_{j}_{'_'.join(map(str, st))}", cat=pulp.LpBinary)
                for st in states
            }
            self.prob += pulp.lpSum(w.values()) == 1
            for t in range(len(counts)):
                self.prob += pulp.lpSum(st[t] * v for st, v in w.items()) == pulp.lpSum(
                    self.x[jj, t] for jj in range(j + 1)
                )
            pos = self._position(j)
            self.prob += pos <= pulp.lpSum(min(fwd[st], self.c) * v for st, v in w.items())
            rest = {st: tuple(n - c for n, c in zip(counts, st, strict=True)) for st in states}
            self.prob += pos >= pulp.lpSum(
                (self.c - rev.get(rest[st], 0)) * v for st, v in w.items()
            )

    def _reach_cuts(self, ub: float) -> None:
        """Prefix (suffix) fastest-type work of boundary ``j`` fits the capacity of the classes before (after) it.

        A GPU of class ``t`` does at most ``UB / rho_t`` fastest-type work per stage, where
        ``rho_t >= 1`` is its smallest per-segment slowdown; valid because ``z <= UB``.
        """
        seg = [np.diff(self.cm.compute_ms(r.type)) for r in self.cls.reps]
        fast = np.min(np.stack(seg), axis=0)
        mask = fast > 0
        rho = [float(np.min(sg[mask] / fast[mask])) if mask.any() else 1.0 for sg in seg]
        slack = ub * (1 + EPS) + 1e-9
        total = float(fast.sum())
        for j in range(self.k - 1):
            lo, hi = self.win[j]
            prefix = float(fast[:lo].sum()) + pulp.lpSum(
                float(fast[i]) * self.s[j, i] for i in range(lo, hi)
            )
            before = pulp.lpSum(
                self.x[jj, t] * (slack / rho[t]) for jj in range(j + 1) for t in range(len(rho))
            )
            after = pulp.lpSum(
                self.x[jj, t] * (slack / rho[t])
                for jj in range(j + 1, self.k)
                for t in range(len(rho))
            )
            self.prob += prefix <= before
            self.prob += total - prefix <= after

    def _stage_compute_bigm(self, j: int, seg: Sequence[np.ndarray]) -> pulp.LpVariable:
        """Compute ms of stage ``j``: ``w >= comp_t(j) - M_t (1 - x[j, t])``, ``M_t`` = the window's work."""
        w = pulp.LpVariable(f"w_{j}", lowBound=0)
        span = self._span(j)
        for t in range(len(seg)):
            xt = self.x[j, t]
            if isinstance(xt, float):
                continue
            big = float(seg[t][span.start : span.stop].sum())
            self.prob += w >= self.stage_sum(j, seg[t]) - big * (1 - xt)
        self.prob += w >= self.stage_sum(j, np.min(np.stack(list(seg)), axis=0))
        return w

    def _memory(self) -> None:
        cm = self.cm
        par = np.diff(cm.param_prefix) / _GIB
        buf = np.diff(cm.buffer_prefix) / _GIB
        sav = np.diff(cm.saved_prefix) / _GIB
        cut = cm.cut_bytes / _GIB
        hosts = [cm.host_share(r).memory_bytes / _GIB for r in self.cls.reps]
        for j in range(self.k):
            k = self.cm.in_flight(j, self.k, self.nm)
            co = cm.coefficients(k, self.nm)
            need = self.stage_sum(j, co.param * par + buf + co.saved * sav)
            need = need + co.cut * (self.boundary_sum(j - 1, cut) if j > 0 else float(cut[0]))
            cap = pulp.lpSum(
                self.x[j, t] * (r.memory_bytes / _GIB) for t, r in enumerate(self.cls.reps)
            )
            self.prob += need <= cap
            hc = host_coefficients(cm.placement, self.nm, k, cm.optimizer_state_factor)
            if hc.zero or not any(hosts):
                continue
            unbounded = float(hc.param * par.sum() + hc.saved * sav.sum() + hc.cut * cut.max())
            host = self.stage_sum(j, hc.param * par + hc.saved * sav)
            host = host + hc.cut * (self.boundary_sum(j - 1, cut) if j > 0 else float(cut[0]))
            self.prob += host <= pulp.lpSum(
                self.x[j, t] * (h if h else unbounded) for t, h in enumerate(hosts)
            )

    def solution(self) -> tuple[list[int], list[Device]]:
        """Stage bounds (positions) and the GPU order of the solved model."""
        bounds = [0]
        for j in range(self.k - 1):
            lo, hi = self.win[j]
            pos = [
                p for p in range(lo, hi + 1) if pulp.value(self.S(j, p - 1) - self.S(j, p)) > 0.5
            ]
            if len(pos) != 1:
                raise PlanError(f"MILP returned no unique boundary {j} (solver numerical trouble)")
            bounds.append(pos[0])
        bounds.append(self.c)
        if self.fixed is not None:
            return bounds, list(self.fixed)
        pools = [list(m) for m in self.cls.members]
        order = []
        for j in range(self.k):
            t = max(range(len(pools)), key=lambda t: float(pulp.value(self.x[j, t])))
            if not pools[t]:
                raise PlanError(
                    "MILP assigned more GPUs of one class than exist (solver numerical trouble)"
                )
            order.append(pools[t].pop(0))
        return bounds, order
