"""Emulated links: stage, parameter-server and AllReduce transfers paced to the plan's links.

On an emulated cluster every byte really travels over loopback, almost for free, while the
planner and the simulator charge the cluster file's links. So each transfer is paced: after
the real transfer completes, its receiver (or the caller that waits for it) waits until the
charged time has elapsed since the transfer began, and never less than the real transfer
took. The charge is :meth:`planner.cluster.Link.time_s` of the link the plan's cluster puts
between the two nodes, scaled by the cluster's ``links: {scale: F}``
(:meth:`planner.cluster.LinkTable.between`), the exact function the cost model and the
simulator charge; the AllReduce baseline's collective is charged
:func:`planner.cluster.allreduce_s`, the ring the prediction charges.

Where the runtime overlaps communication with compute the pacing overlaps too: activations
and gradients are paced on the receiving stage's receive threads (the sender's ``isend``
returns at once, and the receiver computes other tasks meanwhile), a pull in
:meth:`runtime.ps.pull.PullHandle.wait` (a stage that computes while its pull is in flight
keeps computing; a reply held back until the global clock allows it is charged from when
it arrived, as the simulator pulls after the clock); a push is posted by a :class:`DelayLine` thread when its charge has
passed, so the shard applies it when the emulated link would deliver it and the stage goes
on meanwhile; only the AllReduce's collective, which blocks in the real runtime too, blocks
for its charge.

A stage's receive thread cannot see when its peer posted a send (another process), so a
message's transfer is taken to begin when it arrived, or when the previous message on the
same link finished (one transfer at a time, as the simulator's links): the pacing errs
slow by the real loopback time (tens of microseconds), never fast. Real clusters (no
``emulate:``) and runs with ``emulate=False`` are not paced (:data:`NO_LINKS`).
"""

from __future__ import annotations

import datetime
import math
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from planner.cluster import OWN_LINK, Cluster, Link, allreduce_s, fifo_slot

__all__ = [
    "NO_LINKS",
    "REAL_PACE",
    "Arrival",
    "ArrivalWatcher",
    "DelayLine",
    "DelayedWork",
    "LinkPacer",
    "LocalQueue",
    "Pace",
    "StageLinks",
    "Waiter",
    "active_links",
    "links_statement",
    "pace_since",
]

T = TypeVar("T")

Waiter = Callable[[float, Callable[[], float]], float]
"""Waits until ``clock() >= deadline``; returns how late it came (:func:`pace_until`)."""


def pace_until(deadline: float, clock: Callable[[], float] = time.perf_counter) -> float:
    """:func:`runtime.stage.emulation.pace_until` (sleep, then spin the last 0.25 ms), imported
    when first used: this module stays free of torch."""
    from runtime.stage.emulation import pace_until as wait

    return wait(deadline, clock)


def pace_since(
    start_s: float,
    charge_s: float,
    clock: Callable[[], float] = time.perf_counter,
    wait: Waiter = pace_until,
) -> float:
    """After a transfer that began at ``start_s`` completed: wait until ``charge_s`` seconds
    have elapsed since it began (at once when the real transfer took longer).

    Returns:
        Seconds waited (0 when the real transfer already took ``charge_s`` or more).
    """
    if charge_s <= 0:
        return 0.0
    now = clock()
    deadline = start_s + charge_s
    if now >= deadline:
        return 0.0
    wait(deadline, clock)
    return deadline - now


@dataclass(frozen=True)
class Pace:
    """The clock transfers are paced by and how to wait for it (tests inject both).

    Attributes:
        clock: seconds.
        wait: waits until ``clock() >= deadline``.
    """

    clock: Callable[[], float] = time.perf_counter
    wait: Waiter = pace_until

    def since(self, start_s: float, charge_s: float) -> float:
        """:func:`pace_since` on this clock: seconds waited."""
        return pace_since(start_s, charge_s, self.clock, self.wait)


REAL_PACE = Pace()
"""Wall-clock pacing (``time.perf_counter``, sleep then spin)."""


class LocalQueue:
    """One process's link queue (a stage's own link, one direction of a paced link): when
    its last charged transfer ends; transfers take their slots by
    :func:`planner.cluster.fifo_slot`, the simulator's rule."""

    def __init__(self) -> None:
        self._free_s = float("-inf")
        self._lock = threading.Lock()

    @property
    def free_s(self) -> float:
        """When the last transfer charged on the queue ends."""
        return self._free_s

    def slot(self, charge_s: float, ready_s: float) -> tuple[float, float]:
        """Charge a transfer of ``charge_s`` seconds that can begin at ``ready_s``; returns
        when it begins (once the queue's previous transfer ended) and ends."""
        with self._lock:
            begin, self._free_s = fifo_slot(self._free_s, ready_s, charge_s)
            return begin, self._free_s

    def reserve(self, charge_s: float, ready_s: float) -> float:
        """:meth:`slot`'s end: when the transfer ends."""
        return self.slot(charge_s, ready_s)[1]


