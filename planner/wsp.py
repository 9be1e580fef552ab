"""Wave Synchronous Parallel (WSP) rules of paper Sec. 5, as pure functions.

One source of truth for the simulator, the runtime and the parameter server.

Vocabulary (minibatches ``p`` are numbered from 1 inside each virtual worker, VW):

- a *wave* is ``Nm`` consecutive minibatches: wave ``c`` = minibatches ``c*Nm+1 .. (c+1)*Nm``;
- a VW's *local clock* is the number of waves it has completed and pushed;
- the *global clock* is the minimum local clock over all VWs; the parameter server's
  global weights hold the updates of waves ``0 .. global-1`` of every VW;
- *clock distance* is the largest difference between two local clocks; WSP keeps it at
  most ``D + 1`` (``D`` is the user's threshold, see ``/work/shared/seeds/README.md``).

Local staleness: minibatch ``p`` uses exactly the weights ``w0 + u1 + ... + u(p-Nm)`` on every
stage (:func:`local_version`). Global staleness: to start minibatch ``p`` the VW must hold
the global updates of waves ``0 .. required_global_clock(p) - 1`` of every VW.

Paper example (Nm = 4, D = 0): minibatch 8 is the first that needs wave 0's global update;
minibatch 11 needs only the global updates of minibatches 1..4; ``s_global = 6``.
"""

from __future__ import annotations

from collections import deque

__all__ = [
    "GlobalClock",
    "first_minibatch_needing",
    "folds_at_update",
    "local_version",
    "may_admit",
    "required_global_clock",
    "s_global",
    "s_local",
    "stop_wave",
    "wave_of",
    "whole_waves",
]


def _check(nm: int, D: int = 0) -> None:
    if nm < 1:
        raise ValueError(f"Nm must be >= 1, got {nm}")
    if D < 0:
        raise ValueError(f"D must be >= 0, got {D}")


def wave_of(mb: int, nm: int) -> int:
    """0-based wave of 1-based minibatch ``mb``: ``(mb - 1) // nm``."""
    _check(nm)
    if mb < 1:
        raise ValueError(f"minibatches are numbered from 1, got {mb}")
    return (mb - 1) // nm


