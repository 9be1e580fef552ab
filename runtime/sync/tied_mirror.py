"""Tied parameters under WSP: one copy per VW talks to the parameter servers, the others follow.

A tied parameter (GPT-2's ``wte``/``lm_head``) is held by several stages of a VW, whose copies
take the same local step every minibatch (:class:`runtime.stage.tied.TiedGrads`). Towards the
parameter servers the VW holds it once: the *owner* (the stage of its first use, the one the
shard layout lists) pushes the wave's update and pulls the global weights; every other
holder (a *follower*) gets what the owner's pull changed, at the same point of its own
schedule, so the copies stay bit-identical:

- at each wave end the owner tells each follower what its pull does (a header
  ``[mode, version]`` on :data:`TAG`): ``NONE`` (no pull this wave), ``SET`` (a blocking
  pull set the master: the new values follow) or ``PENDING`` (an overlapped pull will be
  folded into ``version`` and later ones: the correction follows when the owner folds it);
- a follower folds a pending correction at the hook where its owner does
  (:meth:`runtime.sync.wave.WaveSync.before_forward` / ``before_update``), blocking on it.

The owner is the earliest holder, so it folds before it sends the activations (or waits
for the gradients) the follower needs to reach the same hook: the wait cannot deadlock.
Sends are asynchronous and completed at the next send or at :meth:`TiedMirror.close`.
"""

from __future__ import annotations

import datetime
from collections.abc import Mapping

import torch
import torch.distributed as dist
from torch import Tensor

from planner.wsp import local_version
from profiler.errors import HetPipeRuntimeError
from runtime.ps.wire import irecv, isend
from runtime.stage.tied import TiedGrads
from runtime.stage.weights import VersionedWeights

__all__ = ["TAG", "TiedMirror"]

TAG = 8_000_000  # far from the pipeline's and the parameter servers' tags
NONE, SET, PENDING, ADD = 0, 1, 2, 3


class TiedMirror:
    """One stage's side of keeping a VW's tied copies equal through WSP pulls.

    Args:
        tied: the stage's tied parameters (who owns which, who holds copies).
        weights: the stage's weight versions (a follower writes into them).
        timeout_s: longest wait for the owner's message.
    """

    def __init__(self, tied: TiedGrads, weights: VersionedWeights, timeout_s: float) -> None:
        self.weights, self.timeout_s = weights, timeout_s
        rank0 = tied.stage_rank0
        self.followers: dict[int, list[str]] = {}  # follower rank -> local names (owner side)
        self.owners: dict[int, list[str]] = {}  # owner rank -> local names (follower side)
        for name, where in tied.held.items():
            local = tied.local[name]
            if where.owner == tied.stage:
                for s in where.holders:
                    if s != tied.stage:
                        self.followers.setdefault(rank0 + s, []).append(local)
            else:
                self.owners.setdefault(rank0 + where.owner, []).append(local)
        self._works: list[dist.Work] = []
        self._pending: dict[int, int] = {}  # owner rank -> version a correction is due for

    @property
    def followed(self) -> set[str]:
        """Local names of the parameters this stage follows (not pushed or pulled by it)."""
        return {n for names in self.owners.values() for n in names}

    # ------------------------------------------------------------ owner side

    def _send(self, mode: int, version: int, values: Mapping[str, Tensor] | None) -> None:
        self._complete()
        for rank, names in self.followers.items():
            header = torch.tensor([mode, version], dtype=torch.int64)
            self._works.append(isend(header, rank, None, TAG))
            if values is None:
                continue
            for i, n in enumerate(names):
                payload = values[n].detach().to("cpu", copy=True).contiguous()  # gloo: host
                self._works.append(isend(payload, rank, None, TAG + 1 + i))

    def announce(self, pending_version: int | None) -> None:
        """Owner, at a wave end: no pull this wave (``None``) or one to fold into that version."""
        self._send(NONE if pending_version is None else PENDING, pending_version or 0, None)

    def send_set(self) -> None:
        """Owner, after a blocking pull set the master: the followers copy the new values."""
        if self.followers:
            self._send(SET, 0, self.weights.master)

    def send_add(self, corrections: Mapping[str, Tensor]) -> None:
        """Owner, after folding a pull: the same corrections for the followers' copies."""
        if self.followers:
            self._send(ADD, 0, corrections)

    def _complete(self) -> None:
        for work in self._works:
            work.wait(datetime.timedelta(seconds=self.timeout_s))
        self._works = []

    # ------------------------------------------------------------ follower side

    def _recv(self, rank: int) -> tuple[int, int]:
        header = torch.empty(2, dtype=torch.int64)
        self._wait(irecv(header, rank, None, TAG), rank)
        mode, version = int(header[0]), int(header[1])
        if mode in (SET, ADD):
            master = self.weights.master
            names = self.owners[rank]
            bufs = [torch.empty_like(master[n], device="cpu") for n in names]
            works = [irecv(b, rank, None, TAG + 1 + i) for i, b in enumerate(bufs)]
            for w in works:
                self._wait(w, rank)
            if mode == SET:
                with torch.no_grad():
                    for n, b in zip(names, bufs, strict=True):
                        master[n].data.copy_(b)
            else:
                self.weights.add_from(self._pending.pop(rank), dict(zip(names, bufs, strict=True)))
        return mode, version

    def _wait(self, work: dist.Work, rank: int) -> None:
        try:
            work.wait(datetime.timedelta(seconds=self.timeout_s))
        except RuntimeError as exc:
            raise HetPipeRuntimeError(
                f"tied parameters: no word from their owner stage (rank {rank}) in "
                f"{self.timeout_s:.0f} s ({str(exc).splitlines()[0][:120]})"
            ) from None

    def receive(self) -> None:
        """Follower, at a wave end (and at the start): what each owner's pull does."""
        for rank in self.owners:
            mode, version = self._recv(rank)
            if mode == PENDING:
                self._pending[rank] = version

    def before_forward(self, mb: int, nm: int) -> None:
        """Follower: fold a pending correction the forward of ``mb`` needs (as the owner does)."""
        for rank, version in list(self._pending.items()):
            if local_version(mb, nm) >= version:
                self._recv(rank)

    def before_update(self) -> None:
        """Follower with ``D = 0``: fold a pending correction before the next update."""
        for rank in list(self._pending):
            self._recv(rank)

    def close(self) -> None:
        """Complete the sends; a correction still pending is never sent (as for the owner)."""
        self._complete()
        self._pending.clear()
