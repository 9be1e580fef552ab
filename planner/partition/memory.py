"""Whether a virtual worker's GPUs can hold the model at all: a DP over GPU-class multisets.

Stage ``j`` of ``K`` over candidate positions ``[p, q)`` on a GPU with ``cap`` bytes needs (the
cost model's memory, :class:`planner.costmodel.CostModel`)::

    mem(p, q) = mp_k[q] - mp_k[p] + c_k * cut[p],   mp_k = a * params + buffers + s_k * saved (prefix sums)

with ``k = cm.in_flight(j, K, Nm)`` and ``a, s_k, c_k`` the multipliers of the cost model's
memory placement (:func:`planner.offload.coefficients`; all-keep: ``s_k = c_k = k``). For a fixed start ``p`` it
is non-decreasing in ``q``, so the ends that fit form an interval ``(p, qmax(p)]``. Memory does
not depend on links, so whether the first ``j`` stages can end at ``q`` depends only on the
*multiset* of GPU classes they use, not on their order: ``reach[M]`` (a boolean vector over
positions) is a DP over multisets with ``O(C)`` numpy work per step (a difference array marks
the intervals). That makes the largest feasible Nm and the smallest shortfall exact for every
GPU order at once, in milliseconds, where enumerating orders would take minutes.

Host memory is the second limit: the bytes a stage offloads (``host(p, q)``, the same form
with the multipliers of :func:`planner.offload.host_coefficients`) must fit its GPU's share of
the node's host memory (:meth:`CostModel.host_share`; 0: unbounded), so ``qmax`` is the smaller
of the two ends and a memory class is a (device, host) capacity pair.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from planner.cluster import Device
from planner.costmodel import CostModel
from planner.offload import host_coefficients
from profiler.errors import PlanError

__all__ = [
    "MemoryLimits",
    "check_stage_count",
    "feasible_order",
    "fits_memory",
    "min_memory_shortfall",
]


def check_stage_count(cm: CostModel, k: int) -> None:
    """A VW of ``k`` GPUs needs ``k`` non-empty stages: at most one per candidate segment.

    Raises:
        PlanError: ``k`` is 0 or more than the candidate segments (one line, with the fix).
    """
    if k < 1:
        raise PlanError("a virtual worker needs at least one GPU")
    if k > cm.num_segments:
        raise PlanError(
            f"a virtual worker of {k} GPUs needs {k} non-empty stages, but the model's "
            f"{cm.num_layers} layers offer only {cm.num_segments} candidate segments; use more "
            f"VWs (--vws) so that each has at most {cm.num_segments} GPUs, or omit --max-cuts"
        )


@dataclass
class MemoryLimits:
    """Per-(capacity, in-flight) ``qmax`` vectors of one cost model at one Nm (cached)."""

    cm: CostModel
    nm: int
    _mp: dict[int, np.ndarray] = field(default_factory=dict)
    _hp: dict[int, np.ndarray] = field(default_factory=dict)
    _qmax: dict[tuple[float, int, int], np.ndarray] = field(default_factory=dict)

    def prefix(self, k: int) -> np.ndarray:
        """``mp_k``: prefix bytes over positions with ``k`` minibatches in flight.

        Raises:
            PlanError: the profile has negative byte counts (the memory would not be monotone).
        """
        if k not in self._mp:
            cm = self.cm
            co = cm.coefficients(k, self.nm)
            mp = (
                co.param * cm.param_prefix.astype(np.float64)
                + cm.buffer_prefix
                + co.saved * cm.saved_prefix.astype(np.float64)
            )
            if np.any(np.diff(mp) < 0) or np.any(cm.cut_bytes < 0):
                raise PlanError(
                    "the profile has negative parameter/buffer/saved/activation bytes; re-profile "
                    "the model (byte counts must be >= 0)"
                )
            self._mp[k] = mp
        return self._mp[k]

    def host_prefix(self, k: int) -> tuple[np.ndarray, float]:
        """Prefix host bytes over positions with ``k`` in flight, and the cut multiplier."""
        cm = self.cm
        co = host_coefficients(cm.placement, self.nm, k, cm.optimizer_state_factor)
        if k not in self._hp:
            param = cm.param_prefix.astype(np.float64)
            self._hp[k] = co.param * param + co.saved * cm.saved_prefix.astype(np.float64)
        return self._hp[k], co.cut

    def qmax(self, cap: float, k: int, host_cap: int = 0) -> np.ndarray:
        """``qmax[p]``: last end position whose stage from ``p`` fits ``cap`` device bytes and
        ``host_cap`` host bytes (0: unbounded) (``<= p``: none)."""
        key = (float(cap), k, host_cap)
        if key not in self._qmax:
            cut_b = self.cm.cut_bytes.astype(np.float64)
            mp = self.prefix(k)
            target = cap + mp - self.cm.coefficients(k, self.nm).cut * cut_b
            q = np.searchsorted(mp, target, side="right").astype(np.int64) - 1
            if host_cap:
                hp, hc = self.host_prefix(k)
                host_q = np.searchsorted(hp, host_cap + hp - hc * cut_b, side="right") - 1
                q = np.minimum(q, host_q.astype(np.int64))
            self._qmax[key] = q
        return self._qmax[key]


def _classes(cm: CostModel, gpus: Sequence[Device]) -> tuple[list[tuple[int, int]], list[int]]:
    """(device, host) capacities and counts of the VW's memory classes."""
    caps: dict[tuple[int, int], int] = {}
    for g in gpus:
        key = (g.memory_bytes, cm.host_share(g).memory_bytes)
        caps[key] = caps.get(key, 0) + 1
    keys = sorted(caps)
    return keys, [caps[c] for c in keys]