class LinkPacer:
    """Paces the messages of one direction of one link, one transfer at a time.

    Args:
        link: the charged (already scaled) link; ``None``: not paced.
        pace: the clock and the wait (tests inject them).
    """

    def __init__(self, link: Link | None, pace: Pace = REAL_PACE) -> None:
        self.link, self.pace = link, pace
        self._queue = LocalQueue()  # the link carries one transfer at a time

    def charge_s(self, nbytes: float) -> float:
        """Seconds a transfer of ``nbytes`` is charged (0 when not paced)."""
        return 0.0 if self.link is None else self.link.time_s(nbytes)

    def arrived(self, nbytes: float, start_s: float | None = None) -> float:
        """A message of ``nbytes`` just completed; wait out its charge.

        Args:
            nbytes: bytes of the message.
            start_s: when its transfer began (``None``: now, i.e. when it arrived).

        Returns:
            Seconds waited.
        """
        if self.link is None:
            return 0.0
        charge = self.charge_s(nbytes)
        begin, _ = self._queue.slot(charge, self.pace.clock() if start_s is None else start_s)
        return self.pace.since(begin, charge)

    def delivered(self, nbytes: float, arrived_s: float, deadline_s: float) -> float:
        """A message of ``nbytes`` that arrived at ``arrived_s``: wait until ``deadline_s``,
        when its sender's queue delivers it (:mod:`runtime.send_queues`), or, without one
        (NaN: the sender does not queue its sends), pace it here (:meth:`arrived`).

        Returns:
            Seconds waited.
        """
        if math.isnan(deadline_s):
            return self.arrived(nbytes, arrived_s)
        now = self.pace.clock()
        if now >= deadline_s:
            return 0.0
        self.pace.wait(deadline_s, self.pace.clock)
        return deadline_s - now


class DelayedWork:
    """A send a :class:`DelayLine` posts at its deadline; waited on like a ``dist.Work``."""

    def __init__(self) -> None:
        self._posted = threading.Event()
        self._work: Any = None
        self._error: BaseException | None = None

    def _set(self, work: Any, error: BaseException | None) -> None:
        self._work, self._error = work, error
        self._posted.set()

    def wait(self, timeout: datetime.timedelta | None = None) -> bool:
        """Wait until the send was posted, then for the send itself.

        Raises:
            RuntimeError: not posted within ``timeout`` (the transport's own timeout error).
            BaseException: what posting the send raised.
        """
        if not self._posted.wait(None if timeout is None else timeout.total_seconds()):
            raise RuntimeError(f"a paced send was not posted within {timeout}")
        if self._error is not None:
            raise self._error
        return bool(self._work.wait() if timeout is None else self._work.wait(timeout))


class Arrival:
    """Waits for a receive on a watcher's thread and records when it completed (:attr:`arrived_s`),
    so a caller that comes late still knows when its reply arrived; waited on like a
    ``dist.Work``.

    Args:
        work: the receive's work.
        watcher: the thread that waits for it (one per client).
        pace: whose clock stamps the arrival.
    """

    def __init__(self, work: Any, watcher: ArrivalWatcher, pace: Pace = REAL_PACE) -> None:
        self.arrived_s = float("inf")
        self._done = DelayedWork()
        self._work, self._pace = work, pace
        watcher.watch(self)

    def _watch(self) -> None:
        try:
            self._work.wait()
            self.arrived_s = self._pace.clock()
            self._done._set(_DONE, None)
        except BaseException as exc:  # handed to whoever waits for the receive
            self._done._set(None, exc)

    def wait(self, timeout: datetime.timedelta | None = None) -> bool:
        """Wait until the receive completed (:meth:`DelayedWork.wait`)."""
        return self._done.wait(timeout)


class _SerialThread(Generic[T]):
    """Handles queued items one after another on one daemon thread, started on first use;
    :meth:`close` ends it after the items already queued."""

    def __init__(self, name: str) -> None:
        self._name = name
        self._queue: queue.SimpleQueue[T | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None

    def _put(self, item: T) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name=self._name, daemon=True)
            self._thread.start()
        self._queue.put(item)

    def close(self) -> None:
        """End the thread after the items already queued."""
        if self._thread is not None:
            self._queue.put(None)
            self._thread = None

    def _loop(self) -> None:
        while (item := self._queue.get()) is not None:
            self._handle(item)

    def _handle(self, item: T) -> None:
        raise NotImplementedError


