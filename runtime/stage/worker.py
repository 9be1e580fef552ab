"""The stage worker: one process running one pipeline stage of one virtual worker.

It builds only its stage (:func:`runtime.stage.model.build_stage`), then executes the tasks in the
order the plan's :class:`planner.schedule.Schedule` gives (paper Sec. 4): ``F(p)`` after
``F(p-1)``, ``B(p)`` after ``B(p-1)``, FIFO among ready tasks, the last stage runs ``FB(p)``.
Stage 0 admits minibatches as the schedule says (``hetpipe``: one each time one completes its
backward pass, so at most ``Nm`` are in flight). Weights follow :class:`runtime.stage.weights.VersionedWeights` (exact local staleness).
"""

from __future__ import annotations

import logging
import math
import queue
import threading
import time
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor
from torch.func import functional_call

from planner.cluster import Link
from planner.nonfinite import Verdict
from planner.schedule import Kind, Task, schedule_named
from planner.wsp import wave_of
from profiler.errors import HetPipeRuntimeError
from profiler.memory import cuda_peak_bytes
from profiler.precision import autocast
from runtime.defaults import neighbour_wait_s
from runtime.link_pacing import LinkPacer, StageLinks, active_links
from runtime.messages import REPORTS
from runtime.results.metrics import StageResult
from runtime.send_queues import Route, SendQueues
from runtime.stage.comm import (
    Channel,
    Event,
    GradReceiver,
    TensorSpec,
    join_receivers,
    start_activation_receiver,
    wire_specs,
)
from runtime.stage.device import on_device
from runtime.stage.emulation import pace_until
from runtime.stage.grads import Held, backward_grads, outputs_backward
from runtime.stage.job import StageJob
from runtime.stage.model import build_stage, stage_rng_seed
from runtime.stage.moves import class_moves
from runtime.stage.nonfinite import StageJudge, mark
from runtime.stage.offload import memory_manager, metered_forward
from runtime.stage.tied import TiedGrads
from runtime.stage.timers import lap_timer
from runtime.stage.weights import VersionedWeights
from runtime.sync.registry import stage_sync
from runtime.sync.rule import StageSync, StageView

__all__ = ["StageWorker"]

log = logging.getLogger(__name__)


