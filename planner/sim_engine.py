"""The simulator's event loop: pipelines inside virtual workers plus WSP across them.

It executes exactly the rules the runtime executes, imported from the same modules:
:class:`planner.schedule.StageQueue` (paper Sec. 4) on every GPU and
:func:`planner.wsp.required_global_clock` / :class:`planner.wsp.GlobalClock` (Sec. 5) for
admission. Times are milliseconds inside the simulator; results report seconds and samples/s.

Model (one event heap, O(log n) per event, so the cost grows near-linearly with events):

- **Compute**: stage ``s`` runs ``F(p)`` for ``fwd_ms[s]``, ``B(p)`` for ``bwd_ms[s]``; the last
  stage runs ``FB(p)`` for ``fwd_ms + bwd_ms``. One task at a time per GPU, chosen by its
  ``StageQueue``.
- **Transfers**: the activations of ``p`` (gradients) become available when the sender's
  ``F(p)`` (``B(p)``) ends; the receiver's task starts by receiving them: it takes
  ``recv_fwd_ms[s]`` (``recv_bwd_ms[s]``) of the receiving GPU (the paper's stage time counts
  receive time, Sec. 4) and occupies the *sender's link* for that time: its own GPU link for
  a transfer inside a node, its node's network card (shared by every GPU of that node, of
  every VW) for a transfer to another node. A link carries one transfer at a time, first
  come first served; when it is busy the receiver waits. Specs without ``nodes`` give every
  GPU its own card (no sharing).
- **Admission**: a VW admits minibatch ``p`` into stage 0 when fewer than ``Nm`` are in flight
  (admitted, stage-0 backward not finished) and its pulled global clock is at least
  :func:`~planner.wsp.required_global_clock`.
- **WSP**: when stage ``s`` finishes the backward of a wave's last minibatch it pushes its
  aggregated update to the parameter-server shards: ``push_ms[s]`` (shards on its node) on
  its own link, then ``push_inter_ms[s]`` (shards on other nodes) on its node's card, FIFO
  with the activation traffic. The VW's local clock advances when all its stages' pushes arrived;
  the global clock is the minimum over VWs. A VW that needs a newer global clock waits for
  it, then pulls (``pull_ms``: the slowest stage's pull, all stages pulling in parallel;
  shard-side contention is not modelled) and only then admits. Waiting = admission blocked
  by WSP (waiting for the clock plus the pull); idle = waiting while no GPU of the VW computes.
- **Throughput** (:func:`measured_throughput`, the runtime uses the same function): wave 0
  is warm-up. ``t_a`` = the latest end of wave 0 over VWs, ``t_b`` = the earliest end of the
  last wave; throughput = batch size x minibatches whose stage-0 backward ended in
  ``(t_a, t_b]`` / ``(t_b - t_a)``. With one VW this is exactly the samples of waves
  ``1..W-1`` over their wall time.
"""

from __future__ import annotations

import heapq
import logging
from collections.abc import Sequence

from planner.schedule import Kind, StageQueue, Task
from planner.sim_types import PipelineSpec, SimResult, TraceEvent, measured_throughput, own_rate
from planner.wsp import GlobalClock, required_global_clock
from profiler.errors import PlanError

__all__ = [
    "PipelineSpec",
    "SimResult",
    "TraceEvent",
    "measured_throughput",
    "simulate_pipelines",
]

log = logging.getLogger(__name__)

_DONE, _PUSHED, _PULLED = 0, 1, 2  # event codes


class _VW:
    """Mutable per-VW state of one simulation run (private to the event loop)."""

    def __init__(self, spec: PipelineSpec) -> None:
        n = spec.n_stages
        self.spec = spec
        self.queues = [StageQueue(s, n) for s in range(n)]
        self.nic_free = [0.0] * n
        self.admitted = 0
        self.in_flight = 0
        self.pulled = 0  # global clock held locally
        self.wait_start = -1.0  # >= 0 while admission is blocked by WSP
        self.need = 0  # global clock the blocked admission needs
        self.pulling = False
        self.pushed = [0] * 1  # per wave: stages whose push arrived
        self.next_push_wave = 0
        self.completions: list[float] = []
        self.busy: list[list[tuple[float, float]]] = [[] for _ in range(n)]
        self.waits: list[tuple[float, float]] = []
        self.max_in_flight = [0] * n


