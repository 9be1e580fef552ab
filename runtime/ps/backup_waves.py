"""Synchronous SGD with backup workers at a parameter-server shard (``backups = b > 0``).

Wave ``c`` is applied as soon as ``N = VWs - b`` VWs pushed it completely (:mod:`planner.backup`),
their updates added in ``(vw, stage)`` order; any other push of ``c`` (late, or a part of a VW
that did not make the quorum) is ``DROPPED``: never applied, recorded once. With several shards
one decides which VWs each wave counts and the others follow (:mod:`runtime.ps.quorum`), so
every shard sums the same VWs.

:class:`BackupWaves` is the backup-workers half of :class:`runtime.ps.core.ShardCore` (its
base): it reads and updates the core's state, declared below, and asks the core to fold a
closed wave (``_apply``).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch

from planner.backup import Arrival
from profiler.errors import ConfigError
from runtime.persist.checkpoint import LedgerEntry
from runtime.ps.layout import ShardSpec
from runtime.ps.outcome import ClockEvent, ClockTrace, PushResult, Status
from runtime.ps.quorum import WaveQuorum

__all__ = ["BackupWaves"]

log = logging.getLogger(__name__)


class BackupWaves:
    """The backup-workers half of :class:`runtime.ps.core.ShardCore` (whose constructor sets
    this state)."""

    spec: ShardSpec
    max_ledger_waves: int | None
    _clock: int
    _seq: int
    _pending: dict[int, dict[tuple[int, int], tuple[torch.Tensor, int]]]
    _vw_index: dict[int, int]
    _vw_keys: list[list[tuple[int, int]]]
    _quorum: WaveQuorum | None
    dropped: list[LedgerEntry]  # every dropped push, once
    _dropped_tags: set[tuple[int, int, int]]
    _seen: list[int]  # the waves each VW pushed, counted or dropped (highest + 1)
    trace: ClockTrace

    def local_clocks(self) -> tuple[int, ...]:
        """Each VW's clock at this shard (:meth:`runtime.ps.core.ShardCore.local_clocks`)."""
        raise NotImplementedError

    def _apply(
        self,
        wave_updates: dict[tuple[int, int], tuple[torch.Tensor, int]],
        vws: set[int] | None = None,
    ) -> None:
        """Fold one wave into the weights (:meth:`runtime.ps.core.ShardCore._apply`)."""
        raise NotImplementedError

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
        self, quorum: WaveQuorum, vi: int, vw: int, stage: int, wave: int
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
        self._close_quorum(quorum, before)
        self.trace.append(
            ClockEvent(self._seq - 1, vw, stage, wave, self.local_clocks(), self._clock)
        )
        return PushResult(Status.OK, "", quorum.clock - before)

    def _close_quorum(self, quorum: WaveQuorum, before: int) -> None:
        """Apply the waves that closed since clock ``before``: their counted VWs' updates;
        the parts of any other VW are dropped."""
        for c in range(before, quorum.clock):
            counted = {self.spec.vws[i] for i in quorum.counted(c)}
            ups = self._pending.pop(c)
            for k in sorted(k for k in ups if k[0] not in counted):  # parts of late VWs
                self._drop(*k, c, seq=ups.pop(k)[1])
            self._apply(ups, counted)
        if self.max_ledger_waves is not None:
            quorum.forget(self._clock - self.max_ledger_waves)

    def decide(self, wave: int, counted: Sequence[int]) -> int:
        """Backup workers, a shard that follows: the decider counted VWs ``counted`` (VW
        ids) in ``wave``. Returns waves applied.

        Raises:
            ConfigError: no backup workers here, or this shard decides (a wiring bug).
        """
        quorum = self._quorum
        if quorum is None or quorum.decides:
            raise ConfigError(f"shard {self.spec.id}: a quorum decision it does not take")
        before = quorum.clock
        quorum.decide(wave, [self._vw_index[v] for v in counted])
        self._close_quorum(quorum, before)
        return quorum.clock - before

    @property
    def decides(self) -> bool:
        """Backup workers: whether this shard decides each wave's quorum."""
        return self._quorum is not None and self._quorum.decides

    def decisions(self) -> list[tuple[int, tuple[int, ...]]]:
        """Backup workers, the deciding shard: ``(wave, counted VW ids)`` of the waves closed
        since the last call, to tell the other shards (none otherwise)."""
        if self._quorum is None:
            return []
        return [(c, tuple(self.spec.vws[i] for i in vis)) for c, vis in self._quorum.take()]
