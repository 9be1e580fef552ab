"""A shard's inbox: the events its threads read from clients and peer shards.

:class:`runtime.ps.server.ShardServer` owns the core on one thread; everything that arrives
(a client's push, pull or bye, a peer shard's report, the deciding shard's quorum) is read by
a daemon thread here and queued as an :class:`Event`.
"""

from __future__ import annotations

import datetime
import queue
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from profiler.errors import HetPipeRuntimeError
from runtime.ps.core import ShardCore
from runtime.ps.layout import ClientSpec
from runtime.ps.peers import TAG_QUORUM, IntLink, PeerLink, Report
from runtime.ps.wire import (
    HEADER_BYTES,
    HEADER_LEN,
    LAST_PUSH,
    NO_PULL,
    TAG_PUSH,
    TAG_REQUEST,
    Op,
    irecv,
    push_message,
)

__all__ = ["Event", "peer_link", "push_reader", "quorum_link", "request_reader", "wait"]


@dataclass(frozen=True)
class Event:
    kind: str  # push | pull | bye | error | last (no more pushes) | peer (a shard's report)
    #  | decision (backup workers: the deciding shard's quorum of wave ``arg``, in ``report[0]``)
    client: int
    arg: int = 0  # push: wave; pull: min clock; error: 1 from the push reader; peer: shard id
    message: torch.Tensor | None = None  # push: the whole message buffer (recycled)
    seq: int = 0  # pull: the client's pull number
    pull: int = NO_PULL  # push: the pull clock it carries
    error: str = ""
    report: Report = ((), (), ())  # peer: clocks, final flags, incarnations
    inc: int = 0  # the client's incarnation (restart mode): events of an older one are stale


_IDLE_FOREVER_S = (
    7 * 24 * 3600.0
)  # a gloo timeout closes the connection, so never time out idle readers


def wait(work: dist.Work, timeout_s: float) -> None:
    work.wait(datetime.timedelta(seconds=timeout_s))


def request_reader(
    idx: int, client: ClientSpec, events: queue.Queue[Event], group: Any, inc: int
) -> None:
    """Reads one client's standalone requests (``PULL``, ``BYE``) in order."""
    try:
        while True:
            hdr = torch.zeros(HEADER_LEN, dtype=torch.int64)
            wait(
                irecv(hdr, src=client.rank, group=group, tag=TAG_REQUEST),
                _IDLE_FOREVER_S,  # a client waiting on a pull is silent: hangs are judged in serve()
            )
            op = int(hdr[0])
            if op == Op.PULL:
                events.put(Event("pull", idx, int(hdr[1]), seq=int(hdr[2]), inc=inc))
            elif op == Op.BYE:
                events.put(Event("bye", idx, inc=inc))
                return
            else:
                events.put(Event("error", idx, error=f"unknown request op {op}", inc=inc))
                return
    except (RuntimeError, HetPipeRuntimeError) as exc:  # gloo: peer closed, or timeout
        events.put(Event("error", idx, error=str(exc).splitlines()[0][:300], inc=inc))


def push_reader(
    idx: int,
    client: ClientSpec,
    numel: int,
    free: queue.SimpleQueue[torch.Tensor],
    events: queue.Queue[Event],
    group: Any,
    inc: int,
) -> None:
    """Reads one client's push messages (``numel`` elements, buffers reused from ``free``)
    until its ``LAST_PUSH``: the receive is always posted, so a push is one message with no
    rendezvous wait."""
    try:
        while True:
            try:
                msg = free.get_nowait()
            except queue.Empty:
                msg = push_message(numel)[0]
            wait(irecv(msg, src=client.rank, group=group, tag=TAG_PUSH), _IDLE_FOREVER_S)
            wave, pull, seq, flags = msg[:HEADER_BYTES].view(torch.int64).tolist()
            if flags & LAST_PUSH:
                events.put(Event("last", idx, inc=inc))
                return
            events.put(Event("push", idx, wave, msg, seq=seq, pull=pull, inc=inc))
    except (RuntimeError, HetPipeRuntimeError) as exc:  # gloo: peer closed, or timeout
        events.put(Event("error", idx, 1, error=str(exc).splitlines()[0][:300], inc=inc))


def peer_link(
    peer_ranks: Mapping[int, int] | None, core: ShardCore, group: Any, events: queue.Queue[Event]
) -> PeerLink | None:
    """Eviction mode: the shard-to-shard reports, delivered as ``peer`` events."""
    if peer_ranks is None:
        return None

    def deliver(sid: int, report: Report) -> None:
        events.put(Event("peer", -1, sid, report=report))

    link = PeerLink(peer_ranks, len(core.spec.vws), group, deliver)
    link.start()
    link.tell(core.report())
    return link


def quorum_link(
    quorum_ranks: Mapping[int, int] | None, core: ShardCore, group: Any, events: queue.Queue[Event]
) -> IntLink | None:
    """Backup workers over several shards: the decider's quorum decisions, told to the
    other shards (``[wave, counted flag of each VW in spec.vws order]``), which get them
    as ``decision`` events (:mod:`runtime.ps.quorum`)."""
    if not quorum_ranks:
        return None
    vws = core.spec.vws

    def deliver(sid: int, values: tuple[int, ...]) -> None:
        counted = tuple(v for v, f in zip(vws, values[1:], strict=True) if f)
        events.put(Event("decision", -1, values[0], report=(counted, (), ())))

    link = IntLink(quorum_ranks, 1 + len(vws), group, deliver, TAG_QUORUM)
    if not core.decides:
        link.start()
    return link