def _covered(reach: np.ndarray, qmax: np.ndarray, c: int) -> np.ndarray:
    """Positions ``q`` with some reachable ``p < q <= qmax[p]``."""
    p = np.flatnonzero(reach)
    q = np.minimum(qmax[p], c)
    ok = q > p
    diff = np.zeros(c + 2, dtype=np.int64)
    np.add.at(diff, p[ok] + 1, 1)
    np.add.at(diff, q[ok] + 1, -1)
    covered: np.ndarray = np.cumsum(diff)[: c + 1] > 0
    return covered


def _reach_layers(
    cm: CostModel, gpus: Sequence[Device], nm: int, extra_bytes: float, lim: MemoryLimits
) -> list[dict[tuple[int, ...], np.ndarray]]:
    """``out[j][M]``: positions the first ``j`` stages can end at using memory-class multiset ``M``."""
    n_gpus = len(gpus)
    check_stage_count(cm, n_gpus)
    caps, counts = _classes(cm, gpus)
    c = cm.num_segments
    start = np.zeros(c + 1, dtype=bool)
    start[0] = True
    layers: list[dict[tuple[int, ...], np.ndarray]] = [{tuple(0 for _ in counts): start}]
    for j in range(n_gpus):
        k = cm.in_flight(j, n_gpus, nm)
        room = c - (n_gpus - 1 - j)  # later stages need one segment each
        nxt: dict[tuple[int, ...], np.ndarray] = {}
        for used, reach in layers[-1].items():
            for t, n in enumerate(counts):
                if used[t] >= n:
                    continue
                dev, host = caps[t]
                cover = _covered(reach, lim.qmax(dev + extra_bytes, k, host), c)
                cover[room + 1 :] = False
                if not cover.any():
                    continue
                key = tuple(u + (i == t) for i, u in enumerate(used))
                nxt[key] = nxt[key] | cover if key in nxt else cover
        layers.append(nxt)
        if not nxt:
            break
    return layers


