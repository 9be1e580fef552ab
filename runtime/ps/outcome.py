"""What a parameter-server shard's state machine (:class:`runtime.ps.core.ShardCore`) reports:
the status of a push or pull, the clock trace, evictions.

``Status`` values travel on the wire (a push's acknowledgement, a pull's header).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum

__all__ = ["ClockEvent", "Eviction", "PushResult", "Status"]


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
