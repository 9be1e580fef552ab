"""The simulator's event loop: pipelines inside virtual workers plus WSP across them.

It executes exactly the rules the runtime executes, imported from the same modules: the
plan's :class:`planner.schedule.Schedule` (paper Sec. 4: the task order of every GPU and how
many minibatches enter a pipeline) and :func:`planner.wsp.required_global_clock` /
:class:`planner.wsp.GlobalClock` (Sec. 5) for admission. Times are milliseconds inside the simulator; results report seconds and samples/s.

Model (one event heap, O(log n) per event; see docs/simulator.md, *Scale*, for the cost):

- **Compute**: stage ``s`` runs ``F(p)`` for ``fwd_ms[s]``, ``B(p)`` for ``bwd_ms[s]``; the last
  stage runs ``FB(p)`` for ``fwd_ms + bwd_ms``. One task at a time per GPU, chosen by its
  ``StageQueue``.
- **Transfers**: the activations of ``p`` (gradients) leave when the sender's ``F(p)``
  (``B(p)``) ends and travel for ``recv_fwd_ms[s]`` (``recv_bwd_ms[s]``) on the *sender's
  link*: its own GPU link for a transfer inside a node, its node's network card (shared by
  every GPU of that node, of every VW) for a transfer to another node. A link carries one
  transfer at a time, first come first served. The receiver's task can start once they
  arrived; meanwhile the receiving GPU computes other tasks, as the runtime's receive threads
  do (``runtime/stage/comm.py``): communication overlaps computation where the runtime
  overlaps it. (The paper's Sec. 4 stage time counts receive time; the partitioner still
  does, :attr:`planner.plan.StagePlan.time_ms`, a bound the simulator can beat.) Specs without
  ``nodes`` give every GPU its own card (no sharing).
- **Admission**: a VW admits minibatch ``p`` into stage 0 when its schedule lets one more in
  (:meth:`~planner.schedule.Schedule.admissible`; ``hetpipe``: fewer than ``Nm`` in flight,
  i.e. admitted with stage-0 backward not finished) and its pulled global clock is at least
  :func:`~planner.wsp.required_global_clock`.
- **WSP**: when stage ``s`` finishes the backward of a wave's last minibatch it pushes its
  aggregated update to the parameter-server shards: ``push_ms[s]`` (shards on its node) on
  its own link, then ``push_inter_ms[s]`` (shards on other nodes) on its node's card, FIFO
  with the activation traffic; that backward costs ``wave_overhead_ms[s]`` more (the runtime's
  own push and pull work, :mod:`planner.overhead`). The VW's local clock advances when all its stages' pushes arrived;
  the global clock is the minimum over VWs. A VW that needs a newer global clock waits for
  it, then every stage pulls its own parameters (``pull_ms[s]``, in parallel; shard-side
  contention is not modelled) and each waits for its own pull only, as the runtime's stages
  do (``runtime/sync/wave.py``): stage 0 admits once its pull arrived, a later stage starts
  the first forward that runs on the pulled weights once its pull arrived. At D = 0 a stage
  other than the last folds that pull at its first update after the push: that backward
  computes and sends its gradients when ready, only the stage's end waits for the pull
  (on stage 0 the whole backward follows the pull: the runtime admitted the next wave's
  first forward ahead of it, and that forward waits for the pull). Waiting =
  admission blocked by WSP (waiting for the clock plus stage 0's pull); idle = waiting while
  no GPU of the VW computes.
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
from itertools import count
from typing import Any

from planner.cluster import fifo_slot
from planner.draw import TraceEvent
from planner.schedule import HETPIPE, Kind, Schedule, Task
from planner.sim.state import NO_LINK, Links, StageState, VWState
from planner.sim.types import (
    PipelineSpec,
    SimResult,
    busy_ms,
    idle_ms,
)
from planner.throughput import measured_throughput, own_rate
from planner.wsp import GlobalClock, folds_at_update, required_global_clock
from profiler.errors import PlanError

__all__ = ["simulate_pipelines"]

log = logging.getLogger(__name__)

# event codes: a task ended; a folding backward's gradients left (its stage still waits for
# the pull to fold); a folding backward's stage ended (its gradients already left); others
_DONE, _GRADS, _FOLDED, _PUSHED, _PULLED, _ARRIVED = 0, 1, 2, 3, 4, 5


class _Sim:
    """The event loop (private; use :func:`simulate_pipelines`)."""

    def __init__(
        self,
        specs: Sequence[PipelineSpec],
        nm: int,
        D: int,
        waves: int,
        record: bool,
        schedule: Schedule,
        alone: bool = False,
    ) -> None:
        self.links = Links()
        self.schedule = schedule
        self.vws = [VWState(s.validated(), v, self.links, schedule) for v, s in enumerate(specs)]
        for w in self.vws:  # the last stage runs in minibatch order (no tied copies here)
            for s, st in enumerate(w.stages):  # alone: no pull to fold (planner.sync)
                st.folds = not alone and folds_at_update(D, in_order=s == w.n - 1)
        self.nm, self.D, self.total = nm, D, waves * nm
        self.clock = GlobalClock(len(self.vws))
        # (time ms, sequence number, event code, VW, stage, task/wave/version): ties in time
        # run in the order they were scheduled
        self.heap: list[tuple[float, int, int, VWState, int, Any]] = []
        self.seq = count()
        self.events = 0
        self.cross_bytes = 0
        self.max_distance = 0
        self.record = record
        self.trace: list[TraceEvent] = []
        self.blocked: set[int] = set()

    def run(self) -> None:
        """Process events in time order (ties: in the order they were scheduled) until none is left.

        Stage-task completions, almost every event, are handled inline: this loop is the
        simulator's hot path (see docs/simulator.md, *Scale*).
        """
        for w in self.vws:
            self._admit(w, 0.0)
        heap, pop, dispatch, nm = self.heap, heapq.heappop, self._dispatch, self.nm
        F, B = Kind.F, Kind.B
        while heap:
            now, _, code, w, s, t = pop(heap)
            if code > _FOLDED:
                if code == _ARRIVED:
                    w.stages[s].queue.ready(t)
                    dispatch(w, s, now)
                elif code == _PUSHED:
                    self._pushed(w, t, now)
                else:
                    self._pulled(w, t, now)
                continue
            stages = w.stages
            if code != _GRADS:
                stages[s].queue.done(t)
            kind = t.kind
            if kind is F:
                nxt = stages[s + 1]
                task = Task(s + 1, nxt.forward_kind, t.mb)
                self.cross_bytes += nxt.f_bytes
                if nxt.f_link == NO_LINK:
                    nxt.queue.ready(task)
                    dispatch(w, s + 1, now)
                else:
                    self._transfer(w, task, nxt.f_recv, nxt.f_link, now)
            elif s > 0 and code != _FOLDED:
                prev = stages[s - 1]
                task = Task(s - 1, B, t.mb)
                self.cross_bytes += prev.b_bytes
                if prev.b_link == NO_LINK:
                    prev.queue.ready(task)
                    dispatch(w, s - 1, now)
                else:
                    self._transfer(w, task, prev.b_recv, prev.b_link, now)
                if code == _GRADS:
                    continue
            if kind is not F and t.mb % nm == 0:
                self._push(w, s, t.mb // nm - 1, now)
            if s == 0 and (kind is B or w.n == 1):
                w.completions.append(now)
                w.in_flight -= 1
                self._admit(w, now)  # ends by offering stage 0 its next task
            else:
                dispatch(w, s, now)
        self.events = next(self.seq)  # every scheduled event was processed

    # ---------------------------------------------------------------- admission and WSP

    def _admit(self, w: VWState, now: float) -> None:
        n = self.schedule.admissible(w.admitted, w.admitted - w.in_flight, self.nm, self.total)
        for _ in range(n):
            if w.pulling:
                break
            mb = w.admitted + 1
            need = required_global_clock(mb, self.nm, self.D)
            if need > w.pulled:
                if w.wait_start < 0:
                    w.wait_start, w.need = now, need
                if self.clock.global_clock >= need:
                    self._start_pull(w, now)
                else:
                    self.blocked.add(w.v)
                break
            w.admitted += 1
            w.in_flight += 1
            first = w.stages[0]
            first.queue.ready(Task(0, first.forward_kind, mb))
        self._dispatch(w, 0, now)

    def _start_pull(self, w: VWState, now: float) -> None:
        """Every stage pulls the global clock now, each its own parameters; stage 0 admits
        when its own pull arrived, a later stage waits for its own at the forward that needs
        it (:meth:`_dispatch`), as the runtime's stages do (``runtime/sync/wave.py``)."""
        w.pulling = True
        self.blocked.discard(w.v)
        self.cross_bytes += sum(w.spec.cross_sync_bytes)
        version = self.clock.global_clock
        for s, st in enumerate(w.stages):
            st.pulls.append((version, now + w.spec.pull_ms[s]))
            parked = st.parked
            if parked is not None and version >= self._fold_need(parked[0].mb):
                st.parked = None
                t, computed = parked
                arrives = now + w.spec.pull_ms[s]
                if computed < 0.0:  # waits for the pull before it computes (_dispatch)
                    self._begin(w, s, t, arrives)
                else:
                    self._fold(w, s, t, max(computed, arrives))
        heapq.heappush(
            self.heap, (now + w.spec.pull_ms[0], next(self.seq), _PULLED, w, -1, version)
        )

    @staticmethod
    def _pulled_by(st: StageState, need: int, now: float) -> float:
        """When stage ``st`` holds global clock ``need``: when its pull of it arrives (a
        forward: the VW started that pull before it admitted the minibatch that needs it),
        or ``-1`` when no pull of it started yet."""
        pulls = st.pulls
        while len(pulls) > 1 and pulls[1][1] <= now:  # superseded by a newer pull, arrived
            del pulls[0]
        for version, arrives in pulls:
            if version >= need:
                return arrives if arrives > now else now
        return -1.0

    def _fold_need(self, mb: int) -> int:
        """The clock the update of ``mb`` waits for on a stage that folds at its update:
        the pull after the previous wave's push (0: none, ``mb`` is not the first update
        after a push)."""
        if mb <= self.nm or (mb - 1) % self.nm:
            return 0
        return required_global_clock(mb - 1 + self.nm, self.nm, self.D)

    def _pulled(self, w: VWState, version: int, now: float) -> None:
        w.pulling = False
        w.pulled = version
        w.waits.append((w.wait_start, now))
        if self.record:
            self.trace.append(TraceEvent(w.v, -1, "wait", w.need - 1, w.wait_start, now))
        w.wait_start = -1.0
        self._admit(w, now)

    def _push(self, w: VWState, s: int, wave: int, now: float) -> None:
        free = self.links.free
        st = w.stages[s]
        own = st.own_link
        start, end = fifo_slot(free[own], now, w.spec.push_ms[s])
        free[own] = end
        card = st.push_card
        if card != NO_LINK:  # the part to other nodes, on the card once the own link is free
            end = fifo_slot(free[card], end, w.spec.push_inter_ms[s])[1]
            free[card] = end
        self.cross_bytes += w.spec.cross_sync_bytes[s]
        if self.record and end > start:
            self.trace.append(TraceEvent(w.v, s, "push", wave, start, end))
        heapq.heappush(self.heap, (end, next(self.seq), _PUSHED, w, s, wave))

    def _pushed(self, w: VWState, wave: int, now: float) -> None:
        while len(w.pushed) <= wave:
            w.pushed.append(0)
        w.pushed[wave] += 1
        advanced = False
        while w.next_push_wave < len(w.pushed) and w.pushed[w.next_push_wave] == w.n:
            before = self.clock.global_clock
            self.clock.push(w.v, w.next_push_wave)
            w.next_push_wave += 1
            self.max_distance = max(self.max_distance, self.clock.distance)
            advanced = advanced or self.clock.global_clock > before
        if advanced:
            g = self.clock.global_clock
            for u in sorted(u for u in self.blocked if self.vws[u].need <= g):
                self._start_pull(self.vws[u], now)

    # ---------------------------------------------------------------- stage execution

    def _transfer(self, w: VWState, task: Task, recv: float, link: int, now: float) -> None:
        """Send ``task``'s input over ``link`` (FIFO) for ``recv`` ms; the task becomes ready
        on its stage when it arrived."""
        free = self.links.free
        start, end = fifo_slot(free[link], now, recv)
        free[link] = end
        if self.record:
            self.trace.append(TraceEvent(w.v, task.stage, "recv", task.mb, start, end))
        heapq.heappush(self.heap, (end, next(self.seq), _ARRIVED, w, task.stage, task))

    def _dispatch(self, w: VWState, s: int, now: float) -> None:
        """Start stage ``s``'s next task if its queue allows one (its input has arrived)."""
        st = w.stages[s]
        q = st.queue
        t = q.next()
        if t is None:
            return
        held = q.in_flight
        if held > st.max_in_flight:
            st.max_in_flight = held
        c0 = now
        if t.kind is not Kind.B and st.pulls:  # a forward runs on the weights it pulled
            need = required_global_clock(t.mb, self.nm, self.D)
            if need > 0:
                c0 = max(now, self._pulled_by(st, need, now))
        elif st.folds and t.kind is Kind.B:  # D = 0: the first update after a push folds
            need = self._fold_need(t.mb)  # the pull in first (runtime/sync/wave.py)
            if need > 0:
                pulled = self._pulled_by(st, need, now)
                if s > 0:
                    self._begin_fold(w, s, t, now, pulled)
                    return
                # stage 0: the runtime admits the next wave's first forward when the wave's
                # last backward ends, and that forward waits for the same pull, ahead of this
                # backward (StageWorker._loop, WaveSync.before_forward): it runs after the pull
                if pulled < 0.0:  # _start_pull begins it
                    st.parked = (t, -1.0)
                    return
                c0 = pulled
        self._begin(w, s, t, c0)

    def _begin_fold(self, w: VWState, s: int, t: Task, c0: float, pulled: float) -> None:
        """Run backward ``t``, whose update folds a pull arriving at ``pulled`` (ms; ``-1``:
        not started yet), from ``c0``: as on a GPU, the backward does not wait for the pull;
        its gradients leave for stage ``s - 1`` when it ends, only its update waits
        (:meth:`_fold`)."""
        st = w.stages[s]
        if 0.0 <= pulled <= c0 + st.b_comp:  # arrived before the update: nothing waits
            self._begin(w, s, t, c0)
            return
        computed = self._begin(w, s, t, c0, _GRADS if s > 0 else -1)
        if pulled < 0.0:  # _start_pull ends it
            st.parked = (t, computed)
        else:
            self._fold(w, s, t, pulled)

    def _fold(self, w: VWState, s: int, t: Task, ready: float) -> None:
        """End folding backward ``t`` (its gradients already left) with its update, from
        ``ready`` (ms: its backward computed and its pull arrived): the wave term, where ``t``
        ends a wave, is charged after the fold, as the runtime's update and push work follow
        its wait; then the stage is free (event :data:`_FOLDED`)."""
        st = w.stages[s]
        end = ready
        if st.wave_comp and t.mb % self.nm == 0:
            end += st.wave_comp
            st.starts.append(ready)
            st.ends.append(end)
            if self.record:
                self.trace.append(TraceEvent(w.v, s, t.kind.value, t.mb, ready, end))
        heapq.heappush(self.heap, (end, next(self.seq), _FOLDED, w, s, t))

    def _begin(self, w: VWState, s: int, t: Task, c0: float, code: int = _DONE) -> float:
        """Run task ``t`` on stage ``s`` from ``c0`` (ms): its compute interval and the event
        ``code`` at its end (``_GRADS``: a folding backward's, whose wave term comes after the
        fold, :meth:`_fold`; ``-1``: none); returns when it ends."""
        st = w.stages[s]
        end = c0 + (st.b_comp if t.kind is Kind.B else st.f_comp)
        if code == _DONE and st.wave_comp and t.kind is not Kind.F and t.mb % self.nm == 0:
            end += st.wave_comp  # it ends a wave
        st.starts.append(c0)
        st.ends.append(end)
        if self.record:
            self.trace.append(TraceEvent(w.v, s, t.kind.value, t.mb, c0, end))
            if st.host is not None and t.kind is not Kind.F:  # prefetched ahead of the backward
                host, exposed = st.host
                self.trace.append(
                    TraceEvent(w.v, s, "host", t.mb, c0 + exposed - host, c0 + exposed)
                )
        if code >= 0:
            heapq.heappush(self.heap, (end, next(self.seq), code, w, s, t))
        return end

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
        busy = tuple(
            tuple(busy_ms(st.starts, st.ends, lo, hi) / (hi - lo) for st in w.stages)
            for w in self.vws
        )
        waiting = tuple(sum(b - a for a, b in w.waits) / 1e3 for w in self.vws)
        idle = tuple(
            idle_ms(w.waits, [st.starts for st in w.stages], [st.ends for st in w.stages]) / 1e3
            for w in self.vws
        )
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
            max_in_flight=tuple(tuple(st.max_in_flight for st in w.stages) for w in self.vws),
            cross_node_bytes=self.cross_bytes,
            max_clock_distance=self.max_distance,
            events=self.events,
            completions_ms=tuple(tuple(c) for c in comps),
            trace=tuple(sorted(self.trace, key=lambda e: (e.start_ms, e.vw, e.stage))),
        )


