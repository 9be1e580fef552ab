"""Data of the simulator: what it simulates (:class:`PipelineSpec`) and what it records
(:class:`SimResult`, its intervals :class:`planner.draw.TraceEvent`).

Split from :mod:`planner.sim.engine` (the event loop), which re-exports the data classes; the
result statistics (:func:`busy_ms`, :func:`idle_ms`) visit only the intervals a window touches.
"""

from __future__ import annotations

import math
from bisect import bisect_left, bisect_right
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import chain
from operator import sub

from planner.draw import TraceEvent
from profiler.errors import PlanError

__all__ = [
    "PipelineSpec",
    "SimResult",
    "busy_ms",
    "idle_ms",
]


@dataclass(frozen=True)
class PipelineSpec:
    """One virtual worker for the simulator: per-stage times (ms) and bytes.

    Attributes:
        fwd_ms, bwd_ms: compute time of one minibatch per stage.
        recv_fwd_ms: time to receive the activations crossing each stage's first cut (0 for stage 0).
        recv_bwd_ms: time to receive the gradients crossing each stage's last cut (0 for the last).
        push_ms: time for each stage to push its update per wave to shards on its own node.
        pull_ms: time for each stage to pull its global weights (pulls run in parallel; each
            stage waits for its own).
        cross_recv_bytes: bytes crossing each stage's first cut when the previous stage sits
            on another node (counted once forward and once backward per minibatch), else 0.
        cross_sync_bytes: bytes each stage moves across nodes per push (the same again per pull).
        labels: GPU label per stage for traces (e.g. ``V:0``).
        nodes: node name per stage; transfers between different nodes (and ``push_inter_ms``)
            share the sender node's network card with every VW. Empty: one card per GPU.
        push_inter_ms: time for each stage to push its update per wave to shards on other
            nodes (over its node's card). Empty: zero.
        host_ms: host-link time of each stage's offloaded data per minibatch
            (:mod:`planner.offload`); drawn, not timed: its exposed part is in ``bwd_ms``.
            Empty: nothing offloaded.
        host_exposed_ms: the part of ``host_ms`` not hidden behind compute. Empty: zero.
        overhead_ms_per_task: the runtime's own cost of every task (messages, optimizer step,
            Python, bookkeeping: what ``hetpipe run --profile-runtime`` reports as
            ``overhead_ms_per_task``), added to each task's compute time; 0: none.
        wave_overhead_ms: the runtime's own cost of each stage's wave through parameter
            servers (:func:`planner.overhead.wave_overhead_ms`), added to the stage's task that
            ends the wave (its backward of minibatch ``k * Nm``, where it pushes). Empty: zero.
    """

    fwd_ms: tuple[float, ...]
    bwd_ms: tuple[float, ...]
    recv_fwd_ms: tuple[float, ...]
    recv_bwd_ms: tuple[float, ...]
    push_ms: tuple[float, ...]
    pull_ms: tuple[float, ...]
    cross_recv_bytes: tuple[int, ...]
    cross_sync_bytes: tuple[int, ...]
    labels: tuple[str, ...]
    nodes: tuple[str, ...] = ()
    push_inter_ms: tuple[float, ...] = ()
    host_ms: tuple[float, ...] = ()
    host_exposed_ms: tuple[float, ...] = ()
    overhead_ms_per_task: float = 0.0
    wave_overhead_ms: tuple[float, ...] = ()

    @property
    def n_stages(self) -> int:
        """Number of stages."""
        return len(self.fwd_ms)

    @classmethod
    def from_times(
        cls,
        fwd_ms: Sequence[float],
        bwd_ms: Sequence[float],
        recv_fwd_ms: Sequence[float] | None = None,
        recv_bwd_ms: Sequence[float] | None = None,
        push_ms: Sequence[float] | float = 0.0,
        pull_ms: Sequence[float] | float = 0.0,
    ) -> PipelineSpec:
        """Build a spec from plain lists (tests, benchmarks); missing parts are zero."""
        n = len(fwd_ms)
        zeros = (0.0,) * n

        def per_stage(x: Sequence[float] | float | None) -> tuple[float, ...]:
            if x is None:
                return zeros
            if isinstance(x, (int, float)):
                return (float(x),) * n
            return tuple(float(v) for v in x)

        return cls(
            tuple(float(v) for v in fwd_ms),
            per_stage(bwd_ms),
            per_stage(recv_fwd_ms),
            per_stage(recv_bwd_ms),
            per_stage(push_ms),
            per_stage(pull_ms),
            (0,) * n,
            (0,) * n,
            tuple(f"gpu{s}" for s in range(n)),
        ).validated()

    def validated(self) -> PipelineSpec:
        """Return self after checking lengths and signs.

        Raises:
            PlanError: a per-stage tuple has the wrong length or a negative/NaN time.
        """
        n = self.n_stages
        if n < 1:
            raise PlanError("a virtual worker needs at least one stage")
        for name in (
            "bwd_ms",
            "recv_fwd_ms",
            "recv_bwd_ms",
            "push_ms",
            "pull_ms",
            "labels",
            "nodes",
            "push_inter_ms",
            "host_ms",
            "host_exposed_ms",
            "wave_overhead_ms",
        ):
            optional = ("nodes", "push_inter_ms", "host_ms", "host_exposed_ms", "wave_overhead_ms")
            if len(getattr(self, name)) != n and not (name in optional and not getattr(self, name)):
                raise PlanError(
                    f"PipelineSpec.{name} has {len(getattr(self, name))} entries, expected {n} (one per stage)"
                )
        for name in (
            "fwd_ms",
            "bwd_ms",
            "recv_fwd_ms",
            "recv_bwd_ms",
            "push_ms",
            "pull_ms",
            "push_inter_ms",
            "wave_overhead_ms",
        ):
            for s, v in enumerate(getattr(self, name)):
                if not v >= 0.0:
                    raise PlanError(f"PipelineSpec.{name}[{s}] = {v}: times must be >= 0 ms")
        if not 0.0 <= self.overhead_ms_per_task < math.inf:
            raise PlanError(
                f"overhead_ms_per_task = {self.overhead_ms_per_task}: give a finite number of "
                "milliseconds >= 0 (0: no runtime overhead)"
            )
        return self


