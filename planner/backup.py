"""Synchronous SGD with backup workers over virtual workers (Chen et al., seed 003, Alg. 3-4).

One source of truth for the simulator (:mod:`planner.sim.waves`) and the parameter-server shard
(:class:`runtime.ps.core.ShardCore`). With ``n`` VWs and ``b`` backups:

- wave ``c`` *closes* as soon as ``N = n - b`` VWs have pushed it (:func:`quorum`); its update
  is the sum of those ``N`` VWs' updates, added in VW id order (so the floating-point result
  depends only on *who* was first, never on the order they came in);
- a push of a wave that is already closed is *dropped*: it never reaches the weights, and the
  shard records it once (a second copy of the same tag is a duplicate, not a second drop);
- waves close in order, D = 0 semantics otherwise: a VW needs wave ``c`` closed before it may
  finish wave ``c + 1``;
- a late VW *continues at the current clock* (the seed's worker reads ``theta(t)`` at the
  current ``t``): after pushing wave ``c`` it pulls the global weights, whose clock ``G`` may
  be past ``c + 1`` when waves closed without it, and its next wave is numbered
  :func:`continue_at` ``(c, G) = max(c + 1, G)``. Its *data* position goes on where it was
  (no sample is skipped or repeated): waves ``c + 1 .. G - 1`` are simply never pushed by it,
  so a VW that fell behind trains fewer of its own samples in the run, never stale ones;
- the run ends at global clock ``W`` (the waves asked for), whoever pushed them: a VW pushes
  waves below ``W`` only and runs :func:`vw_minibatches` minibatches in all. Every wave
  below ``W`` closes (every VW either pushes it or already saw it closed, and ``N <= n``),
  so no pull ever waits for a wave that never comes.

With ``b = 0`` every wave waits for every VW: exactly WSP with ``D = 0`` (the clock never
passes ``c + 1`` before a VW pushed ``c``, so :func:`continue_at` is always ``c + 1``).

Worked example, 3 VWs, 1 backup (N = 2): VW 2 pushes wave 0 first, then VW 0: the wave closes
and its update is ``u0 + u2`` (VW id order); VW 1's push comes late and is dropped.

>>> q = QuorumClock(n_vws=3, backups=1)
>>> q.arrive(2, 0), q.arrive(0, 0), q.clock
(<Arrival.COUNTED: 0>, <Arrival.CLOSED: 1>, 1)
>>> q.counted(0)
(0, 2)
>>> q.arrive(1, 0)
<Arrival.DROPPED: 2>

VW 1 was a whole wave late: VWs 0 and 2 closed wave 1 as well before its pull was answered,
so it continues at wave 2 (its next data wave is pushed as wave 2). In a run of 3 waves it
then trains 2 waves of its data (it skipped wave 1), 4 minibatches at ``Nm = 2``:

>>> continue_at(0, clock=2)
2
>>> vw_minibatches(waves=3, skipped=1, admitted=3, nm=2)
4
"""

from __future__ import annotations

from collections.abc import Mapping
from enum import IntEnum

__all__ = [
    "Arrival",
    "QuorumClock",
    "backup_delays",
    "check_backups",
    "continue_at",
    "quorum",
    "vw_minibatches",
]


def backup_delays(params: Mapping[str, float], n_vws: int, D: int) -> tuple[int, int]:
    """For ``--objective time`` (:data:`planner.rules.TimeDelays`): a wave sums the first
    ``n_vws - backups`` VWs' updates, at ``D = 0``.

    >>> backup_delays({"backups": 1.0}, 4, 3)
    (3, 0)
    """
    return quorum(n_vws, int(params.get("backups", 0))), 0


def quorum(n_vws: int, backups: int) -> int:
    """VWs whose pushes close a wave: ``N = n_vws - backups``.

    >>> quorum(4, 1)
    3

    Raises:
        ValueError: ``backups`` is negative or leaves no VW to wait for.
    """
    if n_vws < 1:
        raise ValueError(f"need at least one virtual worker, got {n_vws}")
    if not 0 <= backups < n_vws:
        raise ValueError(
            f"backups must be in 0..{n_vws - 1} with {n_vws} virtual workers, got {backups}"
        )
    return n_vws - backups


def check_backups(params: Mapping[str, float], n_vws: int) -> None:
    """The rule's check against a plan (:attr:`planner.rules.SyncRule.check`): ``b < VWs``.

    Raises:
        ValueError: :func:`quorum`'s message.
    """
    quorum(n_vws, int(params["backups"]))