class StageWorker:
    """Runs one stage to completion; :meth:`run` returns its :class:`StageResult`."""

    def __init__(self, job: StageJob, events: Any = None, group: Any = None) -> None:
        """``group``: the group of every message, numbered like the world (a restarted VW's,
        :mod:`runtime.ps.rejoin`; ``None``: the default group)."""
        ctx, run = job.ctx, job.run
        self.ctx = ctx
        self.group = group
        self.run_cfg = run
        self._wait_s = neighbour_wait_s(run.timeout_s)  # a neighbour may be blocked in a pull
        self.events = events
        self.calibration = job.calibration if ctx.speed > 0 else None
        built = build_stage(job.source, ctx.batch_size, ctx.cuts, ctx.stage, run.seed)
        # one device per stage, chosen once: on CPU nothing moves (runtime.stage.device)
        self.device = torch.device(ctx.torch_device(torch.cuda.device_count()))
        self.module = built.module.to(self.device).train()
        self.loss_fn = built.loss
        self.names = built.names
        # local -> original name of every buffer (batch-norm statistics); a graph constant
        # made when a shipped stage is unpickled (``_tensor_constant0``) keeps its own
        self.buffer_names = {
            n: built.buffer_names.get(n, n.removeprefix("inner."))
            for n, _ in self.module.named_buffers()
        }
        self.precision = run.precision or "fp32"
        self.device_type = self.device.type
        self.in_specs = wire_specs(built.in_specs, self.precision)
        self.out_specs = wire_specs(built.out_specs, self.precision)
        self.data = job.minibatches(built) if ctx.stage == 0 or self.last else None
        params = dict(self.module.named_parameters())
        local = {orig: name for name, orig in self.names.items()}
        self.tied = TiedGrads(ctx.stage, ctx.rank - ctx.stage, built.tied, local, self._wait_s)
        self._place_weights(job, params)
        self.schedule = schedule_named(ctx.schedule)  # checked with the plan
        self.queue = self.schedule.queue(ctx.stage, ctx.n_stages)
        self.inbox: queue.SimpleQueue[Event] = queue.SimpleQueue()
        self.held: dict[int, Held] = {}
        self.result = StageResult(ctx.rank, ctx.vw, ctx.stage, ctx.device)
        self.fault = job.fault.hook(ctx.vw, ctx.stage) if job.fault is not None else None
        self._nan_at = job.fault.nan_at(ctx.vw, ctx.stage) if job.fault is not None else 0
        self.judge = StageJudge(
            run.on_nonfinite, ctx.vw, ctx.stage, self.last, job.first_mb, ctx.nm
        )
        self._loss = 0.0  # the last stage's loss of the minibatch being judged
        self.first_wave = job.sync.first_wave
        self.sync = self._start_sync(job, params, group)  # the synchronisation rule's hooks
        self._task_mb = 1  # the minibatch of the task being paced (its wave may straggle)
        self._task_wall0 = 0.0  # wall-clock start of the task being executed (the timeline)
        self._reports: list[tuple[Any, ...]] = []  # progress reports of the wave in progress
        self.timer = lap_timer(False)  # --profile-runtime: started with the run

    def _place_weights(self, job: StageJob, params: dict[str, torch.nn.Parameter]) -> None:
        """The stage's versioned weights (:class:`VersionedWeights`) and where its memory
        lives (:func:`runtime.stage.offload.memory_manager`)."""
        ctx = job.ctx
        # a resumed run's lr schedule goes on where it stopped (cosine horizon included)
        copy = not job.run.emulate or ctx.speed <= 0
        self.weights = VersionedWeights(
            params, ctx.nm, job.optimizer, job.first_mb + ctx.total_steps, job.first_mb,
            class_moves(ctx.memory, ctx.where, self.device, copy=copy), ctx.syncing,
        )  # fmt: skip
        buffer_bytes = sum(b.numel() * b.element_size() for b in self.module.buffers())
        factor = ctx.optimizer_state_factor
        self.offload, self.memory = memory_manager(
            ctx.memory, ctx.where, ctx.cap_bytes, ctx.host_cap_bytes,
            self.weights.param_bytes, buffer_bytes, factor, list(self.module.buffers()),
        )  # fmt: skip

    def _start_sync(
        self, job: StageJob, params: dict[str, torch.nn.Parameter], group: Any
    ) -> StageSync:
        """The stage's sender-side queues (:attr:`queues`) and its synchronisation rule's
        hooks over the stage's view."""
        ctx, links = job.ctx, self.links
        self.queues = _queues(links)
        view = StageView(
            ctx.rank, ctx.vw, ctx.stage, ctx.nm, f"vw{ctx.vw}-stage{ctx.stage}",
            tuple((self.names[n], p) for n, p in params.items()), self.weights, self.result,
            self.tied if self.tied else None, job.init_method, group,
            tuple((self.buffer_names[n], b) for n, b in self.module.named_buffers()),
            links, self.last, self.queues,
        )  # fmt: skip
        return stage_sync(job.sync, view)

    @property
    def links(self) -> StageLinks:
        """The emulated links this stage's transfers are paced to (none with ``emulate=False``)."""
        return active_links(self.ctx.links, self.run_cfg.emulate)

    @property
    def last(self) -> bool:
        """Whether this is the pipeline's last stage."""
        return self.ctx.stage == self.ctx.n_stages - 1

    # ------------------------------------------------------------ main loop

    def run(self, start_time: float | None = None) -> StageResult:
        """Start the synchronisation rule, execute every task of this stage, close the rule;
        returns the stage's measurements (``start_time``: now, after the rule started)."""
        ctx = self.ctx
        torch.manual_seed(stage_rng_seed(self.run_cfg.seed, ctx.vw, ctx.stage))  # reproducible
        self.sync.start(self.first_wave)  # (a resumed stage: the RNG state of its snapshot)
        start_time = time.time() if start_time is None else start_time
        self.result.start_time = start_time
        self.timer = lap_timer(self.run_cfg.profile_runtime)
        nxt, prev, group = ctx.next_rank, ctx.prev_rank, self.group
        to_next, to_prev = self._channels(nxt, prev, group)
        grad_rx, receivers = self._start_receivers(nxt, prev, group)
        self._received = 0  # forward messages received (stage 0: minibatches admitted)
        self._stop_in = ctx.stage == 0  # whether the number of minibatches is final
        self._f_done = self._b_done = 0  # forwards / backwards done here
        try:
            self._loop(start_time, to_next, to_prev, grad_rx)
            self._send_reports()
            for ch in (to_next, to_prev):
                if ch is not None:
                    ch.flush()
            self.timer.lap("send_recv")
        finally:
            if grad_rx is not None:
                grad_rx.close()
        join_receivers(receivers, self._wait_s, ctx.where)  # none outlives the run (comm.py)
        self.result.breakdown = self.timer.result()
        self.result.wall_s = time.time() - start_time
        self.result.peak_bytes = self.memory.peak_bytes
        self.result.cuda_peak_bytes = cuda_peak_bytes(self.device)  # 0 on CPU
        self.result.steps = self._b_done
        if self.run_cfg.return_state or self.run_cfg.out_dir is not None:
            self.result.state = {  # in host memory: the result leaves the process
                self.names[n]: p.detach().to("cpu", copy=True)
                for n, p in self.module.named_parameters()
            }
        # always: the run's evaluation needs them, and the shards hold parameters only
        self.result.buffers = {
            self.buffer_names[n]: b.detach().to("cpu", copy=True)
            for n, b in self.module.named_buffers()
        }
        self.sync.close()
        if self.queues is not None:
            self.queues.close()
        return self.result

    def _channels(
        self, nxt: int | None, prev: int | None, group: Any
    ) -> tuple[Channel | None, Channel | None]:
        """The sending sides towards the next and the previous stage (``None``: no such
        stage), charged on the stage's sender-side queues where it has them."""
        links = self.links
        return (
            self._channel(nxt, self.out_specs, group, links.next, links.next_queue),
            self._channel(prev, self.in_specs, group, links.prev, links.prev_queue),
        )

    def _channel(
        self,
        peer: int | None,
        specs: tuple[TensorSpec, ...],
        group: Any,
        link: Link | None,
        queue: str,
    ) -> Channel | None:
        """The sending side towards ``peer`` over ``link`` (``None``: no such stage)."""
        if peer is None:
            return None
        return Channel(peer, specs, group, _route(self.queues, link, queue))

    def _start_receivers(
        self, nxt: int | None, prev: int | None, group: Any
    ) -> tuple[GradReceiver | None, list[threading.Thread]]:
        """Start the threads that receive from the neighbours: the gradient receiver (when
        there is a next stage) and every receiver thread, to join once the run ended."""
        grad_rx, receivers = None, list[threading.Thread]()
        links = self.links  # emulated links: receives held back to their charge
        if nxt is not None:
            pace = LinkPacer(links.next)
            grad_rx = GradReceiver(nxt, self.out_specs, self.inbox, group, self._wait_s, pace)
            receivers.append(grad_rx.thread)
        if prev is not None:
            pace = LinkPacer(links.prev)
            act = start_activation_receiver(
                prev, self.in_specs, self.inbox, group, self._wait_s, pace
            )
            receivers.append(act)
        return grad_rx, receivers

    def _loop(
        self,
        start_time: float,
        to_next: Channel | None,
        to_prev: Channel | None,
        grad_rx: GradReceiver | None,
    ) -> None:
        """Execute tasks until every minibatch's backward is done here; tell the next stage
        when no more minibatches will come."""
        first = self.ctx.stage == 0
        total = self.ctx.total_steps
        stop_sent = False
        if first:
            self._admit_more(total)
        timer = self.timer
        while True:
            timer.lap("other")
            self._drain(block=False)
            timer.lap("send_recv")
            if first:
                total = self._final_total(total, start_time)
            closed = not first or self._received == total
            final = self._stop_in and closed
            if to_next is not None and final and not stop_sent and self._f_done == self._received:
                to_next.send_stop()
                stop_sent = True
            if final and self._b_done == self._received:
                return
            task = self.queue.next()
            timer.lap("bookkeeping")
            if task is None:
                self._drain(block=True)
                timer.lap("wait_neighbour")
                continue
            self._run_task(task, to_next, to_prev, grad_rx)
            if first and task.kind is not Kind.F:
                total = self._final_total(total, start_time)
                self._admit_more(total)
                timer.lap("bookkeeping")

    def _run_task(
        self,
        task: Task,
        to_next: Channel | None,
        to_prev: Channel | None,
        grad_rx: GradReceiver | None,
    ) -> None:
        """Execute one task and account for it."""
        self.result.max_in_flight = max(self.result.max_in_flight, self.queue.in_flight)
        self.timer.task(task.kind.value)
        t0 = time.perf_counter()
        self._execute(task, to_next, to_prev, grad_rx)
        self.result.busy_s += time.perf_counter() - t0
        self.timer.lap("other")
        # from after any pull wait (_task_wall0 is set when the device starts)
        self.result.log_interval(task.kind.value, task.mb, self._task_wall0, time.time())
        self.result.tasks += 1
        self.queue.done(task)
        if task.kind is not Kind.B:
            self._f_done += 1
        if task.kind is not Kind.F:
            self._b_done += 1
            self._completed(task.mb)
        self.timer.lap("bookkeeping")
        self.timer.idle()

    def _admit_more(self, total: int) -> None:
        """Stage 0: let in the minibatches the schedule admits now (of ``total`` in all)."""
        n = self.schedule.admissible(self._received, self._b_done, self.ctx.nm, total)
        for _ in range(n):
            self._received += 1
            self.queue.ready(Task(0, self.queue.forward_kind, self._received))

    def _final_total(self, total: int, start_time: float) -> int:
        """Stage 0: minibatches to run in all, given the time limit (never below those admitted).

        Alone, a VW stops admitting when its time is up; several VWs end where their rule
        agrees (:meth:`runtime.sync.rule.StageSync.agreed_total`).
        """
        total = self.sync.rule_total(total, self._received)  # backup: a late VW's jumps
        if self.run_cfg.time_limit_s <= 0:
            return total
        self.timer.lap("bookkeeping")
        agreed = self.sync.agreed_total(self._received, self._time_up(start_time))
        self.timer.lap("ps")  # the VWs agree on the last wave through a store
        return total if agreed is None else max(self._received, min(total, agreed))

    def _time_up(self, start_time: float) -> bool:
        limit = self.run_cfg.time_limit_s
        return limit > 0 and time.time() - start_time >= limit

    def _drain(self, block: bool) -> None:
        """Hand arrived messages to the queue in arrival order (waiting for one if ``block``)."""
        if block:
            try:
                ev = self.inbox.get(timeout=self._wait_s)
            except queue.Empty:
                raise HetPipeRuntimeError(
                    f"[{self.ctx.where}] no message from a neighbour stage for {self._wait_s:.0f} s "
                    "(a peer is stuck or dead)"
                ) from None
            self._handle(ev)
        while True:
            try:
                ev = self.inbox.get_nowait()
            except queue.Empty:
                return
            self._handle(ev)

    def _handle(self, ev: Event) -> None:
        log.debug("[%s] event %s %d", self.ctx.where, ev.kind, ev.mb)
        if ev.kind == "error":
            raise HetPipeRuntimeError(
                f"[{self.ctx.where}] receive failed: {ev.error}"
            ) from ev.error
        if ev.kind == "act":
            self._received += 1
            self.held[ev.mb] = Held(on_device(ev.tensors, self.device))
            self.queue.ready(Task(self.ctx.stage, self.queue.forward_kind, ev.mb))
        elif ev.kind == "grad":
            self.held[ev.mb].grads_in = on_device(ev.tensors, self.device)
            self.queue.ready(Task(self.ctx.stage, Kind.B, ev.mb))
        elif ev.kind == "stop":
            self._stop_in = True

    # ------------------------------------------------------------ tasks

    @property
    def _paced(self) -> bool:
        """Whether this stage emulates a device (its tasks are paced to the plan's times)."""
        return self.calibration is not None and self.run_cfg.emulate

    def _deadline(self, t0: float, kind: Kind) -> float:
        """When a task of ``kind`` started at ``t0`` ends on the emulated device (``t0`` when
        not paced)."""
        if self.calibration is None or not self.run_cfg.emulate:
            return t0
        slow = self.ctx.straggle.slowdown(self.ctx.vw, wave_of(self._task_mb, self.ctx.nm))
        return t0 + self.calibration.task_s(self.ctx.stage, kind.value) / self.ctx.speed * slow

    def _pace(self, t0: float, kind: Kind) -> None:
        if self._paced:
            deadline = self._deadline(t0, kind)
            self.timer.planned(deadline - t0)
            self.result.overrun_s += pace_until(deadline)
            self.timer.lap("paced")

    def _execute(
        self,
        task: Task,
        to_next: Channel | None,
        to_prev: Channel | None,
        grad_rx: GradReceiver | None,
    ) -> None:
        mb = self._task_mb = task.mb
        timer = self.timer
        if task.kind is not Kind.B:
            self._before_forward(mb)
        t0, self._task_wall0 = time.perf_counter(), time.time()
        log.debug("[%s] task %s", self.ctx.where, task)
        if self.offload is not None:  # offloaded data comes back one task ahead
            self.offload.prefetch_ahead()
            self.weights.prefetch()
        if self.fault is not None:
            self.fault(mb)
        timer.lap("other")
        if task.kind is Kind.B:
            grads_w, grads_x = self._backward(mb)
        else:
            out = self._forward(mb)
            if task.kind is Kind.F:
                timer.lap("real_compute")
                self._pace(t0, task.kind)
                if to_next is not None and grad_rx is not None:
                    grad_rx.expect(mb)
                    to_next.send_activations(mb, out)
                timer.lap("send_recv")
                return
            grads_w, grads_x = self._loss_backward(mb, out)
        timer.lap("real_compute")
        judged = self._judge(mb, grads_w, grads_x)  # before any gradient leaves
        timer.lap("bookkeeping")
        if not self._paced:  # the gradients leave first: the previous stage waits on them
            if to_prev is not None:
                to_prev.send_grads(mb, grads_x)
            timer.lap("send_recv")
            self._update(mb, grads_w, judged)
            self._post(mb)
            return
        self._end_paced_backward(task, t0, grads_w, grads_x, judged, to_prev)

    def _before_forward(self, mb: int) -> None:
        """Load ``mb`` (stage 0) and wait for the pull its forward needs: neither loading a
        minibatch (a host-side data loader's job) nor waiting for a WSP pull is device time,
        so a forward is paced from after them."""
        if self.ctx.stage == 0:
            self._load(mb)
            self.timer.lap("data")
        waited = self.result.wait_s
        self.sync.before_forward(mb)
        self.timer.lap("ps", self.result.wait_s - waited)

    def _end_paced_backward(
        self,
        task: Task,
        t0: float,
        grads_w: dict[str, Tensor | None],
        grads_x: list[Tensor | None],
        judged: Verdict,
        to_prev: Channel | None,
    ) -> None:
        """After an emulated device's backward ``task`` (started at ``t0``) computed: update, send
        the gradients and post the update's push, each when the paced window allows.

        The optimizer step and the wave's bookkeeping are device work (on a GPU a few passes
        over the weights at memory bandwidth, ~1 % of a step), so they run inside the task's
        paced window, not on top of it at CPU speed; a WSP pull the update blocks on is not
        device time. The gradients, then the wave's push, leave when the emulated backward
        ends: a GPU can send neither earlier."""
        mb, timer = task.mb, self.timer
        deadline = self._deadline(t0, task.kind)
        timer.planned(deadline - t0)
        # only the computation can make the device late: the update's CPU time past the
        # deadline is the runtime's cost (on a GPU it is microseconds), not a slow device
        self.result.overrun_s += max(0.0, time.perf_counter() - deadline)
        # tied: waits on earlier stages; queued: its window ahead of the push (send_queues.py)
        if to_prev is not None and (self.tied or to_prev.route is not None):
            to_prev.send_grads(mb, grads_x, not_before_s=deadline)
            to_prev = None
            timer.lap("send_recv")
        elif to_prev is not None and self.sync.update_may_wait(mb):  # paced on arrival: sent
            pace_until(deadline)  # at the deadline, not after a fold's wait (the update's
            timer.lap("paced")  # CPU time then follows the deadline: once a wave)
            to_prev.send_grads(mb, grads_x)
            to_prev = None
            timer.lap("send_recv")
        waited = self.result.wait_s
        fold = self._update(mb, grads_w, judged)
        pace_until(self._update_end(deadline, waited, fold))
        timer.lap("paced")
        if to_prev is not None:
            to_prev.send_grads(mb, grads_x)
            timer.lap("send_recv")
        self._post(mb)

    def _judge(
        self, mb: int, grads_w: dict[str, Tensor | None], grads_x: list[Tensor | None]
    ) -> Verdict:
        """The ``--on-nonfinite`` verdict on ``mb`` after its backward (a skip marks the
        gradients; :class:`runtime.stage.nonfinite.StageJudge`).

        Raises:
            Diverged: a loss or gradient is not finite and the run must stop.
        """
        if mb == self._nan_at and not self.last:  # test hook: this stage's gradients diverge
            mark(grads_w.values())
        loss = self._loss if self.last else 0.0
        return self.judge.local(mb, loss, self.held[mb].grads_in, grads_w.values(), grads_x)

    def _update_end(self, deadline: float, waited: float, fold: _FoldWait | None) -> float:
        """When an emulated device's update ends (``time.perf_counter``): its backward's
        ``deadline`` plus the waits since ``wait_s`` was ``waited`` (a collective after the
        backward), except a pull the update folds: the backward computed meanwhile, as a
        GPU's does, so the update starts at the later of its end and the pull's arrival."""
        waits = self.result.wait_s - waited
        if fold is None:
            return deadline + waits
        after = waits - fold.before_s - fold.wait_s  # waits after the fold (in the update)
        return max(deadline + fold.before_s, fold.end) + after

    def _update(
        self, mb: int, grads_w: dict[str, Tensor | None], judged: Verdict
    ) -> _FoldWait | None:
        """Update with the gradients of ``mb`` through the rule's hooks; returns the wait for
        a pull folded before it (``None``: none)."""
        timer, waited = self.timer, self.result.wait_s
        parked = self.weights.park_grads(grads_w)
        timer.lap("optimizer")
        grads_w = self.sync.reduce_grads(mb, parked)
        before = self.result.wait_s
        self.sync.before_update(mb)
        fold = None
        if self.result.wait_s > before:
            end = time.perf_counter()
            fold = _FoldWait(before - waited, self.result.wait_s - before, end)
        timer.lap("ps", self.result.wait_s - waited)
        if self.tied:  # a parameter held by several stages: every copy takes the summed step
            grads_w = self.tied.exchange(grads_w, self.weights.master)
        if grads_w is not parked:  # reduced over the VWs or summed with tied copies
            judged = self.judge.reduced(mb, judged, grads_w.values())
        if judged is Verdict.SKIP:
            self.result.skipped.append(mb)
        self.weights.update(mb, grads_w, apply=judged is Verdict.APPLY)
        timer.lap("optimizer")
        waited = self.result.wait_s
        self.sync.after_update(mb)
        timer.lap("ps", self.result.wait_s - waited)
        return fold

    def _post(self, mb: int) -> None:
        """Send what the rule prepared at the update of ``mb`` (WSP: the wave's push)."""
        waited = self.result.wait_s
        self.sync.post_update(mb)
        self.timer.lap("ps", self.result.wait_s - waited)

    def _load(self, mb: int) -> None:
        """Stage 0: fetch minibatch ``mb`` of this worker's data."""
        if self.data is None:
            raise HetPipeRuntimeError(f"[{self.ctx.where}] stage 0 has no data")
        inputs, targets = self.data.batch(mb)
        dev = self.device
        self.held[mb] = Held(on_device(inputs, dev), targets=on_device((targets,), dev)[0])

    def _forward(self, mb: int) -> Any:
        held = self.held[mb]
        held.inputs = tuple(
            x.requires_grad_() if x.is_floating_point() and self.ctx.stage > 0 else x
            for x in held.inputs
        )
        leaves = self.weights.acquire(mb)
        fn = lambda *xs: self._call(leaves, xs)  # noqa: E731
        out = metered_forward(mb, fn, held.inputs, leaves, self.offload, self.memory, self.weights)
        if not self.last:  # cast inside autograd: the gradients come back in the wire dtype
            self.weights.park(mb)  # a stashed version waits in host memory for the backward
            held.outputs = tuple(
                o.to(s.dtype) if o.is_floating_point() else o
                for o, s in zip(out, self.out_specs, strict=True)
            )
            return held.outputs
        return out

    def _call(self, leaves: dict[str, Tensor], inputs: tuple[Tensor, ...]) -> Any:
        """The stage's forward with a weight version (Nm = 1: the master parameters themselves),
        under autocast with ``--precision bf16``."""
        with autocast(self.device_type, self.precision):
            if self.ctx.nm == 1:
                return self.module(*inputs)
            return functional_call(self.module, leaves, inputs)

    def _backward(self, mb: int) -> tuple[dict[str, Tensor | None], list[Tensor | None]]:
        return outputs_backward(self.held[mb], self.weights.leaves(mb))

    def _loss_backward(
        self, mb: int, out: Any
    ) -> tuple[dict[str, Tensor | None], list[Tensor | None]]:
        if self.data is None:
            raise HetPipeRuntimeError(f"[{self.ctx.where}] last stage has no data")
        held = self.held[mb]
        if held.targets is not None:
            targets = held.targets
        else:
            targets = self.data.targets(mb).to(self.device)
        with autocast(self.device_type, self.precision):
            loss = self.loss_fn(out, targets)
        if mb == self._nan_at:  # test hook: the loss diverges here
            loss = loss * math.nan
        value = self._loss = float(loss.item())
        self.timer.lap("real_compute")
        self.result.losses.append((mb, value))
        self._report(("loss", self.ctx.rank, mb, value, time.time()))
        self.timer.lap("bookkeeping")
        return backward_grads(held, self.weights.leaves(mb), [loss], None)

    def _completed(self, mb: int) -> None:
        self.held.pop(mb, None)
        self.memory.release(mb)
        if self.offload is not None:
            self.offload.release(mb, self.memory)
        self.result.done_times.append(time.time())
        if self.ctx.stage == 0:
            skipped = mb in self.result.skipped  # every stage skips the same (planner.nonfinite)
            self._report(("done", self.ctx.rank, mb, time.time(), skipped))
        if mb % self.ctx.nm == 0:  # a wave ends (its update pushed, with a rule that pushes)
            self._send_reports()

    def _report(self, msg: tuple[Any, ...]) -> None:
        """Queue a progress report for the launcher (sent with its wave: :meth:`_send_reports`)."""
        if self.events is not None:
            self._reports.append(msg)

    def _send_reports(self) -> None:
        """Send the queued reports as one message (:data:`runtime.messages.REPORTS`): one
        write, and one wake-up of the launcher, per wave instead of one per report. A stage
        lost mid-wave loses its wave's reports; its VW recomputes that wave anyway."""
        if self._reports and self.events is not None:
            self.events.put((REPORTS, self.ctx.rank, tuple(self._reports)))
            self._reports.clear()


@dataclass(frozen=True)
class _FoldWait:
    """An update's wait for a pull it folds in first (WSP, D = 0: ``before_update``)."""

    before_s: float  # waited in the update before it (a collective's), s
    wait_s: float  # its length, s
    end: float  # when it ended (time.perf_counter)


def _route(queues: SendQueues | None, link: Link | None, queue: str) -> Route | None:
    """Where a channel's sends over ``link`` are charged (``None``: the receiver paces them,
    or nothing is paced)."""
    return None if queues is None or link is None else Route(queues, link, queue)


def _queues(links: StageLinks) -> SendQueues | None:
    """A stage's sender-side queues where its sends wait in them (one host; ``None``: each
    receiver paces its own link, or nothing is paced)."""
    return SendQueues(links.card_file) if links.sender_queued else None