def fits_memory(
    cm: CostModel,
    gpus: Sequence[Device],
    nm: int,
    extra_bytes: float = 0.0,
    limits: MemoryLimits | None = None,
) -> bool:
    """Whether some order and partition of ``gpus`` fit memory with ``nm`` in flight.

    Args:
        cm: cost model.
        gpus: the VW's GPUs (any order).
        nm: minibatches in flight.
        extra_bytes: added to every GPU's capacity (for :func:`min_memory_shortfall`).
        limits: a cache for this ``cm`` and ``nm``.

    Raises:
        PlanError: more GPUs than candidate segments, or negative byte counts in the profile.
    """
    lim = limits if limits is not None else MemoryLimits(cm, nm)
    layers = _reach_layers(cm, gpus, nm, extra_bytes, lim)
    return len(layers) == len(gpus) + 1 and any(bool(r[-1]) for r in layers[-1].values())


def feasible_order(cm: CostModel, gpus: Sequence[Device], nm: int) -> list[Device] | None:
    """A GPU order for which some partition fits memory (``None``: none does).

    Backtracks through :func:`_reach_layers` from the model's end: the last stage on a class
    whose predecessor multiset can end where this stage starts. The partition search uses it
    as a first incumbent when its heuristic orders do not fit.
    """
    lim = MemoryLimits(cm, nm)
    layers = _reach_layers(cm, gpus, nm, 0.0, lim)
    caps, counts = _classes(cm, gpus)
    c, n_gpus = cm.num_segments, len(gpus)
    used = tuple(counts)
    if len(layers) != n_gpus + 1 or not layers[-1].get(used, np.zeros(1, dtype=bool))[-1]:
        return None
    q, classes = c, []
    for j in range(n_gpus - 1, -1, -1):
        k = cm.in_flight(j, n_gpus, nm)
        for t, n in enumerate(used):
            prev = tuple(u - (i == t) for i, u in enumerate(used))
            if not n or prev not in layers[j]:
                continue
            qmax = lim.qmax(caps[t][0], k, caps[t][1])
            p = np.flatnonzero(layers[j][prev][:q] & (qmax[:q] >= q))
            if p.size:
                classes.append(t)
                used, q = prev, int(p[-1])
                break
    pools: dict[tuple[int, int], list[Device]] = {}
    for g in gpus:
        pools.setdefault((g.memory_bytes, cm.host_share(g).memory_bytes), []).append(g)
    return [pools[caps[t]].pop(0) for t in reversed(classes)]


def min_memory_shortfall(cm: CostModel, gpus: Sequence[Device], nm: int) -> int:
    """Bytes every GPU of the VW would need in addition for some partition to fit (0 if one fits).

    The smallest overflow of the most overflowing stage, over every order and partition: found
    by bisection on a uniform capacity increase with :func:`fits_memory` (exact to the byte).

    Raises:
        PlanError: more GPUs than candidate segments, negative byte counts in the profile, or
            host memory too small whatever the device memory.
    """
    lim = MemoryLimits(cm, nm)
    if fits_memory(cm, gpus, nm, 0.0, lim):
        return 0
    if not fits_memory(cm, gpus, nm, np.inf, lim):
        raise PlanError(
            f"no partition over {len(gpus)} GPUs fits the host memory of their nodes with "
            f"Nm={nm} under memory placement {cm.placement}; raise host_memory of the nodes in "
            "the cluster file, lower --nm or offload less (--memory)"
        )
    # with this much more, any GPU holds the whole model as one stage
    lo, hi = 0, int(np.ceil(lim.prefix(nm)[-1] + nm * float(cm.cut_bytes.max()))) + 1
    while not fits_memory(cm, gpus, nm, float(hi), lim):
        hi *= 2
    while hi - lo > 1:  # lo does not fit, hi does
        mid = (lo + hi) // 2
        if fits_memory(cm, gpus, nm, float(mid), lim):
            hi = mid
        else:
            lo = mid
    return hi
