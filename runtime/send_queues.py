"""Sender-side link queues: each transfer charged on the queue the simulator charges it on.

The simulator (:mod:`planner.sim.engine`) charges a transfer on its *sender's* queue
(:func:`planner.cluster.sender_queue`): a stage's activations, gradients and the local part
of its push queue on its GPU's own link; whatever leaves the node (and a push's part to
shards on other nodes) queues on the node's network card, shared by every process of that
node, of every VW. The runtime charges the same queues: when a stage posts a send it
reserves the message's window on its queue, ``[max(now, queue free), + Link.time_s(bytes))``,
and the message carries the window's end; the receiver holds it back until then
(:meth:`runtime.link_pacing.LinkPacer.delivered`), a push is posted then
(:class:`runtime.link_pacing.DelayLine`).

A window's end is a ``time.perf_counter`` reading (``CLOCK_MONOTONIC``), comparable across
the processes of one host; the card's queue lives in a file of the launch's folder (one per
emulated node, made by the launcher, removed with the folder) read and written under an
exclusive ``flock``. Under torchrun the runtime cannot tell whether its processes share a
host, so it has no card file and paces on the receiving side (each direction of each stage
pair on its own, :class:`runtime.link_pacing.LinkPacer.arrived`).
"""

from __future__ import annotations

import fcntl
import math
import os
import struct
import threading
from dataclasses import dataclass
from pathlib import Path

from planner.cluster import OWN_LINK, Link, fifo_slot
from runtime.link_pacing import REAL_PACE, LocalQueue, Pace

__all__ = ["CardQueue", "Route", "SendQueues", "make_card"]

_FREE = struct.Struct("d")  # the card file: when its last charged transfer ends (seconds)


def make_card(path: Path) -> None:
    """Create the file of a node card's queue (free at once)."""
    path.write_bytes(_FREE.pack(float("-inf")))


class CardQueue:
    """A node's network card, shared by every process of the node: its queue's free time is
    the 8 bytes of ``path`` (:func:`make_card`), read and written under an exclusive
    ``flock`` (opened on first use; a lock per open file, so two queues of one process on
    one file exclude each other too)."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._fd = -1
        self._lock = threading.Lock()

    def reserve(self, charge_s: float, now_s: float) -> float:
        """:meth:`runtime.link_pacing.LocalQueue.reserve` on the card, atomically across
        processes."""
        with self._lock:
            if self._fd < 0:
                self._fd = os.open(self.path, os.O_RDWR)
            fcntl.flock(self._fd, fcntl.LOCK_EX)
            try:
                (free,) = _FREE.unpack(os.pread(self._fd, _FREE.size, 0))
                end = fifo_slot(free, now_s, charge_s)[1]
                os.pwrite(self._fd, _FREE.pack(end), 0)
            finally:
                fcntl.flock(self._fd, fcntl.LOCK_UN)
            return float(end)

    def close(self) -> None:
        """Close the file (a later :meth:`reserve` opens it again)."""
        with self._lock:
            if self._fd >= 0:
                os.close(self._fd)
                self._fd = -1


class SendQueues:
    """A stage process's sender-side queues: its own link's and its node card's.

    Args:
        card_file: the node card's queue file (:func:`make_card`).
        pace: whose clock windows are reckoned on (tests inject one).
    """

    def __init__(self, card_file: str, pace: Pace = REAL_PACE) -> None:
        self.own = LocalQueue()
        self.card = CardQueue(card_file)
        self.pace = pace

    def deadline(self, queue: str, charge_s: float, not_before_s: float = -math.inf) -> float:
        """When a transfer of ``charge_s`` seconds posted now on ``queue``
        (:func:`planner.cluster.sender_queue`), beginning no sooner than ``not_before_s``,
        ends."""
        fifo = self.own if queue == OWN_LINK else self.card
        return fifo.reserve(charge_s, max(self.pace.clock(), not_before_s))

    def push_deadline(self, queue: str, charge_s: float) -> float:
        """When one part of a push posted now ends: a part to a shard on the stage's node on
        its own link, a part to another node on the card once the own link is free (after
        the push's local parts, as the simulator charges it)."""
        now = self.pace.clock()
        if queue == OWN_LINK:
            return self.own.reserve(charge_s, now)
        return self.card.reserve(charge_s, max(now, self.own.free_s))

    def close(self) -> None:
        """Close the card's file."""
        self.card.close()


@dataclass(frozen=True)
class Route:
    """Where the sends of one direction of a stage are charged: ``link`` on its ``queue``.

    Attributes:
        queues: the stage's queues.
        link: the charged (scaled) link to the peer.
        queue: the sender's queue the sends wait in (:func:`planner.cluster.sender_queue`).
    """

    queues: SendQueues
    link: Link
    queue: str

    def deadline(self, nbytes: float, not_before_s: float = -math.inf) -> float:
        """When a message of ``nbytes`` posted now (its transfer beginning no sooner than
        ``not_before_s``) is delivered (:meth:`SendQueues.deadline`)."""
        return self.queues.deadline(self.queue, self.link.time_s(nbytes), not_before_s)