def whole_waves(minibatches: int, nm: int) -> int:
    """``minibatches`` rounded up to whole waves of ``nm``: what each VW trains through the
    parameter servers, where every VW pushes the same waves (a partial last wave would never
    be pushed, and the global clock would never pass it).

    >>> whole_waves(20, 8), whole_waves(24, 8), whole_waves(0, 4)
    (24, 24, 0)
    """
    _check(nm)
    if minibatches < 0:
        raise ValueError(f"minibatches must be >= 0, got {minibatches}")
    return -(-minibatches // nm) * nm


def local_version(mb: int, nm: int) -> int:
    """Number of local updates in the weights minibatch ``mb`` uses: ``max(0, mb - nm)``.

    Minibatch ``p`` runs with ``w0 + u1 + ... + u(p-Nm)`` on every stage (local staleness
    ``Nm - 1``, deterministic whatever the timing).
    """
    _check(nm)
    if mb < 1:
        raise ValueError(f"minibatches are numbered from 1, got {mb}")
    return max(0, mb - nm)


def required_global_clock(mb: int, nm: int, D: int) -> int:
    """Global clock needed to admit minibatch ``mb``: ``max(0, mb // nm - D - 1)``.

    Admitting ``mb`` requires the global updates of waves ``0 .. result-1`` of every VW; it
    keeps the clock distance at most ``D + 1``.
    """
    _check(nm, D)
    if mb < 1:
        raise ValueError(f"minibatches are numbered from 1, got {mb}")
    return max(0, mb // nm - D - 1)


def first_minibatch_needing(wave: int, nm: int, D: int) -> int:
    """Smallest minibatch whose admission needs the global update of ``wave``.

    Equals ``(wave + D + 2) * nm``; e.g. 8 for wave 0 with Nm = 4, D = 0.
    """
    _check(nm, D)
    if wave < 0:
        raise ValueError(f"waves are numbered from 0, got {wave}")
    return (wave + D + 2) * nm


def folds_at_update(D: int, in_order: bool, tied: bool = False, backup: bool = False) -> bool:
    """Whether a stage folds the pull that follows its wave's push before its first local
    update after that push (``True``), rather than at the forward that needs it.

    With ``D = 0`` the fold must meet the same weights in every run (bit-reproducible): the
    first update after the push is such a point on every stage; the forward that needs the
    pull is one only on a stage whose tasks run in minibatch order (``in_order``: the
    pipeline's last stage) without tied copies or backup workers. So such a stage cannot
    update minibatch ``(c + 1) * Nm + 1`` before the pull after wave ``c``'s push arrived;
    the runtime (``runtime/sync/wave.py``) and the simulator both follow this rule.

    >>> folds_at_update(0, in_order=False), folds_at_update(0, in_order=True)
    (True, False)
    >>> folds_at_update(0, in_order=True, tied=True), folds_at_update(1, in_order=False)
    (True, False)
    """
    _check(1, D)
    return D == 0 and not (in_order and not tied and not backup)


def s_local(nm: int) -> int:
    """Local staleness bound ``Nm - 1`` (paper Sec. 4)."""
    _check(nm)
    return nm - 1


def s_global(nm: int, D: int) -> int:
    """Global staleness bound ``(D + 1) * Nm + Nm - 2`` (paper Sec. 5).

    Minibatch ``p`` sees every global update of minibatches ``1 .. p - (s_global + 1)``.
    """
    _check(nm, D)
    return (D + 1) * nm + nm - 2


def stop_wave(admitted: int, nm: int, D: int) -> int:
    """Waves every VW runs when a VW that has admitted ``admitted`` minibatches must stop.

    Used for a time limit with parameter servers: the first VW whose time is up proposes this
    and every VW (that one included) runs exactly that many waves, so the global clock reaches
    it and no VW waits for a wave that will never come. It is the smallest safe value: the
    proposer has pushed at most ``g = admitted // nm`` waves, so the global clock is at most
    ``g``, and admitting minibatch ``p`` needs ``p // nm - D - 1 <= g``: no VW can have admitted
    beyond minibatch ``(g + D + 2) * nm - 1``; the answer is the waves that minibatch completes.
    """
    _check(nm, D)
    if admitted < 0:
        raise ValueError(f"admitted minibatches must be >= 0, got {admitted}")
    most = (admitted // nm + D + 2) * nm - 1  # the last minibatch any VW may have admitted
    return max(-(-most // nm), -(-admitted // nm))


def may_admit(mb: int, in_flight: int, nm: int, D: int, global_clock: int) -> bool:
    """Whether a VW may start minibatch ``mb`` on its first stage now.

    Args:
        mb: the minibatch to admit (1-based).
        in_flight: minibatches admitted whose first-stage backward has not finished.
        nm: minibatches per wave (most in flight).
        D: WSP threshold.
        global_clock: the global clock the VW has pulled (waves every VW has pushed).
    """
    return in_flight < nm and global_clock >= required_global_clock(mb, nm, D)


class GlobalClock:
    """Local clocks of ``n_vws`` virtual workers and the global clock (their minimum).

    Used by the simulator and the parameter server. Waves must be pushed in order per VW.

    Args:
        n_vws: number of virtual workers.
    """

    def __init__(self, n_vws: int) -> None:
        if n_vws < 1:
            raise ValueError(f"need at least one virtual worker, got {n_vws}")
        self._local = [0] * n_vws
        self._count: deque[int] = deque([n_vws])  # _count[c]: VWs whose local clock is global + c
        self._global = 0

    @property
    def n_vws(self) -> int:
        """Number of virtual workers."""
        return len(self._local)

    @property
    def global_clock(self) -> int:
        """Minimum local clock: waves ``0 .. global_clock-1`` are pushed by every VW."""
        return self._global

    @property
    def distance(self) -> int:
        """Clock distance: largest local clock minus the smallest."""
        return len(self._count) - 1

    def local(self, vw: int) -> int:
        """Local clock (completed, pushed waves) of ``vw``."""
        return self._local[vw]

    def push(self, vw: int, wave: int) -> int:
        """Record that ``vw`` pushed the aggregated update of ``wave``; return the global clock.

        Amortised O(1).

        Raises:
            ValueError: ``wave`` is not the VW's next wave (pushes must come in order).
        """
        if not 0 <= vw < len(self._local):
            raise ValueError(f"no virtual worker {vw} (there are {len(self._local)})")
        if wave != self._local[vw]:
            raise ValueError(f"vw {vw} pushed wave {wave} but its next wave is {self._local[vw]}")
        off = self._local[vw] - self._global
        self._local[vw] += 1
        self._count[off] -= 1
        if off + 1 == len(self._count):
            self._count.append(0)
        self._count[off + 1] += 1
        while self._count[0] == 0:
            self._count.popleft()
            self._global += 1
        return self._global

    def rewind(self, vw: int, wave: int) -> int:
        """Set ``vw``'s local clock back to ``wave``: its pushes from ``wave`` on were
        discarded and a restarted incarnation pushes them again (``--on-failure restart``).
        Returns the global clock. O(``n_vws``).

        Raises:
            ValueError: ``wave`` is negative or above the VW's local clock.
        """
        if not 0 <= wave <= self.local(vw):
            raise ValueError(f"vw {vw} cannot rewind to wave {wave} (local clock {self.local(vw)})")
        self._local[vw] = wave
        self._global = min(self._local)
        counts = [0] * (max(self._local) - self._global + 1)
        for c in self._local:
            counts[c - self._global] += 1
        self._count = deque(counts)
        return self._global
