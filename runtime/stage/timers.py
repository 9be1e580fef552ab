"""Lap timers of a stage's wall time by task kind and category (``--profile-runtime``).

A :class:`LapTimer` attributes the time since its previous lap to one category of the task
kind running (``F``, ``B``, ``FB``, or ``loop`` between tasks), so the categories of a stage
add up to its wall time by construction and nothing is counted twice. Each lap is one
``time.perf_counter_ns`` call and one dictionary update (well under a microsecond); without
the flag the stage holds a :class:`NullTimer`, whose laps do nothing.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from runtime.results.breakdown import LOOP, Breakdown

__all__ = ["LapTimer", "NullTimer", "lap_timer"]


class LapTimer:
    """Accumulates nanoseconds per ``(task kind, category)`` from one lap to the next
    (``clock``: nanoseconds, injectable for tests)."""

    __slots__ = ("_clock", "_last", "_ns", "_planned", "_start", "_tasks", "kind")

    def __init__(self, clock: Callable[[], int] = time.perf_counter_ns) -> None:
        self._clock = clock
        self._start = self._last = clock()
        self._ns: dict[tuple[str, str], int] = {}
        self._tasks: dict[str, int] = {}
        self._planned = 0
        self.kind = LOOP

    def lap(self, category: str, waited_s: float = 0.0) -> None:
        """Charge the time since the previous lap to ``category`` (``waited_s`` of it, a WSP
        wait measured inside, to ``wsp_wait``)."""
        now = self._clock()
        spent, self._last = now - self._last, now
        waited = min(spent, int(waited_s * 1e9))
        key = (self.kind, category)
        self._ns[key] = self._ns.get(key, 0) + spent - waited
        if waited > 0:
            key = (self.kind, "wsp_wait")
            self._ns[key] = self._ns.get(key, 0) + waited

    def planned(self, seconds: float) -> None:
        """An emulated device's task is planned to take ``seconds`` (what pacing stretches it
        to; not a lap)."""
        self._planned += int(seconds * 1e9)

    def task(self, kind: str) -> None:
        """A task of ``kind`` starts (what came before it is the loop's ``other``)."""
        self.lap("other")
        self.kind = kind
        self._tasks[kind] = self._tasks.get(kind, 0) + 1

    def idle(self) -> None:
        """The task ended (its remainder is its ``other``); laps go to the loop again."""
        self.lap("other")
        self.kind = LOOP

    def result(self) -> Breakdown | None:
        """Everything measured so far, up to now (the remainder is the loop's ``other``)."""
        self.kind = LOOP
        self.lap("other")
        return Breakdown(
            self._last - self._start,
            tuple((k, c, ns) for (k, c), ns in sorted(self._ns.items())),
            tuple(sorted(self._tasks.items())),
            self._planned,
        )


class NullTimer(LapTimer):
    """The timer of a run without ``--profile-runtime``: every lap is a no-op."""

    __slots__ = ()

    def lap(self, category: str, waited_s: float = 0.0) -> None:
        """Nothing."""

    def planned(self, seconds: float) -> None:
        """Nothing."""

    def task(self, kind: str) -> None:
        """Nothing."""

    def idle(self) -> None:
        """Nothing."""

    def result(self) -> Breakdown | None:
        """No breakdown."""
        return None


def lap_timer(enabled: bool) -> LapTimer:
    """A :class:`LapTimer` started now, or a :class:`NullTimer` when not ``enabled``."""
    return LapTimer() if enabled else NullTimer()