def simulate_pipelines(
    specs: Sequence[PipelineSpec],
    nm: int,
    D: int = 0,
    waves: int = 20,
    batch_size: int = 1,
    record_trace: bool = False,
    schedule: Schedule = HETPIPE,
    alone: bool = False,
) -> SimResult:
    """Simulate virtual workers given as plain per-stage times (the low-level entry).

    Args:
        specs: one :class:`PipelineSpec` per virtual worker.
        nm: minibatches in flight per VW (= minibatches per wave).
        D: WSP threshold (clock distance at most ``D + 1``).
        waves: waves each VW runs (>= 2; wave 0 is warm-up).
        batch_size: samples per minibatch (throughput is in samples/s).
        record_trace: keep every interval in ``SimResult.trace`` (for Gantt charts).
        schedule: the pipeline schedule every VW runs.
        alone: one VW trained by the ``local`` rule (no shards: nothing pulled, so no update
            waits to fold a pull; :func:`planner.sync.effective_rule`).

    Raises:
        PlanError: no VW, ``nm < 1``, ``D < 0``, ``waves < 2`` or an invalid spec.
    """
    if not specs:
        raise PlanError("nothing to simulate: the plan has no virtual workers")
    if nm < 1 or D < 0 or waves < 2:
        raise PlanError(f"need nm >= 1, D >= 0 and waves >= 2 (got nm={nm}, D={D}, waves={waves})")
    sim = _Sim(specs, nm, D, waves, record_trace, schedule, alone)
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