class _Sim:
    """The event loop (private; use :func:`simulate_pipelines`)."""

    def __init__(
        self, specs: Sequence[PipelineSpec], nm: int, D: int, waves: int, record: bool
    ) -> None:
        self.vws = [_VW(s.validated()) for s in specs]
        self.nm, self.D, self.total = nm, D, waves * nm
        self.clock = GlobalClock(len(self.vws))
        self.heap: list[tuple[float, int, int, int, int, object]] = []
        self.seq = 0
        self.events = 0
        self.cross_bytes = 0
        self.max_distance = 0
        self.record = record
        self.trace: list[TraceEvent] = []
        self.blocked: set[int] = set()
        self.node_free: dict[str, float] = {}  # node -> when its network card is free (ms)

    def _at(self, t: float, code: int, v: int, s: int, x: object) -> None:
        heapq.heappush(self.heap, (t, self.seq, code, v, s, x))
        self.seq += 1

    def run(self) -> None:
        for v in range(len(self.vws)):
            self._admit(v, 0.0)
        heap = self.heap
        while heap:
            now, _, code, v, s, x = heapq.heappop(heap)
            self.events += 1
            if code == _DONE:
                self._done(v, s, x, now)  # type: ignore[arg-type]
            elif code == _PUSHED:
                self._pushed(v, x, now)  # type: ignore[arg-type]
            else:
                self._pulled(v, x, now)  # type: ignore[arg-type]

    # ---------------------------------------------------------------- admission and WSP

    def _admit(self, v: int, now: float) -> None:
        w = self.vws[v]
        while w.admitted < self.total and w.in_flight < self.nm and not w.pulling:
            mb = w.admitted + 1
            need = required_global_clock(mb, self.nm, self.D)
            if need > w.pulled:
                if w.wait_start < 0:
                    w.wait_start, w.need = now, need
                if self.clock.global_clock >= need:
                    self._start_pull(v, now)
                else:
                    self.blocked.add(v)
                break
            w.admitted += 1
            w.in_flight += 1
            q = w.queues[0]
            q.ready(Task(0, q.forward_kind, mb))
        self._dispatch(v, 0, now)

    def _start_pull(self, v: int, now: float) -> None:
        w = self.vws[v]
        w.pulling = True
        self.blocked.discard(v)
        self.cross_bytes += sum(w.spec.cross_sync_bytes)
        self._at(now + max(w.spec.pull_ms), _PULLED, v, -1, self.clock.global_clock)

    def _pulled(self, v: int, version: int, now: float) -> None:
        w = self.vws[v]
        w.pulling = False
        w.pulled = version
        w.waits.append((w.wait_start, now))
        if self.record:
            self.trace.append(TraceEvent(v, -1, "wait", w.need - 1, w.wait_start, now))
        w.wait_start = -1.0
        self._admit(v, now)

    def _push(self, v: int, s: int, wave: int, now: float) -> None:
        w = self.vws[v]
        start = max(now, w.nic_free[s])
        end = start + w.spec.push_ms[s]
        w.nic_free[s] = end
        if w.spec.push_inter_ms and w.spec.push_inter_ms[s] > 0.0:
            node = w.spec.nodes[s] if w.spec.nodes else f"{v}/{s}"
            end = max(end, self.node_free.get(node, 0.0)) + w.spec.push_inter_ms[s]
            self.node_free[node] = end
        self.cross_bytes += w.spec.cross_sync_bytes[s]
        if self.record and end > start:
            self.trace.append(TraceEvent(v, s, "push", wave, start, end))
        self._at(end, _PUSHED, v, s, wave)

    def _pushed(self, v: int, wave: int, now: float) -> None:
        w = self.vws[v]
        while len(w.pushed) <= wave:
            w.pushed.append(0)
        w.pushed[wave] += 1
        advanced = False
        n = w.spec.n_stages
        while w.next_push_wave < len(w.pushed) and w.pushed[w.next_push_wave] == n:
            before = self.clock.global_clock
            self.clock.push(v, w.next_push_wave)
            w.next_push_wave += 1
            self.max_distance = max(self.max_distance, self.clock.distance)
            advanced = advanced or self.clock.global_clock > before
        if advanced:
            g = self.clock.global_clock
            for u in sorted(u for u in self.blocked if self.vws[u].need <= g):
                self._start_pull(u, now)

    # ---------------------------------------------------------------- stage execution

    def _dispatch(self, v: int, s: int, now: float) -> None:
        w = self.vws[v]
        q = w.queues[s]
        t = q.next()
        if t is None:
            return
        sp = w.spec
        w.max_in_flight[s] = max(w.max_in_flight[s], q.in_flight)
        if t.kind is Kind.B:
            recv, src, comp = sp.recv_bwd_ms[s], s + 1, sp.bwd_ms[s]
        else:
            recv, src = sp.recv_fwd_ms[s], s - 1
            comp = sp.fwd_ms[s] + (sp.bwd_ms[s] if t.kind is Kind.FB else 0.0)
        start = now
        if recv > 0.0 and src >= 0:
            nodes = sp.nodes
            if nodes and nodes[src] != nodes[s]:  # over the sender node's shared card
                start = max(now, self.node_free.get(nodes[src], 0.0))
                self.node_free[nodes[src]] = start + recv
            else:
                start = max(now, w.nic_free[src])
                w.nic_free[src] = start + recv
            if self.record:
                self.trace.append(TraceEvent(v, s, "recv", t.mb, start, start + recv))
        if 0 <= src < sp.n_stages:
            self.cross_bytes += sp.cross_recv_bytes[s if t.kind is not Kind.B else src]
        c0 = start + recv
        end = c0 + comp
        w.busy[s].append((c0, end))
        if self.record:
            self.trace.append(TraceEvent(v, s, t.kind.value, t.mb, c0, end))
        self._at(end, _DONE, v, s, t)

    def _done(self, v: int, s: int, t: Task, now: float) -> None:
        w = self.vws[v]
        q = w.queues[s]
        q.done(t)
        n = w.spec.n_stages
        if t.kind is Kind.F:
            nq = w.queues[s + 1]
            nq.ready(Task(s + 1, nq.forward_kind, t.mb))
            self._dispatch(v, s + 1, now)
        elif s > 0:
            w.queues[s - 1].ready(Task(s - 1, Kind.B, t.mb))
            self._dispatch(v, s - 1, now)
        if t.kind is not Kind.F and t.mb % self.nm == 0:
            self._push(v, s, t.mb // self.nm - 1, now)
        if s == 0 and (t.kind is Kind.B or n == 1):
            w.completions.append(now)
            w.in_flight -= 1
            self._admit(v, now)
        self._dispatch(v, s, now)

    # ---------------------------------------------------------------- results

    def result(self, batch_size: int) -> SimResult:
        comps = [w.completions for w in self.vws]
        thr = measured_throughput(comps, self.nm, batch_size)
        t_a = max(c[self.nm - 1] for c in comps)
        t_b = min(c[-1] for c in comps)
        lo, hi = (
            (t_a, t_b)
            if t_b > t_a
            else (min(c[self.nm - 1] for c in comps), max(c[-1] for c in comps))
        )
        busy = tuple(tuple(_clipped(iv, lo, hi) / (hi - lo) for iv in w.busy) for w in self.vws)
        waiting = tuple(sum(b - a for a, b in w.waits) / 1e3 for w in self.vws)
        idle = tuple(_idle(w) / 1e3 for w in self.vws)
        return SimResult(
            throughput=thr,
            per_vw_throughput=tuple(
                own_rate(c, len(c) // self.nm, self.nm, batch_size) for c in comps
            ),
            makespan_s=max(c[-1] for c in comps) / 1e3,
            window_s=(lo / 1e3, hi / 1e3),
            gpu_busy=busy,
            waiting_s=waiting,
            idle_s=idle,
            max_in_flight=tuple(tuple(w.max_in_flight) for w in self.vws),
            cross_node_bytes=self.cross_bytes,
            max_clock_distance=self.max_distance,
            events=self.events,
            completions_ms=tuple(tuple(c) for c in comps),
            trace=tuple(sorted(self.trace, key=lambda e: (e.start_ms, e.vw, e.stage))),
        )


def _clipped(intervals: Sequence[tuple[float, float]], lo: float, hi: float) -> float:
    return sum(max(0.0, min(b, hi) - max(a, lo)) for a, b in intervals)


def _idle(w: _VW) -> float:
    """Waiting time (ms) during which none of the VW's GPUs computed."""
    if not w.waits:
        return 0.0
    merged: list[tuple[float, float]] = []
    for a, b in sorted(iv for st in w.busy for iv in st):
        if merged and a <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], b))
        else:
            merged.append((a, b))
    idle = 0.0
    for a, b in w.waits:
        idle += (b - a) - _clipped(merged, a, b)
    return idle


