"""Backup workers at the shards: every shard counts the same VWs in every wave.

Each shard sees the VWs' pushes in its own order, so if each picked its own first ``N`` the
global model could mix different VWs' updates across shards (shard 0 with VWs {0, 1}, shard 1
with {0, 2}). Instead one shard decides (the lowest id, :func:`decider`): it runs
:class:`planner.backup.QuorumClock` on the complete VW pushes it sees and tells every other
shard each wave's *decision*, the VWs it counted (:attr:`WaveQuorum.outbox`, sent on
:data:`runtime.ps.peers.TAG_QUORUM`). Another shard counts exactly those VWs: its wave ``c``
closes once the decision of ``c`` arrived and every counted VW's push of ``c`` is complete
there; any other push of ``c`` is dropped there too. So the global model is always the sum of
the same ``N`` VWs' pushes (added in ``(vw, stage)`` order), whichever shard holds a parameter.

A counted VW's pushes always reach every shard (each of its stages pushes each wave to all of
its shards), so a shard that waits for them never waits forever; it lags the decider by one
message at most. With one shard, that shard decides alone, as before.

>>> q = WaveQuorum(n_vws=3, backups=1, clock=0, decides=False)   # a shard that follows
>>> q.arrive(2, 0), q.arrive(1, 0), q.clock   # VWs 1, 2 complete here: no decision yet
(<Arrival.COUNTED: 0>, <Arrival.COUNTED: 0>, 0)
>>> q.decide(0, (0, 2)), q.clock      # the decider counted VWs 0 and 2: VW 0 still missing
(0, 0)
>>> q.arrive(0, 0), q.counted(0)
(<Arrival.CLOSED: 1>, (0, 2))
"""

from __future__ import annotations

from collections.abc import Sequence

from planner.backup import Arrival, QuorumClock, quorum
from runtime.ps.layout import ShardSpec

__all__ = ["WaveQuorum", "decider", "quorum_peers"]


def decider(shard_ids: Sequence[int]) -> int:
    """The shard that decides every wave's quorum: the lowest id."""
    return min(shard_ids)


def quorum_peers(me: int, shards: Sequence[ShardSpec]) -> tuple[bool, dict[int, int]]:
    """Shard ``me``'s role: whether it decides, and the shards it talks to (id -> rank): the
    decider tells every other shard, each other shard listens to the decider only."""
    lead = decider([s.id for s in shards])
    others = {s.id: s.rank for s in shards if s.id != me and (me == lead or s.id == lead)}
    return me == lead, others


class WaveQuorum:
    """Which VWs (by index) each wave of one shard counts; the shard's global clock.

    Args:
        n_vws: VWs.
        backups: ``b`` (the quorum is ``n_vws - b``).
        clock: waves already closed (a resumed run).
        decides: this shard decides (it keeps a :class:`QuorumClock`); else it follows the
            decisions given to :meth:`decide`.
    """

    def __init__(self, n_vws: int, backups: int, clock: int, decides: bool) -> None:
        quorum(n_vws, backups)  # checks b
        self.n_vws = n_vws
        self._q = QuorumClock(n_vws, backups, clock) if decides else None
        self._clock = clock
        self._decided: dict[int, tuple[int, ...]] = {}  # wave -> counted VW indices
        self._complete: dict[int, set[int]] = {}  # wave -> VWs complete here (follower)
        self.outbox: list[tuple[int, tuple[int, ...]]] = []  # decisions to tell the others

    @property
    def decides(self) -> bool:
        """Whether this shard decides the quorum."""
        return self._q is not None

    @property
    def clock(self) -> int:
        """Waves closed here."""
        return self._q.clock if self._q is not None else self._clock

    def counted(self, wave: int) -> tuple[int, ...]:
        """The VWs closed ``wave`` counts, in id order.

        Raises:
            KeyError: the wave is not closed here (or was forgotten).
        """
        if self._q is not None:
            return self._q.counted(wave)
        if wave >= self._clock:
            raise KeyError(wave)
        return self._decided[wave]

    def arrive(self, vi: int, wave: int) -> Arrival:
        """VW ``vi``'s push of ``wave`` is complete at this shard."""
        if self._q is not None:
            before = self._q.clock
            got = self._q.arrive(vi, wave)
            self.outbox += [(c, self._q.counted(c)) for c in range(before, self._q.clock)]
            return got
        if wave in self._decided and vi not in self._decided[wave]:
            return Arrival.DROPPED
        self._complete.setdefault(wave, set()).add(vi)
        return Arrival.CLOSED if self._close() else Arrival.COUNTED

    def decide(self, wave: int, counted: Sequence[int]) -> int:
        """The decider's decision for ``wave`` (a following shard). Returns waves closed.

        Raises:
            ValueError: on the deciding shard, or a decision of another size than the quorum
                or for a wave decided already (a wiring bug).
        """
        if self._q is not None or wave in self._decided or wave < self._clock:
            raise ValueError(f"wave {wave}: a second quorum decision, or one sent to the decider")
        self._decided[wave] = tuple(sorted(counted))
        return self._close()

    def _close(self) -> int:
        before = self._clock
        while self._clock in self._decided and set(self._decided[self._clock]) <= (
            self._complete.get(self._clock, set())
        ):
            self._complete.pop(self._clock, None)
            self._clock += 1
        return self._clock - before

    def take(self) -> list[tuple[int, tuple[int, ...]]]:
        """The decisions made since the last call (the decider tells the other shards)."""
        out, self.outbox = self.outbox, []
        return out

    def forget(self, below: int) -> None:
        """Drop the records of waves below ``below``."""
        if self._q is not None:
            self._q.forget(below)
        self._decided = {c: v for c, v in self._decided.items() if c >= below}
