"""What a parameter-server shard's state machine (:class:`runtime.ps.core.ShardCore`) reports:
the status of a push or pull, the clock trace, evictions.

``Status`` values travel on the wire (a push's acknowledgement, a pull's header).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass
from enum import IntEnum

__all__ = ["TRACE_EVENTS", "ClockEvent", "ClockTrace", "Eviction", "PushResult", "Status"]


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


TRACE_EVENTS = 10_000  # clock events a shard keeps: the newest pushes (memory flat in a long run)


class ClockTrace:
    """A shard's :class:`ClockEvent` per accepted push: the newest ``keep`` of them, plus the
    one of the largest clock distance so far (the WSP bound's witness), so that a run of days
    keeps its shards' memory flat and still reports its exact maximum clock distance.

    >>> t = ClockTrace(keep=2)
    >>> for seq, local in enumerate([(1, 0), (3, 0), (3, 3), (4, 3)]):
    ...     t.append(ClockEvent(seq, 0, 0, seq, local, min(local)))
    >>> [e.seq for e in t], [e.seq for e in t.kept()]
    ([2, 3], [1, 2, 3])
    """

    def __init__(self, keep: int = TRACE_EVENTS) -> None:
        self._events: deque[ClockEvent] = deque(maxlen=keep)
        self.peak: ClockEvent | None = None  # the largest clock distance so far
        self._peak_dropped = False

    def append(self, event: ClockEvent) -> None:
        """Record one accepted push's event (the oldest kept one goes once ``keep`` are held)."""
        if len(self._events) == self._events.maxlen and self._events[0] is self.peak:
            self._peak_dropped = True
        self._events.append(event)
        if self.peak is None or event.distance > self.peak.distance:
            self.peak, self._peak_dropped = event, False

    def kept(self) -> list[ClockEvent]:
        """The events kept, oldest first: the peak (when older than the rest), then the newest."""
        head = [self.peak] if self._peak_dropped and self.peak is not None else []
        return [*head, *self._events]

    def __iter__(self) -> Iterator[ClockEvent]:
        return iter(self._events)

    def __len__(self) -> int:
        return len(self._events)

    def __getitem__(self, index: int) -> ClockEvent:
        return self._events[index]


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
