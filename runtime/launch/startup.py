"""A rank lost at start-up, before every rank has joined the run's process group.

All ranks of a launch join one gloo group of fixed size; a rank that dies (or freezes)
before the group has formed leaves every other rank blocked in the rendezvous or the start
barrier, and gloo cannot take a new process in its place there. So the lost VW cannot be
restarted alone, nor evicted at a cut as later: nothing has been trained yet, and the
launcher stops every process at once (:class:`StartUp` tells when the group has formed, from
the ``("joined", rank)`` report each rank posts once past the barrier) and raises
:class:`StartUpLoss`, naming the rank that died (never a peer that only timed out waiting
for it). :func:`runtime.launch.launcher.launch` then starts the job again, either whole
(``--on-failure restart``, one restart of the budget) or with the lost VW *absent*
(``--on-failure continue``, or the budget spent): each of its stages only holds its rank
while the group forms and leaves (:func:`runtime.launch.procs.absent_main`), so the shards
evict the VW at wave 0 through the same cut as any later loss.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from profiler.errors import HetPipeRuntimeError

__all__ = ["ABSENT", "JOINED", "StartUp", "StartUpLoss"]

JOINED = "joined"  # the event kind a rank posts once past the start barrier
ABSENT = "absent"  # the event kind an absent VW's stage posts as it leaves


class StartUpLoss(HetPipeRuntimeError):
    """A stage of VW ``vw`` was lost before the process group formed (same message: the rank
    and its cause); ``cause`` is the message without the resume hint."""

    def __init__(self, message: str, vw: int, cause: str) -> None:
        super().__init__(message)
        self.vw, self.cause = vw, cause


@dataclass
class StartUp:
    """Which ranks have not yet joined the run's group (posted ``("joined", rank)``).

    Attributes:
        waiting: the ranks still to join.
    """

    waiting: set[int] = field(default_factory=set)

    @classmethod
    def of(cls, ranks: Iterable[int]) -> StartUp:
        """Every rank in ``ranks`` still to join."""
        return cls(set(ranks))

    def joined(self, rank: int) -> None:
        """``rank`` is past the start barrier."""
        self.waiting.discard(rank)

    @property
    def formed(self) -> bool:
        """Whether every rank joined: from now on a loss is handled at a cut."""
        return not self.waiting
