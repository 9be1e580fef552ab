"""Shard-to-shard messages: fixed-width int64 vectors on a tag, one reader thread per peer.

Two uses, each on its own tag (:class:`IntLink` is the transport):

- eviction mode (``--on-failure continue``, :class:`PeerLink`, ``TAG_PEER``): each shard tells
  every other shard its VW clocks, which lost VWs are final there and each VW's incarnation
  (:meth:`runtime.ps.core.ShardCore.report`) whenever that changes: one int64 message
  ``[clock of each VW..., final flag of each VW..., incarnation of each VW...]``. A shard
  applies a wave only once every shard reported it complete, so a VW that dies between its
  pushes to two shards is left wholly out of that wave at both
  (:meth:`runtime.ps.core.ShardCore.peer_report`);
- backup workers (``TAG_QUORUM``): the deciding shard tells the others which VWs each wave
  counts, ``[wave, counted flag of each VW...]`` (:mod:`runtime.ps.quorum`); only the others
  listen.

A send to a shard that already finished (it served every client and exited) fails; that is
harmless (it needs nothing more), so send failures are logged, not raised: a shard that
*died* ends the whole run through the launcher.
"""

from __future__ import annotations

import datetime
import logging
import threading
from collections.abc import Callable, Mapping

import torch
import torch.distributed as dist

__all__ = ["MAX_PENDING_SENDS", "TAG_PEER", "TAG_QUORUM", "IntLink", "PeerLink", "Report"]

Report = tuple[tuple[int, ...], tuple[bool, ...], tuple[int, ...]]  # clocks, finals, incarnations

log = logging.getLogger(__name__)

TAG_PEER = 7_000_006  # shard -> shard: int64 [VW clocks..., finals..., incarnations...]
TAG_QUORUM = 7_000_007  # deciding shard -> others: int64 [wave, counted flag of each VW...]
_FOREVER = datetime.timedelta(days=7)
MAX_PENDING_SENDS = 8  # messages a link keeps in flight before it waits on the oldest


class IntLink:
    """This shard's fixed-width int64 messages on one tag, to and from other shards.

    Args:
        peers: shard id -> rank of every other shard it talks to.
        width: int64 values per message.
        group: the process group (``None``: the default one).
        deliver: called from a reader thread with ``(shard id, values)`` per message.
        tag: the messages' tag (``TAG_PEER``, ``TAG_QUORUM``).
    """

    def __init__(
        self,
        peers: Mapping[int, int],
        width: int,
        group: dist.ProcessGroup | None,
        deliver: Callable[[int, tuple[int, ...]], None],
        tag: int,
    ) -> None:
        self.peers, self.width, self.group, self.deliver = dict(peers), width, group, deliver
        self.tag = tag
        self._last: tuple[int, ...] | None = None
        self._sends: list[tuple[dist.Work, torch.Tensor]] = []

    def start(self) -> None:
        """One daemon reader thread per peer shard (a shard that only sends needs none)."""
        for sid, rank in self.peers.items():
            threading.Thread(
                target=self._read, args=(sid, rank), daemon=True, name=f"peer{sid}-{self.tag}"
            ).start()

    def _read(self, sid: int, rank: int) -> None:
        try:
            while True:
                buf = torch.zeros(self.width, dtype=torch.int64)
                work = dist.irecv(buf, src=rank, group=self.group, tag=self.tag)
                if work is None:
                    return  # not in the group: no peer messages (a wiring bug, seen as a hang)
                work.wait(_FOREVER)
                self.deliver(sid, tuple(buf.tolist()))
        except RuntimeError as exc:  # the peer finished or died
            log.debug("messages from shard %d ended: %s", sid, str(exc).splitlines()[0][:200])

    def tell(self, values: tuple[int, ...]) -> None:
        """Send ``values`` (``width`` of them) to every peer if they changed since the last."""
        if values == self._last:
            return
        self._last = values
        msg = torch.tensor(values, dtype=torch.int64)
        self._prune()
        for sid, rank in self.peers.items():
            try:
                work = dist.isend(msg, dst=rank, group=self.group, tag=self.tag)
                if work is not None:
                    self._sends.append((work, msg))
            except RuntimeError as exc:
                log.debug("message to shard %d not sent: %s", sid, str(exc).splitlines()[0][:200])

    def _prune(self) -> None:
        """Retire the oldest sends by waiting on them, keeping at most ``MAX_PENDING_SENDS``.

        gloo's ``Work.is_completed()`` stays ``False`` until ``wait()`` is called, so polling it
        retired nothing: a shard under ``--on-failure restart|continue`` kept every report it
        ever sent (a Work and a tensor per peer per clock change, about 1 MB/s of resident
        memory in the soak). The peers' reader threads always post the next receive, so an
        old send is complete and its ``wait`` returns at once; a dead peer's fails (logged).
        """
        while len(self._sends) > MAX_PENDING_SENDS:
            work, _ = self._sends.pop(0)
            try:
                work.wait()  # the group's timeout
            except RuntimeError as exc:
                log.debug("a message was not delivered: %s", str(exc).splitlines()[0][:200])

    def drain(self, timeout_s: float) -> None:
        """Wait for the messages in flight (before the shard exits); failures are logged."""
        for work, _ in self._sends:
            try:
                work.wait(datetime.timedelta(seconds=timeout_s))
            except RuntimeError as exc:
                log.debug("a message was not delivered: %s", str(exc).splitlines()[0][:200])
        self._sends = []


class PeerLink:
    """This shard's eviction reports (:data:`Report`) to and from the other shards.

    Args:
        peers: shard id -> rank of every other shard.
        n_vws: VWs in a report.
        group: the process group (``None``: the default one).
        deliver: called from a reader thread with ``(shard id, report)`` per report.
    """

    def __init__(
        self,
        peers: Mapping[int, int],
        n_vws: int,
        group: dist.ProcessGroup | None,
        deliver: Callable[[int, Report], None],
    ) -> None:
        n = n_vws

        def decode(sid: int, vals: tuple[int, ...]) -> None:
            deliver(sid, (vals[:n], tuple(bool(f) for f in vals[n : 2 * n]), vals[2 * n :]))

        self.link = IntLink(peers, 3 * n, group, decode, TAG_PEER)

    def start(self) -> None:
        """One daemon reader thread per peer shard."""
        self.link.start()

    def tell(self, report: Report) -> None:
        """Send ``report`` to every peer if it changed since the last one."""
        self.link.tell((*report[0], *(int(f) for f in report[1]), *report[2]))

    def drain(self, timeout_s: float) -> None:
        """Wait for the reports in flight (before the shard exits); failures are logged."""
        self.link.drain(timeout_s)
