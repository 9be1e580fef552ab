"""One stage's side of Wave Synchronous Parallel (paper Sec. 5): push each wave, pull when needed.

A stage trains its partition locally with exact local staleness
(:class:`runtime.stage.weights.VersionedWeights`). :class:`WaveSync` hooks in after each update:

- at the end of wave ``c`` (update of minibatch ``(c+1)*Nm``) it pushes the wave's aggregated
  update, the change of its master weights since the wave started (with plain SGD, ``-lr`` times
  the sum of the wave's gradients), as one flat message per shard (:class:`PSClient`);
- the next minibatch that uses the weights after this update is ``(c+2)*Nm``
  (:func:`planner.wsp.local_version`), which needs the global clock
  ``required_global_clock((c+2)*Nm, Nm, D) = max(0, c + 1 - D)``. When the last pulled clock is
  below that, it pulls (blocking until every VW pushed enough waves) and sets its master
  weights to the *local copy*: the global weights plus its own pushed updates they do not hold
  yet (:meth:`PSClient.pull`'s default).

Earlier minibatches of the next wave use earlier versions, which already satisfy their (lower)
requirement, so no minibatch ever runs on weights missing a global update older than the WSP
bound. Pulls happen at the same point of every run, so with ``D = 0`` the result is meant to be
deterministic (the global clock cannot run ahead of a VW that has not pushed); emulated
multi-VW runs were seen to differ by up to 1.8e-3 in the weights (docs/wsp_runtime.md).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
from torch import Tensor, nn

from planner.wsp import folds_at_update, required_global_clock
from profiler.errors import HetPipeRuntimeError
from runtime.defaults import neighbour_wait_s, vw_wait_s
from runtime.persist.snapshot import (
    SnapshotSpec,
    write_part,
)
from runtime.persist.stage_part import ForwardState, stage_payload
from runtime.ps.client import PSClient
from runtime.ps.pull import PullHandle, PullResult
from runtime.results.metrics import StageResult
from runtime.stage.weights import VersionedWeights
from runtime.sync.rule import StageSync, StageView, SyncSpec
from runtime.sync.stop import LazyStop
from runtime.sync.tied_mirror import TiedMirror
from runtime.sync.wave_resume import resume_part

if TYPE_CHECKING:
    from runtime.sync.backup import WaveNumbers

__all__ = ["WaveSync"]

log = logging.getLogger(__name__)


class WaveSync(StageSync):
    """Pushes a stage's wave updates and pulls global weights as WSP requires.

    Args:
        client: the stage's parameter-server client (its parameter order = ``params``).
        params: the stage's master parameters, in the client's order.
        nm: minibatches per wave.
        D: clock-distance threshold.
        result: the stage's result accumulator (waiting time and clock trace go there).
        first_mb: minibatch numbers of this run start after this one (a resumed run starts at
            wave ``first_mb // nm``).
        optimizer: the stage's local optimizer (its state is checkpointed).
        snapshots: the run's snapshots (``None``: none): the stage writes its part (optimizer
            state, data position, RNG state) before pushing wave ``c`` when ``c + 1`` is a
            multiple of ``snapshots.every`` (the clocks the shards write at) and at the end.
        where: ``vw<k>-stage<s>``, the stage's part name.
        weights: the stage's weight versions: given, pulls overlap the tasks.
        names: the names of ``params`` in ``weights`` (default: all of ``weights.master``).
        mirror: the stage's tied parameters that another stage pushes and pulls for the VW.
        weights: given: pulls overlap the tasks until a forward needs them.
        stop: stage 0 under a time limit: where the VWs agree on the last wave
            (:class:`runtime.sync.stop.LazyStop`; ``None``: this VW stops alone).
        versions: the stage's weight versions (with ``snapshots``: their master and versions
            in flight go into its part, :mod:`runtime.persist.stage_part`).
        buffers: the stage module's buffers by local name (in its part too).
        numbers: backup workers: the VW's wave numbers when it jumps to the current clock,
            and the run's end (:class:`runtime.sync.backup.WaveNumbers`; ``None``: a wave's
            number is its data position, as WSP has it).
        in_order: the pipeline's last stage: each task forwards, backwards and updates one
            minibatch, in minibatch order, so with ``D = 0`` too a pull is folded by the
            forward that needs it (:meth:`before_update`).
    """

    def __init__(
        self,
        client: PSClient,
        params: Sequence[nn.Parameter],
        nm: int,
        D: int,
        result: StageResult,
        first_mb: int = 0,
        optimizer: torch.optim.Optimizer | None = None,
        snapshots: SnapshotSpec | None = None,
        where: str = "stage",
        weights: VersionedWeights | None = None,
        names: Sequence[str] | None = None,
        mirror: TiedMirror | None = None,
        stop: LazyStop | None = None,
        versions: VersionedWeights | None = None,
        buffers: dict[str, Tensor] | None = None,
        numbers: WaveNumbers | None = None,
        in_order: bool = False,
    ) -> None:
        self.client, self.params, self.nm, self.D = client, list(params), nm, D
        self.numbers = numbers
        # D = 0 folds a pull at a fixed point of the stage's task order: the first update
        # after its push, or, on a stage whose tasks run in minibatch order, the forward
        # that needs it (tied copies and backup workers keep the first)
        self._fold_late = not folds_at_update(D, in_order, mirror is not None, numbers is not None)
        self.result = result
        self.first_mb = first_mb
        self.optimizer = optimizer
        self.snapshots, self.where = snapshots, where
        self.pulled_clock = -1
        self.last_clock = 0  # waves pushed (global numbering): the final checkpoint's clock
        self._written = first_mb // nm  # the clock of the last part written (or resumed from)
        self._snapshot: list[Tensor] = []
        self.weights = weights  # given: pulls overlap the tasks until a forward needs them
        self._pending: tuple[PullHandle, int, int] | None = None  # (pull, needed clock, version)
        self._prepared: tuple[int, list[Tensor], int] | None = None  # (wave, delta, mb) to push
        self.names = None if names is None else list(names)
        self.mirror = mirror
        self._stop = stop
        self.versions = versions if versions is not None else weights
        self.buffers = buffers or {}
        self._wave_start: tuple[int, ForwardState] | None = None  # (its first minibatch, state)
        self._pulled: list[Tensor] = []  # a pull to fold (a resumed start of a late folder)
        self.rejoined = False  # a restarted VW: optimizer state from an earlier snapshot

    @classmethod
    def create(
        cls, spec: SyncSpec, view: StageView, numbers: WaveNumbers | None = None
    ) -> WaveSync:
        """The ``wsp`` rule's factory (:mod:`runtime.sync.rule`): the stage's shard client
        and hooks; a resumed run goes on at ``spec.first_wave``."""
        # a tied parameter's other holders follow its owner instead of talking to the shards
        mirror = (
            TiedMirror(view.tied, view.weights, neighbour_wait_s(spec.timeout_s))
            if view.tied
            else None
        )
        followed = mirror.followed if mirror is not None else set()
        local = {p: n for n, p in view.weights.master.items()}  # parameter -> stage name
        params = [(name, p) for name, p in view.params if local[p] not in followed]
        client = PSClient(
            view.vw,
            view.stage,
            [(name, tuple(p.shape)) for name, p in params],
            spec.shards,
            group=view.group,
            timeout_s=vw_wait_s(spec.timeout_s),  # a live shard may be busy (a lost VW's
            pull_timeout_s=vw_wait_s(spec.timeout_s),  # connections, a snapshot): not a hang
            paced=view.links,
            queues=view.queues,
        )
        sync = cls(
            client,
            [p for _, p in params],
            view.nm,
            spec.D,
            view.result,
            spec.first_wave * view.nm,
            view.weights.optimizer,
            spec.snapshots,
            view.where,
            view.weights if spec.overlap_pulls else None,
            [local[p] for _, p in params],
            mirror,
            LazyStop(view.init_method, view.nm, spec.D),
            view.weights,
            dict(view.buffers),
            numbers,
            view.last,
        )
        sync.rejoined = spec.rejoined
        return sync

    def agreed_total(self, admitted: int, time_up: bool) -> int | None:
        """Every VW runs the same waves: the first whose time is up proposes the last one
        (:func:`planner.wsp.stop_wave`) through a store, the others read it."""
        if self._stop is None:
            return super().agreed_total(admitted, time_up)
        return self._stop.total(admitted, time_up)

    def rule_total(self, total: int, admitted: int) -> int:
        """Backup workers: fewer minibatches for a VW that jumped (:class:`WaveNumbers`)."""
        if self.numbers is None:
            return total
        return self.numbers.minibatches(total, admitted)

    def _jumped(self, need: int, res: PullResult, out: Sequence[Tensor] | None) -> PullResult:
        """Backup workers, after the pull that follows the push of wave ``need - 1``: make
        it one clock's weights, agree on the wave the VW continues at; pull again if this
        stage's reply is older.

        Waves close without a late VW, and each shard applies a closed wave when it learns
        the decision, so a pull may find the shards at different clocks (shard 0 at 4, shard
        1 still at 3). Synchronous SGD computes on the weights of one step: the stage pulls
        again at the newest of them until every shard answers the same clock (one more pull,
        rarely two: a wave takes longer than a pull). The pull's recorded clock is that one."""
        if self.numbers is None:
            return res
        while len(set(res.clocks)) > 1:
            res = self.client.pull(max(res.clocks), out=out)
        self.result.clocks[-1] = (self.result.clocks[-1][0], res.clock)
        wave = self.numbers.agree(need - 1, res.clock)
        if res.clock < wave:
            res = self.client.pull(wave, out=out)
            self.result.clocks.append((wave, res.clock))
        return res

    def start(self, clock: int = 0) -> None:
        """Load the global weights at ``clock`` (the run's first wave) into the stage and, when
        resuming, its part of the snapshot at that clock: the master weights and versions in
        flight, into which the pull is folded as in the run that stopped, the optimizer, RNG
        and buffers (:mod:`runtime.persist.stage_part`). A restarted VW (:attr:`rejoined`)
        takes the global weights at ``clock`` and only the optimizer state of its newest part."""
        part = resume_part(self.snapshots, self.where, clock, self.nm, self.rejoined)
        fold = False
        exact = part is not None and part.master is not None and not self.rejoined
        if exact and part is not None and self.versions is not None:
            part.restore_weights(self.versions)
            fold = self.weights is not None  # the stopped run folded this pull in (overlapped)
        if fold:
            self._pull(clock, fold=True)
            self._mirror_announce(0)  # followers: the owner's correction for version 0 follows
            if self.D > 0 or not self._fold_late:  # a late folder folds it where the stopped
                self._fold(0, self._pulled)  # run did: at the forward that needs it
                self._pulled = []
            if self.mirror is not None:
                self.mirror.before_update()
        else:
            self._pull(clock)
            self._mirror_set()
        if self.rejoined:  # the soak benchmark times a VW restart up to this line
            log.warning("%s rejoined at clock %d", self.where, self.pulled_clock)
        if part is None:
            return
        if self.optimizer is not None:
            self.optimizer.load_state_dict(part.optimizer)
        if not self.rejoined:  # a restarted VW's data goes on at ``clock``, not at its part's
            part.forward.restore(self.buffers, f"{self.where} at clock {clock}")

    def _checkpoint(self, clock: int, final: bool = False) -> None:
        snaps = self.snapshots
        if snaps is None or snaps.every <= 0 or (clock % snaps.every and not final):
            return
        if clock <= self._written:
            return  # never rewrite a part a committed manifest may already vouch for
        if self.versions is None:
            raise HetPipeRuntimeError(f"{self.where}: a snapshot needs the stage's weights")
        start = self._wave_start  # the next wave's forwards may have begun: their RNG/buffers
        if start is not None and start[0] == clock * self.nm + 1:
            fwd = start[1]
        else:
            fwd = ForwardState.capture(self.buffers)
        write_part(snaps, clock, self.where, stage_payload(clock, self.nm, self.versions, fwd))
        self._written = clock

    def _log_wait(self, clock: int, waited: float) -> None:
        """Record a pull wait for the timeline (the wall clock, like the tasks)."""
        if waited > 1e-4:
            end = time.time()
            self.result.log_interval("wait", clock, end - waited, end)

    def _pull(self, min_clock: int, fold: bool = False, pushed: bool = False) -> None:
        """Pull clock ``min_clock`` into the master (``fold``: into ``_pulled``, for
        :meth:`_fold`; the snapshot is then the master as it is; ``pushed``: the pull after a
        push, where backup workers may jump)."""
        t0 = time.perf_counter()
        out = None if fold else self.params
        res = self.client.pull(min_clock, out=out)
        self.result.clocks.append((min_clock, res.clock))
        if pushed:
            res = self._jumped(min_clock, res, out)
        self._pulled = list(res.tensors) if fold else []
        waited = time.perf_counter() - t0
        self._log_wait(min_clock, waited)
        self.result.wait_s += waited
        self.result.busy_s -= waited  # the hook runs inside a timed task: waiting is not work
        self.pulled_clock = res.clock
        self._snapshot = [p.detach().clone() for p in self.params]
        log.debug("pulled clock %d (needed %d) in %.3f s", res.clock, min_clock, waited)

    def _mirror_set(self) -> None:
        """Tied copies: the owner's pull set its master, the followers copy it."""
        if self.mirror is not None:
            self.mirror.send_set()
            self.mirror.receive()

    def _mirror_announce(self, pending_version: int | None) -> None:
        if self.mirror is not None:
            self.mirror.announce(pending_version)
            self.mirror.receive()

    def after_update(self, mb: int) -> None:
        """Call after the update of minibatch ``mb`` (this run's numbering, 1-based): at a
        wave's end, its update into the push messages and the snapshot part (device work);
        :meth:`post_update` sends it."""
        if mb % self.nm:
            return
        total_mb = self.first_mb + mb
        wave = total_mb // self.nm - 1
        if self.numbers is not None:
            wave = self.numbers.number(mb // self.nm - 1)
            if not self.numbers.pushes(wave):  # past the run's end: finished, not pushed
                return
        # the wave's update, computed straight into the push messages (no packing copy)
        delta = self.client.update_buffers()
        with torch.no_grad():
            for d, p, s in zip(delta, self.params, self._snapshot, strict=True):
                if d.device == p.device:
                    torch.sub(p.detach(), s, out=d)
                else:  # a GPU stage: the message is in host memory
                    d.copy_(p.detach() - s)
        self._checkpoint(wave + 1)  # before the push: a wave the shards hold has its file
        self.last_clock = wave + 1
        self._prepared = (wave, delta, mb)

    def post_update(self, mb: int) -> None:
        """Push the wave :meth:`after_update` prepared (none: nothing), with the pull WSP
        needs next: on an emulated device once the update's paced window ended, as a GPU's
        push can only leave after its backward and optimizer step."""
        if self._prepared is None:
            return
        wave, delta, mb = self._prepared
        self._prepared = None
        need = required_global_clock((wave + 2) * self.nm, self.nm, self.D)
        t_push = time.time()
        self.result.pushes.append((wave, t_push))
        if need <= self.pulled_clock and self.numbers is None:  # backup: every stage of the
            self.client.push(wave, delta)  # VW pulls after every push, to agree on the jump
            self._mirror_announce(None)
        elif self.weights is None:
            self.client.push(wave, delta)
            self.result.log_interval("push", wave, t_push, time.time())
            self._pull(need, pushed=True)
            self._mirror_set()
            return
        else:  # the pull request rides in the push; wait only when a forward needs the weights
            self._pending = (self.client.push_pull(wave, delta, need), need, mb)
            self._mirror_announce(mb)
        self.result.log_interval("push", wave, t_push, time.time())  # for the timeline
        # the local copy moves on by this wave's update: the next delta starts here
        with torch.no_grad():
            for s, p in zip(self._snapshot, self.params, strict=True):
                s.copy_(p.detach())
        log.debug("pushed wave %d", wave)

    def before_forward(self, mb: int) -> None:
        """Call before the forward of minibatch ``mb``: it runs on version ``mb - Nm``; if that
        version needs a pull still in flight, wait for it and fold the pulled local copy into
        that version and every later one (the master included). The first forward of a wave
        records the RNG state and buffers a snapshot at that wave's clock holds."""
        wave, first = divmod(self.first_mb + mb - 1, self.nm)
        every = self.snapshots.every if self.snapshots is not None else 0
        if first == 0 and every > 0 and wave % every == 0:  # a snapshot clock's part needs it
            self._wave_start = (self.first_mb + mb, ForwardState.capture(self.buffers))
        if self.mirror is not None:
            self.mirror.before_forward(mb, self.nm)
        if self._pulled and mb - self.nm >= 0:  # a resumed start's pull, pushed at mb 0
            self._fold(0, self._pulled)
            self._pulled = []
        if self._pending is None or self.weights is None:
            return
        if mb - self.nm >= self._pending[2]:  # version mb - Nm holds the pushed update
            self._complete_pull()

    def before_update(self, mb: int) -> None:
        """Call before the update of minibatch ``mb``. With ``D = 0`` a pull in flight is
        folded in before the first local update after its push, so the fold always meets
        the same weights (no local update since the push): the floating-point result does not
        depend on whether the next forward or the next update came first (task order is
        FIFO by arrival). With ``D > 0``, and on the last stage, whose tasks run in minibatch
        order (its fold meets the same weights every run), the fold waits for the forward
        that needs it: the last stage goes on with the wave's first ``Nm - 1`` minibatches
        while the slower VWs finish, as the simulator has it."""
        if self.mirror is not None and self.D == 0:
            self.mirror.before_update()
        if self.update_may_wait(mb):
            self._complete_pull()

    def update_may_wait(self, mb: int) -> bool:
        """Whether :meth:`before_update` of ``mb`` folds a pull in flight (it may wait)."""
        return self._pending is not None and not self._fold_late

    def _complete_pull(self) -> None:
        if self._pending is None:
            return
        handle, need, version = self._pending
        t0 = time.perf_counter()
        res = handle.wait()
        self.result.clocks.append((need, res.clock))
        res = self._jumped(need, res, None)
        waited = time.perf_counter() - t0
        self._log_wait(need, waited)
        self.result.wait_s += waited
        self.result.busy_s -= waited
        self.pulled_clock, self._pending = res.clock, None
        self._fold(version, list(res.tensors))
        log.debug("pulled clock %d (needed %d), waited %.3f s", res.clock, need, waited)

    def _fold(self, version: int, pulled: list[Tensor]) -> None:
        """Replace the wave-end weights by the pulled local copy in ``version`` and later ones:
        add ``pulled - snapshot`` to each distinct storage (each once)."""
        if self.weights is None:
            return
        with torch.no_grad():
            # the pull is in host memory; a GPU stage's snapshot is not
            correction = [g.to(s.device) - s for g, s in zip(pulled, self._snapshot, strict=True)]
            self._snapshot = [s + c for s, c in zip(self._snapshot, correction, strict=True)]
        names = self.names if self.names is not None else list(self.weights.master)
        named = dict(zip(names, correction, strict=True))
        self.weights.add_from(version, named)
        if self.mirror is not None:
            self.mirror.send_add(named)

    def close(self) -> None:
        """Flush the pushes, write the final optimizer state (when checkpointing) and say
        goodbye to the shards."""
        t0 = time.perf_counter()
        if self.last_clock > 0:
            self._checkpoint(self.last_clock, final=True)
        if self._pending is not None:  # the last wave's pull: no forward needs it any more,
            handle, need, _ = self._pending  # but its clock is part of the trace
            self.result.clocks.append((need, handle.wait().clock))
            self._pending = None
        self.client.close()
        self.result.dropped = list(self.client.dropped)
        if self.mirror is not None:
            self.mirror.close()
        self.result.wait_s += time.perf_counter() - t0