def continue_at(pushed: int, clock: int) -> int:
    """The wave a VW works on after pushing wave ``pushed`` and pulling global clock ``clock``.

    Normally ``pushed + 1``; a VW the others left behind (waves up to ``clock - 1`` closed
    without it) jumps to the current clock instead of pushing waves that are already closed.

    >>> continue_at(4, 5), continue_at(4, 8)
    (5, 8)

    Raises:
        ValueError: ``clock`` below ``pushed + 1`` (the pull was answered too early: at
            ``D = 0`` it waits until wave ``pushed`` closed) or a negative wave.
    """
    if pushed < 0:
        raise ValueError(f"waves are numbered from 0, got {pushed}")
    if clock < pushed + 1:
        raise ValueError(
            f"a pull after pushing wave {pushed} must return clock >= {pushed + 1}, got {clock}"
        )
    return clock


def vw_minibatches(waves: int, skipped: int, admitted: int, nm: int) -> int:
    """Minibatches a VW runs in all when the run ends at global clock ``waves``.

    The run is over when the global clock reaches ``waves``, whoever pushed them: a VW that
    skipped ``skipped`` waves (:func:`continue_at`) pushes ``waves - skipped`` waves of its
    data. It never runs fewer than the whole waves it has already admitted: a wave in progress
    when the VW learns it jumped to ``waves`` or beyond is finished and not pushed (its
    number is not below ``waves``), so every stage of the VW ends on a wave boundary.

    >>> vw_minibatches(10, 0, 7, 4), vw_minibatches(10, 3, 7, 4), vw_minibatches(10, 9, 7, 4)
    (40, 28, 8)

    Raises:
        ValueError: negative values or ``nm < 1``.
    """
    if nm < 1 or min(waves, skipped, admitted) < 0:
        raise ValueError(
            f"need waves, skipped, admitted >= 0 and nm >= 1, got {waves}, {skipped}, "
            f"{admitted}, {nm}"
        )
    return max(-(-admitted // nm), waves - skipped) * nm


class Arrival(IntEnum):
    """What a VW's (complete) push of a wave did."""

    COUNTED = 0  # kept for the wave; the wave is still open
    CLOSED = 1  # kept, and it completed the quorum: the wave (and maybe later ones) closed
    DROPPED = 2  # the wave had already closed: not applied, recorded once


class QuorumClock:
    """Which VWs' pushes each wave keeps, and the global clock (closed waves).

    A wave closes when it holds ``N`` pushes and every earlier wave is closed. Pushes of a
    wave above the clock are kept (counted) until their wave closes; the first ``N`` of a wave
    are kept, any later push of it is dropped.

    Args:
        n_vws: number of virtual workers.
        backups: ``b``; the quorum is ``n_vws - b``.
        clock: waves already closed (a resumed run).
    """

    def __init__(self, n_vws: int, backups: int = 0, clock: int = 0) -> None:
        self.n = quorum(n_vws, backups)
        self.n_vws = n_vws
        self._clock = clock
        self._open: dict[int, list[int]] = {}  # wave -> VWs pushed (arrival order)
        self._closed: dict[int, tuple[int, ...]] = {}  # wave -> counted VWs (id order)
        self._dropped: set[tuple[int, int]] = set()

    @property
    def clock(self) -> int:
        """Global clock: waves ``0 .. clock - 1`` are closed."""
        return self._clock

    def arrive(self, vw: int, wave: int) -> Arrival:
        """Record that ``vw`` completed its push of ``wave``.

        Raises:
            ValueError: no such VW, a negative wave, or the same (vw, wave) twice.
        """
        if not 0 <= vw < self.n_vws:
            raise ValueError(f"no virtual worker {vw} (there are {self.n_vws})")
        if wave < 0:
            raise ValueError(f"waves are numbered from 0, got {wave}")
        if wave < self._clock:
            if (vw, wave) in self._dropped or vw in self._closed.get(wave, ()):
                raise ValueError(f"vw {vw} already pushed wave {wave}")
            self._dropped.add((vw, wave))
            return Arrival.DROPPED
        got = self._open.setdefault(wave, [])
        if vw in got or (vw, wave) in self._dropped:
            raise ValueError(f"vw {vw} already pushed wave {wave}")
        if len(got) >= self.n:  # the wave has its N (it waits for an earlier wave to close)
            self._dropped.add((vw, wave))
            return Arrival.DROPPED
        got.append(vw)
        before = self._clock
        while len(self._open.get(self._clock, ())) >= self.n:
            self._closed[self._clock] = tuple(sorted(self._open.pop(self._clock)))
            self._clock += 1
        return Arrival.CLOSED if self._clock > before else Arrival.COUNTED

    def counted(self, wave: int) -> tuple[int, ...]:
        """The VWs whose pushes make closed ``wave``'s update, in VW id (summation) order."""
        return self._closed[wave]

    def dropped(self) -> tuple[tuple[int, int], ...]:
        """Every dropped ``(vw, wave)``, sorted."""
        return tuple(sorted(self._dropped))

    def forget(self, below: int) -> None:
        """Drop the records of waves below ``below`` (a long run's memory stays bounded)."""
        self._closed = {c: v for c, v in self._closed.items() if c >= below}
        self._dropped = {(v, c) for v, c in self._dropped if c >= below}
