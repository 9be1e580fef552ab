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
- with ``backups = b > 0`` (synchronous SGD with backup workers, :mod:`planner.backup`,
  :class:`runtime.ps.backup_waves.BackupWaves`, a base of :class:`ShardCore`) wave
  ``c`` is applied as soon as ``N = VWs - b`` VWs pushed it completely, their updates added in
  ``(vw, stage)`` order; any other push of ``c`` (late, or a part of a VW that did not make
  the quorum) is ``DROPPED``: never applied, recorded once in :attr:`ShardCore.dropped`.
  With several shards one decides which VWs each wave counts and the others follow
  (:mod:`runtime.ps.quorum`), so every shard sums the same VWs.

Eviction (``--on-failure continue``, GaDei Sec. 4.3) and the restart of an evicted VW
(``--on-failure restart``) are :class:`runtime.ps.eviction.PeerEviction`, a base of
:class:`ShardCore`.

The global clock is the minimum of the VW clocks (:class:`planner.wsp.GlobalClock`). With
clients that admit minibatch ``p`` only when :func:`planner.wsp.required_global_clock` holds,
a push of wave ``c`` happens at global clock ``>= c - D``, so the clock distance never
exceeds ``D + 1``; every accepted push is recorded in :attr:`ShardCore.trace` (the newest
:data:`runtime.ps.outcome.TRACE_EVENTS` and the largest distance: memory stays flat).
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from planner.wsp import GlobalClock
from profiler.errors import ConfigError
from runtime.persist.checkpoint import LedgerEntry, ShardState
from runtime.ps.backup_waves import BackupWaves
from runtime.ps.eviction import PeerEviction
from runtime.ps.layout import ShardSpec
from runtime.ps.outcome import ClockEvent, ClockTrace, Eviction, PushResult, Status
from runtime.ps.quorum import WaveQuorum

if TYPE_CHECKING:
    from runtime.sync.rule import WaveFold

__all__ = ["ShardCore"]

log = logging.getLogger(__name__)


class ShardCore(PeerEviction, BackupWaves):
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
        decides: backup workers: this shard decides which VWs each wave counts (the only
            shard, or the lowest id); ``False``: it counts the VWs the decider tells it
            (:meth:`decide`, :mod:`runtime.ps.quorum`).
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
        decides: bool = True,
    ) -> None:
        self.spec = spec
        self.fold = fold
        self.max_ledger_waves = max_ledger_waves
        self.momentum = momentum = self._load(spec, weights, state, momentum)
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
        self.trace = ClockTrace()
        self.rejected: list[tuple[int, int, int, Status]] = []
        self._quorum = (
            WaveQuorum(len(self._vw_keys), backups, self._clock, decides) if backups > 0 else None
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

    def _load(
        self,
        spec: ShardSpec,
        weights: torch.Tensor | None,
        state: ShardState | None,
        momentum: float,
    ) -> float:
        """Set the clock, ledger, optimizer state and weights, from ``state`` when given, after
        checking them; returns the momentum to use (the state's when resuming)."""
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
        return momentum

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
        bad = self._check(vw, stage, wave, update)
        if bad is not None:
            return bad
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

    def _check(self, vw: int, stage: int, wave: int, update: torch.Tensor) -> PushResult | None:
        """The rejection (or backup workers: the drop) of a push that cannot be buffered;
        ``None`` for a valid one."""
        if (vw, stage) not in self._keys:
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
        if (vw, stage) in self._pending.get(wave, {}):
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
        return None

    def _reject(self, vw: int, stage: int, wave: int, status: Status, why: str) -> PushResult:
        self.rejected.append((vw, stage, wave, status))
        msg = f"shard {self.spec.id}: push (vw {vw}, stage {stage}, wave {wave}) rejected ({status.name}): {why}"
        log.warning(msg)
        return PushResult(status, msg)

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
