"""Shard-to-shard messages: fixed-width int64 vectors, one reader thread per peer.

Two uses, each on its own tag:

- eviction mode (``--on-failure continue``, ``TAG_PEER``): each shard tells every other shard
  its VW clocks and which lost VWs are final there (:meth:`runtime.ps.core.ShardCore.report`)
  whenever that changes: ``[clock of each VW..., final flag of each VW...]``. A shard applies
  a wave only once every shard reported it complete, so a VW that dies between its pushes to
  two shards is left wholly out of that wave at both
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

__all__ = ["TAG_PEER", "TAG_QUORUM", "PeerLink"]

log = logging.getLogger(__name__)

TAG_PEER = 7_000_006  # shard -> shard: int64 [VW clocks..., final flags...] (beside ps.wire's)
TAG_QUORUM = 7_000_007  # deciding shard -> others: int64 [wave, counted flag of each VW...]
_FOREVER = datetime.timedelta(days=7)


class PeerLink:
    """This shard's messages to and from the other shards.

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
        tag: int = TAG_PEER,
    ) -> None:
        self.peers, self.width, self.group, self.deliver = dict(peers), width, group, deliver
        self.tag = tag
        self._last: tuple[int, ...] | None = None
        self._sends: list[tuple[dist.Work, torch.Tensor]] = []

    def start(self) -> None:
        """One daemon reader thread per peer shard (a shard that only sends needs none)."""
        for sid, rank in self.peers.items():
            threading.Thread(
                target=self._read, args=(sid, rank), daemon=True, name=f"peer{sid}"
            ).start()

    def _read(self, sid: int, rank: int) -> None:
        try:
            while True:
                buf = torch.zeros(self.width, dtype=torch.int64)
                work = dist.irecv(buf, src=rank, group=self.group, tag=self.tag)
                if work is None:
                    return  # not in the group: no peer reports (a wiring bug, seen as a hang)
                work.wait(_FOREVER)
                self.deliver(sid, tuple(buf.tolist()))
        except RuntimeError as exc:  # the peer finished or died
            log.debug("reports from shard %d ended: %s", sid, str(exc).splitlines()[0][:200])

    def tell(self, values: tuple[int, ...]) -> None:
        """Send ``values`` (``width`` of them) to every peer if they changed since the last."""
        if values == self._last:
            return
        self._last = values
        msg = torch.tensor(values, dtype=torch.int64)
        self._sends = [(w, t) for w, t in self._sends if not w.is_completed()]
        for sid, rank in self.peers.items():
            try:
                work = dist.isend(msg, dst=rank, group=self.group, tag=self.tag)
                if work is not None:
                    self._sends.append((work, msg))
            except RuntimeError as exc:
                log.debug("report to shard %d not sent: %s", sid, str(exc).splitlines()[0][:200])

    def drain(self, timeout_s: float) -> None:
        """Wait for the reports in flight (before the shard exits); failures are logged."""
        for work, _ in self._sends:
            try:
                work.wait(datetime.timedelta(seconds=timeout_s))
            except RuntimeError as exc:
                log.debug("a report was not delivered: %s", str(exc).splitlines()[0][:200])
        self._sends = []