@dataclass(frozen=True)
class SimResult:
    """What the simulator predicts (see the module docstring for the definitions).

    Attributes:
        throughput: cluster samples/s over the measured window.
        per_vw_throughput: samples/s of each VW over its own waves ``1..W-1``.
        makespan_s: simulated time until the last minibatch finished.
        window_s: ``(t_a, t_b)`` of the measured window, seconds.
        gpu_busy: per VW, per stage: computing fraction of the measured window.
        waiting_s: per VW: time its admission was blocked by WSP.
        idle_s: per VW: part of ``waiting_s`` during which none of its GPUs computed.
        max_in_flight: per VW, per stage: most minibatches held at once.
        cross_node_bytes: bytes moved across nodes (activations, gradients, push, pull).
        max_clock_distance: largest clock distance seen (never above ``D + 1``).
        events: number of events processed.
        completions_ms: per VW, the end time of each minibatch's stage-0 backward.
        trace: the recorded intervals (empty unless ``record_trace``).
    """

    throughput: float
    per_vw_throughput: tuple[float, ...]
    makespan_s: float
    window_s: tuple[float, float]
    gpu_busy: tuple[tuple[float, ...], ...]
    waiting_s: tuple[float, ...]
    idle_s: tuple[float, ...]
    max_in_flight: tuple[tuple[int, ...], ...]
    cross_node_bytes: int
    max_clock_distance: int
    events: int
    completions_ms: tuple[tuple[float, ...], ...]
    trace: tuple[TraceEvent, ...] = ()

    @property
    def idle_fraction(self) -> tuple[float, ...]:
        """Per VW: idle time as a fraction of waiting time (0 when it never waited)."""
        return tuple(
            i / w if w > 0 else 0.0 for i, w in zip(self.idle_s, self.waiting_s, strict=True)
        )


def busy_ms(starts: Sequence[float], ends: Sequence[float], lo: float, hi: float) -> float:
    """Time (ms) of one stage's intervals (sorted, disjoint) inside ``[lo, hi]``.

    Only the intervals overlapping the window are visited (bisection); the ones inside it are
    added whole, in time order, so the sum is the same float as clipping every interval.
    """
    i, j = bisect_right(ends, lo), bisect_left(starts, hi)  # intervals i .. j-1 overlap
    if i >= j:
        return 0.0
    first = max(0.0, min(ends[i], hi) - max(starts[i], lo))
    if j - i == 1:
        return first
    last = max(0.0, min(ends[j - 1], hi) - max(starts[j - 1], lo))
    inner = map(sub, ends[i + 1 : j - 1], starts[i + 1 : j - 1])
    return sum(chain((first,), inner, (last,)))


def idle_ms(
    waits: Sequence[tuple[float, float]],
    busy_start: Sequence[Sequence[float]],
    busy_end: Sequence[Sequence[float]],
) -> float:
    """Waiting time (ms) during which none of a VW's GPUs computed.

    Args:
        waits: the VW's ``(start, end)`` waits (ms).
        busy_start, busy_end: per stage, its compute intervals in time order (ms).

    For each wait, the union of the compute intervals that touch it (found by bisection in each
    stage's sorted intervals) is subtracted: the same floats as merging all intervals first.
    """
    idle = 0.0
    for a, b in waits:
        touching: list[tuple[float, float]] = []
        for st, en in zip(busy_start, busy_end, strict=True):
            i, j = bisect_left(en, a), bisect_right(st, b)  # intervals i .. j-1 touch [a, b]
            touching.extend(zip(st[i:j], en[i:j], strict=True))
        touching.sort()
        merged: list[tuple[float, float]] = []
        for x, y in touching:
            if merged and x <= merged[-1][1]:
                merged[-1] = (merged[-1][0], max(merged[-1][1], y))
            else:
                merged.append((x, y))
        idle += (b - a) - sum(max(0.0, min(y, b) - max(x, a)) for x, y in merged)
    return idle