def simulate_pipelines(
    specs: Sequence[PipelineSpec],
    nm: int,
    D: int = 0,
    waves: int = 20,
    batch_size: int = 1,
    record_trace: bool = False,
) -> SimResult:
    """Simulate virtual workers given as plain per-stage times (the low-level entry).

    Args:
        specs: one :class:`PipelineSpec` per virtual worker.
        nm: minibatches in flight per VW (= minibatches per wave).
        D: WSP threshold (clock distance at most ``D + 1``).
        waves: waves each VW runs (>= 2; wave 0 is warm-up).
        batch_size: samples per minibatch (throughput is in samples/s).
        record_trace: keep every interval in ``SimResult.trace`` (for Gantt charts).

    Raises:
        PlanError: no VW, ``nm < 1``, ``D < 0``, ``waves < 2`` or an invalid spec.
    """
    if not specs:
        raise PlanError("nothing to simulate: the plan has no virtual workers")
    if nm < 1 or D < 0 or waves < 2:
        raise PlanError(f"need nm >= 1, D >= 0 and waves >= 2 (got nm={nm}, D={D}, waves={waves})")
    sim = _Sim(specs, nm, D, waves, record_trace)
    sim.run()
    res = sim.result(batch_size)
    log.debug(
        "simulated %d VWs x %d waves: %d events, %.1f samples/s",
        len(specs),
        waves,
        sim.events,
        res.throughput,
    )
    return res
