"""The pure WSP state machine of one parameter-server shard (no processes, no I/O).

:class:`ShardCore` keeps the shard's flat global weights, every VW's clock at the shard, the
exactly-once ledger and the buffered pushes of incomplete waves; :mod:`runtime.ps.server` runs it in
the shard process. The rules (see ``docs/parameter_server.md``):

- a push carries the tag ``(vw, stage, wave)``; a tag already received is rejected as
  ``DUPLICATE``, a later wave arriving before an earlier one of the same client is buffered,
  and ``wave > global_clock + D`` is rejected as ``TOO_FAR_AHEAD`` (a WSP violation);
- wave ``c`` is applied once every client of every VW pushed it: updates are added in
  ``(vw, stage)`` order, so the floating-point result does not depend on arrival order, or
  their sum goes through server-side momentum; the global clock becomes ``c + 1``;
- a pull ``(min_clock)`` can be answered once the global clock is ``>= min_clock``;
- with ``backups = b > 0`` (synchronous SGD with backup workers, :mod:`planner.backup`) wave
  ``c`` is applied as soon as ``N = VWs - b`` VWs pushed it completely, their updates added in
  ``(vw, stage)`` order; any other push of ``c`` (late, or a part of a VW that did not make
  the quorum) is ``DROPPED``: never applied, recorded once in :attr:`ShardCore.dropped`.

Eviction (``--on-failure continue``, GaDei Sec. 4.3): with ``peers`` (the other shards' ids),
a wave is applied only once every member VW's push of it is complete at *every* shard (each
shard reports its VW clocks to the others, :meth:`ShardCore.peer_report`), so no shard ever
folds a wave that another shard may lack. A VW whose client died is :meth:`ShardCore.lose`-t;
once no more of its pushes can arrive here (:meth:`ShardCore.end_pushes`) and every shard has
said so, every shard computes the same cut ``min over shards of its VW clock``: its waves
below the cut are in everywhere, the buffered ones at or above it are discarded once, and the
global clock stops waiting for it (:class:`Eviction`).

Restart of the lost VW (``--on-failure restart``, ``rejoin=True``): the cut and the discarded
pushes are the same, but the VW stays a member: its clock goes back to the cut at every shard
and a new *incarnation* (the restarted processes) pushes the waves from the cut on, so the
global clock waits for it there (:meth:`ShardCore.incarnation`). Reports carry each VW's
incarnation and a shard ignores a peer's clock of another incarnation. When no restart comes
(the budget is spent), :meth:`ShardCore.release` evicts it at that cut, as ``continue`` does.

The global clock is the minimum of the VW clocks (:class:`planner.wsp.GlobalClock`). With
clients that admit minibatch ``p`` only when :func:`planner.wsp.required_global_clock` holds,
a push of wave ``c`` happens at global clock ``>= c - D``, so the clock distance never
exceeds ``D + 1``; every accepted push is recorded in :attr:`ShardCore.trace`.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from enum import IntEnum
from typing import TYPE_CHECKING

import torch

from planner.backup import Arrival, QuorumClock
from planner.wsp import GlobalClock
from profiler.errors import ConfigError
from runtime.persist.checkpoint import LedgerEntry, ShardState
from runtime.ps.layout import ShardSpec

if TYPE_CHECKING:
    from runtime.sync.rule import WaveFold

__all__ = ["ClockEvent", "Eviction", "PushResult", "ShardCore", "Status"]

log = logging.getLogger(__name__)


class Status(IntEnum):
    """Outcome of a push or pull."""

    OK = 0
    DUPLICATE = 1  # this (vw, stage, wave) was already received: not applied again
    TOO_FAR_AHEAD = 2  # wave > global clock + D: the client broke the WSP admission rule
    BAD_WAVE = 3  # negative wave, or a wave already folded into the global weights
    BAD_SIZE = 4  # payload length does not match the client's slice
    DROPPED = 5  # backup workers: the wave closed without this VW; recorded, never applied


@dataclass(frozen=True)
class ClockEvent:
    """Clock state right after an accepted push (the trace the WSP bound is checked on).

    Attributes:
        seq: arrival order of the push.
        vw, stage, wave: the push.
        local: every VW's clock at this shard (waves fully pushed), in VW id order.
        global_clock: the shard's global clock (min of ``local``) after applying ready waves.
    """

    seq: int
    vw: int
    stage: int
    wave: int
    local: tuple[int, ...]
    global_clock: int

    @property
    def distance(self) -> int:
        """Clock distance: fastest VW clock minus the global (slowest) clock."""
        return max(self.local) - self.global_clock


@dataclass(frozen=True)
class Eviction:
    """A VW left out of the global clock: its waves ``< wave`` are applied at every shard,
    none at or above; ``discarded`` of its buffered pushes were dropped at this shard."""

    vw: int
    wave: int
    discarded: int


@dataclass(frozen=True)
class PushResult:
    """What :meth:`ShardCore.push` did: ``status``, a message when rejected, waves applied."""

    status: Status
    message: str = ""
    applied: int = 0


class ShardCore:
    """The shard's WSP state machine (pure: no processes, no I/O).

    Args:
        spec: the shard's static layout and clients.
        weights: initial flat weights (``spec.numel`` elements); copied.
        state: resume from this state instead (its clock, weights, ledger, optimizer state).
        momentum: server-side momentum ``mu``: ``m = mu*m + u; w += m`` per wave (0 disables).
        max_ledger_waves: keep ledger entries of the newest this many applied waves only
            (``None``: all). Older entries carry no information the clock does not: every
            client's every wave below the clock was applied exactly once (a wave is applied
            only as a whole, once, and tags below the clock are rejected), so a week-long run
            need not grow its ledger and checkpoints without bound.
        fold: the synchronisation rule's way to fold a complete wave's summed update into
            the weights (:class:`runtime.sync.rule.WaveFold`); ``None``: add it (or through
            ``momentum``), client by client.
        backups: backup VWs ``b`` (0: every VW's push is waited for, plain WSP).
        peers: the other shards' ids whose VW clocks gate applying a wave (eviction mode,
            ``--on-failure continue``); empty: a wave complete here is applied at once.
        rejoin: with ``peers``: a lost VW is not left out but waits, from its cut, for its
            restarted incarnation (``--on-failure restart``; :meth:`release` gives up on it).
    """

    def __init__(
        self,
        spec: ShardSpec,
        weights: torch.Tensor | None = None,
        state: ShardState | None = None,
        momentum: float = 0.0,
        max_ledger_waves: int | None = None,
        fold: WaveFold | None = None,
        backups: int = 0,
        peers: Sequence[int] = (),
        rejoin: bool = False,
    ) -> None:
        self.spec = spec
        self.fold = fold
        self.max_ledger_waves = max_ledger_waves
        if state is not None:
            if state.shard_id != spec.id:
                raise ConfigError(
                    f"checkpoint is for shard {state.shard_id}, not shard {spec.id}; pass the right file"
                )
            weights, self._clock, self._ledger = state.weights, state.clock, deque(state.ledger)
            momentum, self._opt = state.momentum, {k: v.clone() for k, v in state.optimizer.items()}
        else:
            self._clock, self._ledger, self._opt = 0, deque(), {}
        if weights is None or weights.dim() != 1 or weights.numel() != spec.numel:
            got = None if weights is None else tuple(weights.shape)
            raise ConfigError(
                f"shard {spec.id}: initial weights must be flat with {spec.numel} elements, got shape {got}"
            )
        if weights.dtype != torch.float32:
            raise ConfigError(
                f"shard {spec.id}: weights must be float32 (the wire format), got {weights.dtype}"
            )
        self._w = weights.detach().clone()
        self.momentum = momentum
        if momentum and "momentum" not in self._opt:
            self._opt["momentum"] = torch.zeros_like(self._w)
        self._keys = [(c.vw, c.stage) for c in spec.clients]
        self._vw_index = {vw: i for i, vw in enumerate(spec.vws)}
        self._vw_keys = [[k for k in self._keys if k[0] == vw] for vw in spec.vws]
        self._gclock = GlobalClock(
            max(1, len(spec.vws))
        )  # the shared WSP rule: global = min of VW clocks
        for _ in range(self._clock):
            for i in range(len(spec.vws)):
                self._gclock.push(i, self._gclock.local(i))
        self._pending: dict[int, dict[tuple[int, int], tuple[torch.Tensor, int]]] = {}
        self._seq = max((e.seq for e in self._ledger), default=-1) + 1
        self.trace: list[ClockEvent] = []
        self.rejected: list[tuple[int, int, int, Status]] = []
        self._quorum = (
            QuorumClock(len(self._vw_keys), backups, self._clock) if backups > 0 else None
        )
        self.dropped: list[LedgerEntry] = []  # backup workers: every dropped push, once
        self._dropped_tags: set[tuple[int, int, int]] = set()
        self._seen = [self._clock] * len(self._vw_keys)
        n = len(spec.vws)  # eviction mode: what the other shards reported, VW id order
        self._peer_clocks = {p: [self._clock] * n for p in peers}
        self._peer_final = {p: [False] * n for p in peers}
        self._lost: set[int] = set()  # VW indices with a dead client
        self._ended: set[tuple[int, int]] = set()  # clients whose pushes can no longer arrive
        self._cut: dict[int, int] = {}  # evicted VW index -> first wave left out
        self.evictions: list[Eviction] = []
        self._rejoin = rejoin
        self._inc = [0] * n  # restart mode: each VW's incarnation (+1 at every restart)
        self._reopened: dict[int, int] = {}  # VW index -> the wave its incarnation starts at

    @property
    def clock(self) -> int:
        """Global clock: the weights include waves ``0..clock-1`` of every VW."""
        return self._clock

    @property
    def ledger(self) -> tuple[LedgerEntry, ...]:
        """Applied updates, in application order."""
        return tuple(self._ledger)

    def local_clocks(self) -> tuple[int, ...]:
        """Each VW's clock at this shard (consecutive waves pushed by all its clients), VW id order.

        With backup workers: the waves each VW pushed, counted or dropped (highest + 1)."""
        if self._quorum is not None:
            return tuple(self._seen)
        return tuple(self._gclock.local(i) for i in range(len(self.spec.vws)))

    def push(
        self, vw: int, stage: int, wave: int, update: torch.Tensor, copy: bool = True
    ) -> PushResult:
        """Receive client ``(vw, stage)``'s aggregated update of ``wave`` (flat, in its slice order).

        ``copy=False`` keeps a reference to ``update`` instead of a copy (the server passes
        its freshly received buffers).

        Applies every wave that became complete. Never raises on a bad push: it returns the
        rejection (and records it in :attr:`rejected`) so the server can tell the client.
        """
        key = (vw, stage)
        if key not in self._keys:
            return self._reject(
                vw,
                stage,
                wave,
                Status.BAD_WAVE,
                f"shard {self.spec.id} has no client vw {vw} stage {stage}",
            )
        if 0 <= wave < self._clock and self._late(vw, stage, wave):
            return self._drop(vw, stage, wave)
        if wave < 0 or wave < self._clock:
            # every client's every wave below the clock was applied: a non-negative one is a duplicate
            status = Status.DUPLICATE if wave >= 0 else Status.BAD_WAVE
            return self._reject(
                vw,
                stage,
                wave,
                status,
                f"wave {wave} is already folded into the global weights (clock {self._clock})",
            )
        if key in self._pending.get(wave, {}):
            return self._reject(vw, stage, wave, Status.DUPLICATE, "this tag was already received")
        if self.spec.D is not None and wave > self._clock + self.spec.D:
            return self._reject(
                vw,
                stage,
                wave,
                Status.TOO_FAR_AHEAD,
                f"wave {wave} is more than D={self.spec.D} waves ahead of the global clock {self._clock} "
                "(the client did not wait for planner.wsp.required_global_clock)",
            )
        numel = self.spec.client_numel(self.spec.client(vw, stage))
        if update.dim() != 1 or update.numel() != numel or update.dtype != self._w.dtype:
            return self._reject(
                vw,
                stage,
                wave,
                Status.BAD_SIZE,
                f"update is {update.dtype} of shape {tuple(update.shape)}, expected float32 ({numel},)",
            )
        self._pending.setdefault(wave, {})[key] = (
            update.detach().clone() if copy else update.detach(),
            self._seq,
        )
        self._seq += 1
        vi = self._vw_index[vw]
        if self._quorum is not None:
            return self._push_quorum(self._quorum, vi, vw, stage, wave)
        while all(k in self._pending.get(self._gclock.local(vi), {}) for k in self._vw_keys[vi]):
            self._gclock.push(vi, self._gclock.local(vi))
        applied = self._advance()
        self.trace.append(
            ClockEvent(self._seq - 1, vw, stage, wave, self.local_clocks(), self._clock)
        )
        return PushResult(Status.OK, "", applied)

    def _late(self, vw: int, stage: int, wave: int) -> bool:
        """Backup workers: whether a push of closed ``wave`` is a late one (not a duplicate)."""
        if self._quorum is None or (vw, stage, wave) in self._dropped_tags:
            return False
        try:
            counted = self._quorum.counted(wave)
        except KeyError:  # forgotten (older than max_ledger_waves): cannot tell, refuse it
            return False
        return self._vw_index[vw] not in counted

    def _drop(self, vw: int, stage: int, wave: int, seq: int | None = None) -> PushResult:
        """Record a push of a wave that closed without its VW; it never reaches the weights."""
        if seq is None:
            seq, self._seq = self._seq, self._seq + 1
        self._dropped_tags.add((vw, stage, wave))
        vi = self._vw_index[vw]
        self._seen[vi] = max(self._seen[vi], wave + 1)
        self.dropped.append(LedgerEntry(vw, stage, wave, seq))
        log.debug(
            "shard %d: push (vw %d, stage %d, wave %d) dropped", self.spec.id, vw, stage, wave
        )
        return PushResult(Status.DROPPED, f"wave {wave} closed without vw {vw}")

    def _push_quorum(
        self, quorum: QuorumClock, vi: int, vw: int, stage: int, wave: int
    ) -> PushResult:
        """Backup workers: count ``vw`` once all its clients pushed ``wave``; close waves."""
        pend = self._pending[wave]
        before = quorum.clock
        self._seen[vi] = max(self._seen[vi], wave + 1)
        complete = all(k in pend for k in self._vw_keys[vi])
        if complete and quorum.arrive(vi, wave) is Arrival.DROPPED:  # the wave is full
            for k in self._vw_keys[vi]:
                self._drop(*k, wave, seq=pend.pop(k)[1])
            return PushResult(Status.DROPPED, f"wave {wave} already has its quorum")
        for c in range(before, quorum.clock):
            counted = {self.spec.vws[i] for i in quorum.counted(c)}
            ups = self._pending.pop(c)
            for k in sorted(k for k in ups if k[0] not in counted):  # parts of late VWs
                self._drop(*k, c, seq=ups.pop(k)[1])
            self._apply(ups, counted)
        if self.max_ledger_waves is not None:
            quorum.forget(self._clock - self.max_ledger_waves)
        self.trace.append(
            ClockEvent(self._seq - 1, vw, stage, wave, self.local_clocks(), self._clock)
        )
        return PushResult(Status.OK, "", quorum.clock - before)

    def _reject(self, vw: int, stage: int, wave: int, status: Status, why: str) -> PushResult:
        self.rejected.append((vw, stage, wave, status))
        msg = f"shard {self.spec.id}: push (vw {vw}, stage {stage}, wave {wave}) rejected ({status.name}): {why}"
        log.warning(msg)
        return PushResult(status, msg)

    def _committed(self, vi: int) -> int:
        """Waves of VW index ``vi`` complete at every shard (here and as the peers reported)."""
        return min([self._gclock.local(vi), *(c[vi] for c in self._peer_clocks.values())])

    def _advance(self) -> int:
        """Apply every wave whose member VWs' pushes are complete at every shard."""
        applied = 0
        while True:
            members = [
                vi for vi in range(len(self.spec.vws)) if self._cut.get(vi, 2**62) > self._clock
            ]
            if not members or any(self._committed(vi) <= self._clock for vi in members):
                return applied
            self._apply(self._pending.pop(self._clock, {}), {self.spec.vws[vi] for vi in members})
            applied += 1

    def lose(self, vw: int) -> int:
        """VW ``vw`` lost a client (a process died): evict it once no more of its pushes can
        arrive anywhere (:meth:`end_pushes`, :meth:`peer_report`). Returns waves applied."""
        if vw in self._vw_index:
            self._lost.add(self._vw_index[vw])
        return self._settle()

    def end_pushes(self, vw: int, stage: int) -> int:
        """Client ``(vw, stage)`` sends no more pushes (its stream ended). Returns waves applied."""
        self._ended.add((vw, stage))
        return self._settle()

    def report(self) -> tuple[tuple[int, ...], tuple[bool, ...], tuple[int, ...]]:
        """What this shard tells its peers: each VW's clock here, whether it is final (the
        VW is lost and none of its pushes can arrive here any more) and its incarnation, VW
        id order."""
        final = tuple(
            vi in self._lost and all(k in self._ended for k in self._vw_keys[vi])
            for vi in range(len(self.spec.vws))
        )
        return self.local_clocks(), final, tuple(self._inc)

    def peer_report(
        self,
        shard: int,
        clocks: Sequence[int],
        final: Sequence[bool],
        incs: Sequence[int] | None = None,
    ) -> int:
        """Shard ``shard``'s :meth:`report` arrived. Returns waves applied. A VW's entries of
        an older incarnation than this shard's are ignored (``incs`` ``None``: the same); a
        newer one means the peer reopened it, which it does only once the VW was final at
        every shard: it counts as the peer's final flag (the one it may not have sent, as it
        became final and reopened at once).

        Raises:
            ConfigError: not a peer, or a report of another VW count (a wiring bug).
        """
        n = len(self.spec.vws)
        incs = self._inc if incs is None else incs
        if shard not in self._peer_clocks or not len(clocks) == len(final) == len(incs) == n:
            raise ConfigError(
                f"shard {self.spec.id}: report of shard {shard} with {len(clocks)} VW clocks; "
                f"expected a peer in {sorted(self._peer_clocks)} with {n}"
            )
        for vi in range(n):
            if int(incs[vi]) > self._inc[vi]:  # it reopened the VW: it had every shard's final
                self._peer_final[shard][vi] = True  # flag, its own too (sent or not)
                continue
            if int(incs[vi]) < self._inc[vi]:
                continue  # an older incarnation's: stale
            self._peer_clocks[shard][vi] = max(self._peer_clocks[shard][vi], int(clocks[vi]))
            self._peer_final[shard][vi] = self._peer_final[shard][vi] or bool(final[vi])
        return self._settle()

    def incarnation(self, vw: int) -> int:
        """VW ``vw``'s incarnation: 0, +1 at every restart (``rejoin``)."""
        return self._inc[self._vw_index[vw]]

    def rejoin_wave(self, vw: int) -> int | None:
        """The wave VW ``vw``'s current incarnation starts at (``None``: never restarted)."""
        return self._reopened.get(self._vw_index[vw])

    def release(self, vw: int) -> int:
        """No restart of VW ``vw`` will come (the budget is spent): evict it at the wave its
        waiting incarnation was to start at, the same at every shard (that incarnation never
        pushed). Returns waves applied."""
        vi = self._vw_index[vw]
        if vi in self._reopened and vi not in self._cut:
            self._cut[vi] = self._reopened[vi]
            log.warning("shard %d: vw %d not restarted: evicted at wave %d",
                        self.spec.id, vw, self._cut[vi])  # fmt: skip
        return self._advance()

    def _settle(self) -> int:
        """Evict every lost VW that is final at every shard (the same cut everywhere), then
        apply what became ready."""
        final_here = self.report()[1]
        for vi in sorted(self._lost - self._cut.keys()):
            if final_here[vi] and all(f[vi] for f in self._peer_final.values()):
                cut, dropped = self._committed(vi), 0
                for w in [w for w in self._pending if w >= cut]:
                    for k in self._vw_keys[vi]:
                        dropped += self._pending[w].pop(k, None) is not None
                self.evictions.append(Eviction(self.spec.vws[vi], cut, dropped))
                log.warning("shard %d: vw %d evicted at wave %d (%d buffered pushes discarded)",
                            self.spec.id, self.spec.vws[vi], cut, dropped)  # fmt: skip
                if self._rejoin:
                    self._reopen(vi, cut)
                else:
                    self._cut[vi] = cut
        return self._advance()

    def _reopen(self, vi: int, cut: int) -> None:
        """Restart mode: VW index ``vi`` stays a member; its next incarnation starts at
        ``cut`` (its clock goes back there here and in what the peers reported)."""
        self._inc[vi] += 1
        self._lost.discard(vi)
        self._ended.difference_update(self._vw_keys[vi])
        self._gclock.rewind(vi, cut)
        for p in self._peer_clocks:
            self._peer_clocks[p][vi], self._peer_final[p][vi] = cut, False
        self._reopened[vi] = cut

    @property
    def waiting_on_eviction(self) -> bool:
        """A VW is lost but not evicted yet (the shard must keep serving until it is)."""
        return bool(self._lost - self._cut.keys())

    @property
    def left_out(self) -> dict[int, int]:
        """VWs evicted for good (``continue``, or a restart that did not come): VW -> its cut."""
        return {self.spec.vws[vi]: cut for vi, cut in self._cut.items()}

    @property
    def unsettled(self) -> bool:
        """A lost VW is not evicted yet, or pushes wait for a wave to be applied."""
        return self.waiting_on_eviction or any(self._pending.values())

    def _apply(
        self,
        wave_updates: dict[tuple[int, int], tuple[torch.Tensor, int]],
        vws: set[int] | None = None,
    ) -> None:
        """Fold one complete wave into the weights: clients in (vw, stage) order, so the
        floating-point result does not depend on arrival order (only ``vws``' when given)."""
        target = self._w
        if self.momentum or self.fold is not None:
            target = torch.zeros_like(self._w)  # the wave's summed update, then m = mu*m + sum
        for c in self.spec.clients:
            if vws is not None and c.vw not in vws:
                continue
            upd, seq = wave_updates[(c.vw, c.stage)]
            pos = 0
            for off, n in self.spec.segments(c):
                target[off : off + n] += upd[pos : pos + n]
                pos += n
            self._ledger.append(LedgerEntry(c.vw, c.stage, self._clock, seq))
        if self.fold is not None:
            self.fold.fold(self._w, target, self._opt)
        elif self.momentum:
            buf = self._opt["momentum"]
            buf.mul_(self.momentum).add_(target)
            self._w.add_(buf)
        self._clock += 1
        if self.max_ledger_waves is not None:
            while self._ledger and self._ledger[0].wave < self._clock - self.max_ledger_waves:
                self._ledger.popleft()

    def can_pull(self, min_clock: int) -> bool:
        """Whether a pull asking for global clock ``>= min_clock`` can be answered now."""
        return self._clock >= min_clock

    def read(self, vw: int, stage: int, copy: bool = True) -> torch.Tensor:
        """Client ``(vw, stage)``'s slice of the global weights (flat, in its message order).

        ``copy=False`` returns a view when the slice is contiguous in the shard (always the
        case for a stage holding a contiguous range of layers); it changes with the next
        applied wave, so the caller must be done with it before the next :meth:`push`.
        """
        segs = self.spec.segments(self.spec.client(vw, stage))
        if not copy and len(segs) == 1:
            off, n = segs[0]
            return self._w[off : off + n]
        out = torch.empty(sum(n for _, n in segs), dtype=self._w.dtype)
        pos = 0
        for off, n in segs:  # copy_ into one buffer: faster than torch.cat on large slices
            out[pos : pos + n].copy_(self._w[off : off + n])
            pos += n
        return out

    def weights(self) -> torch.Tensor:
        """A copy of the flat global weights."""
        return self._w.clone()

    def state(self) -> ShardState:
        """A snapshot for checkpointing (pending pushes of incomplete waves are not included:
        on resume every VW restarts at wave ``clock`` and pushes them again)."""
        return ShardState(
            self.spec.id,
            self._clock,
            self._w.clone(),
            tuple(self._ledger),
            {k: v.clone() for k, v in self._opt.items()},
            self.momentum,
            tuple((e.vw, e.wave, e.discarded) for e in self.evictions),
        )