class ArrivalWatcher(_SerialThread[Arrival]):
    """Waits for :class:`Arrival` receives one after another on one thread, started on first
    use: a thread per receive cost more than the rest of a pull (its start waits until the
    new thread runs, milliseconds on a loaded machine).

    Receives are waited in the order they were posted, so one that completes before an
    earlier one is stamped when the earlier one completes: the latest arrival of a group
    posted together (a pull's replies, which is what the pacing reads) is stamped exactly.
    """

    def __init__(self) -> None:
        super().__init__("paced-arrivals")

    def watch(self, arrival: Arrival) -> None:
        """Stamp ``arrival`` once its receive (and every one watched before it) completed."""
        self._put(arrival)

    def _handle(self, item: Arrival) -> None:
        item._watch()


class _Done:
    """A work that is complete."""

    def wait(self, timeout: datetime.timedelta | None = None) -> bool:
        return True


_DONE = _Done()


class DelayLine(_SerialThread[tuple[float, Callable[[], Any], DelayedWork]]):
    """Posts sends at their deadlines, in order, on one thread: a paced message lands when
    its emulated link would deliver it, while its sender goes on computing.

    Args:
        pace: the clock and the wait (tests inject them).
    """

    def __init__(self, pace: Pace = REAL_PACE) -> None:
        super().__init__("paced-sends")
        self.pace = pace

    def post(self, deadline_s: float, send: Callable[[], Any]) -> DelayedWork:
        """Call ``send`` (which posts the send and returns its work) at ``deadline_s``."""
        work = DelayedWork()
        self._put((deadline_s, send, work))
        return work

    def _handle(self, item: tuple[float, Callable[[], Any], DelayedWork]) -> None:
        deadline, send, work = item
        if self.pace.clock() < deadline:
            self.pace.wait(deadline, self.pace.clock)
        try:
            work._set(send(), None)
        except BaseException as exc:  # handed to whoever waits for the send
            work._set(None, exc)


@dataclass(frozen=True)
class StageLinks:
    """The charged links of one stage process, read from the plan (``None``: not paced).

    Attributes:
        prev: the link from the previous stage (activations in, gradients back out).
        next: the link to the next stage.
        shards: ``(shard id, link)`` between this stage and each parameter-server shard.
        ring: the AllReduce ring's slowest link over this stage position's copies.
        ring_size: copies on that ring (the AllReduce baseline's VWs).
        prev_queue, next_queue: the sender's queue (:func:`planner.cluster.sender_queue`) the
            stage's sends to the previous (gradients) and next (activations) stage wait in.
        shard_queues: ``(shard id, queue)``: where the stage's push part to each shard waits.
        card_file: the file of its node card's queue, shared by every process of the node
            (:mod:`runtime.send_queues`; set by the launcher on one host); ``""``: the run
            cannot share one (torchrun): transfers are paced on the receiving side.
    """

    prev: Link | None = None
    next: Link | None = None
    shards: tuple[tuple[int, Link], ...] = ()
    ring: Link | None = None
    ring_size: int = 1
    prev_queue: str = OWN_LINK
    next_queue: str = OWN_LINK
    shard_queues: tuple[tuple[int, str], ...] = ()
    card_file: str = ""

    @property
    def paced(self) -> bool:
        """Whether any transfer of the stage is paced."""
        return any(x is not None for x in (self.prev, self.next, self.ring)) or bool(self.shards)

    def shard(self, shard_id: int) -> Link | None:
        """The link to shard ``shard_id`` (``None``: not paced)."""
        return dict(self.shards).get(shard_id)

    def shard_queue(self, shard_id: int) -> str:
        """The sender's queue the stage's push part to shard ``shard_id`` waits in."""
        return dict(self.shard_queues).get(shard_id, OWN_LINK)

    @property
    def sender_queued(self) -> bool:
        """Whether the stage charges its sends on its sender-side queues
        (:mod:`runtime.send_queues`) rather than each receiver pacing its own link."""
        return self.paced and bool(self.card_file)

    def allreduce_charge_s(self, nbytes: float) -> float:
        """Seconds the ring all-reduce of ``nbytes`` is charged (0 when not paced)."""
        return 0.0 if self.ring is None else allreduce_s(self.ring, nbytes, self.ring_size)


NO_LINKS = StageLinks()
"""Nothing paced: a real cluster, or a run with ``emulate=False``."""


def links_statement(cluster: Cluster, emulate: bool) -> str:
    """The run summary's line on links: the plan's link table, and whether (and by what
    factor) the run paced them (an emulated cluster run with ``emulate=True``)."""
    return cluster.links.describe(cluster.emulated and emulate)


def active_links(links: StageLinks, emulate: bool) -> StageLinks:
    """The links a stage paces to: its plan's, unless the run turned emulation off
    (``emulate=False``, ``--no-emulate``: nothing is paced)."""
    return links if emulate else NO_LINKS
