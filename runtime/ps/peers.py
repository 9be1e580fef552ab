"""Shard-to-shard clock reports of the eviction mode (``--on-failure continue``).

Each shard tells every other shard its VW clocks, which lost VWs are final there and each
VW's incarnation (:meth:`runtime.ps.core.ShardCore.report`) whenever that changes: one int64
message ``[clock of each VW..., final flag of each VW..., incarnation of each VW...]``. A shard applies a wave only once every
shard reported it complete, so a VW that dies between its pushes to two shards is left wholly
out of that wave at both (:meth:`runtime.ps.core.ShardCore.peer_report`).

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

__all__ = ["TAG_PEER", "PeerLink", "Report"]

Report = tuple[tuple[int, ...], tuple[bool, ...], tuple[int, ...]]  # clocks, finals, incarnations

log = logging.getLogger(__name__)

TAG_PEER = (
    7_000_006  # shard -> shard: int64 [VW clocks..., finals..., incarnations...] (ps.server's tags)
)
_FOREVER = datetime.timedelta(days=7)


class PeerLink:
    """This shard's clock reports to and from the other shards.

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
        self.peers, self.n_vws, self.group, self.deliver = dict(peers), n_vws, group, deliver
        self._last: Report | None = None
        self._sends: list[tuple[dist.Work, torch.Tensor]] = []

    def start(self) -> None:
        """One daemon reader thread per peer shard."""
        for sid, rank in self.peers.items():
            threading.Thread(
                target=self._read, args=(sid, rank), daemon=True, name=f"peer{sid}"
            ).start()

    def _read(self, sid: int, rank: int) -> None:
        n = self.n_vws
        try:
            while True:
                buf = torch.zeros(3 * n, dtype=torch.int64)
                work = dist.irecv(buf, src=rank, group=self.group, tag=TAG_PEER)
                if work is None:
                    return  # not in the group: no peer reports (a wiring bug, seen as a hang)
                work.wait(_FOREVER)
                vals = buf.tolist()
                report = (
                    tuple(vals[:n]),
                    tuple(bool(f) for f in vals[n : 2 * n]),
                    tuple(vals[2 * n :]),
                )
                self.deliver(sid, report)
        except RuntimeError as exc:  # the peer finished or died
            log.debug("reports from shard %d ended: %s", sid, str(exc).splitlines()[0][:200])

    def tell(self, report: Report) -> None:
        """Send ``report`` to every peer if it changed since the last one."""
        if report == self._last:
            return
        self._last = report
        msg = torch.tensor(
            [*report[0], *(int(f) for f in report[1]), *report[2]], dtype=torch.int64
        )
        self._sends = [(w, t) for w, t in self._sends if not w.is_completed()]
        for sid, rank in self.peers.items():
            try:
                work = dist.isend(msg, dst=rank, group=self.group, tag=TAG_PEER)
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
