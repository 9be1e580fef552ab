"""The stage side of the WSP parameter server: push wave updates, pull global weights.

A :class:`PSClient` belongs to one stage of one virtual worker (one rank). Its parameters
(the stage's partition) may live on several shards; for each shard it sends **one flat
message** per push or pull, holding exactly the shard's parameters this stage owns in shard
order. Pushes are asynchronous: :meth:`PSClient.push` posts the sends and an acknowledgement
receive and returns; acknowledgements are checked on the next call and in :meth:`flush`,
and a rejected push (duplicate tag, WSP violation) raises there. Pulls are synchronous
(:meth:`PSClient.pull`) or split (:meth:`PSClient.pull_async` then :meth:`PullHandle.wait`),
so a stage can keep computing while it waits for the global clock.

By default a pull returns the VW's *local copy* of the paper: the pulled global weights
(holding waves ``0..clock-1`` of every VW) plus this stage's own pushed updates of waves
``>= clock``, which the global weights do not include yet. Updates of the wave in progress
(not pushed yet) are the caller's business.

Any failure of the transport (a shard died, or did not answer within the timeout) raises
:class:`~profiler.errors.HetPipeRuntimeError` naming the shard and what was being done.

The client is built in layers: :class:`runtime.ps.links.ShardLinks` (shards, transport,
acknowledgements), :class:`runtime.ps.pull.PullingClient` (pulls), and :class:`PSClient`
(pushes, close).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from typing import overload

import torch

from profiler.errors import HetPipeRuntimeError
from runtime.ps.links import Message, Push
from runtime.ps.pull import PullHandle, PullingClient
from runtime.ps.wire import (
    HEADER_LEN,
    LAST_PUSH,
    NO_PULL,
    TAG_ACK,
    TAG_PUSH,
    TAG_REQUEST,
    Op,
    push_message,
)

__all__ = ["PSClient"]

log = logging.getLogger(__name__)


class PSClient(PullingClient):
    """Parameter-server client of stage ``stage`` of VW ``vw``.

    Args:
        vw, stage: who this client is (must appear in the shards' client lists).
        params: ``(name, shape)`` of the stage's parameters, in the order of the tensors
            given to :meth:`push` and returned by :meth:`pull`.
        shards: every shard's spec (shards this stage does not use are ignored).
        group: process group holding the shards and this rank (``None``: default group).
        timeout_s: longest wait for a push to be sent/acknowledged, in seconds.
        pull_timeout_s: longest wait for a pull (it may wait for slower VWs); default ``timeout_s``.
        paced: the emulated links to the shards (:mod:`runtime.link_pacing`): a push is
            sent when its link's charge has passed (by a thread: the stage goes on), a pull's
            :meth:`PullHandle.wait` returns when its charge has passed since it was posted
            (the push's and the pull's, for :meth:`push_pull`); default none.
        pace: the pacing's clock and wait (tests inject them).
    """

    # -------------------------------------------------------------- push
    def _checked(self, wave: int, updates: Sequence[torch.Tensor]) -> None:
        self._check_open()
        if wave in self._pushed:
            raise HetPipeRuntimeError(
                f"{self._prefix} wave {wave} was already pushed; each wave is pushed exactly once"
            )
        if len(updates) != len(self._shapes):
            raise HetPipeRuntimeError(
                f"{self._prefix} push of wave {wave} got {len(updates)} tensors, expected {len(self._shapes)}"
            )
        for i, (u, shape) in enumerate(zip(updates, self._shapes, strict=True)):
            if tuple(u.shape) != shape:
                raise HetPipeRuntimeError(
                    f"{self._prefix} push of wave {wave}: tensor {i} has shape {tuple(u.shape)}, expected {shape}"
                )

    def update_buffers(self) -> list[torch.Tensor]:
        """Tensors to compute the next push's update in (the constructor's order and shapes).

        They are views of the next push messages, so a caller that writes its update there
        (``torch.sub(p, snapshot, out=buf)``) and passes them to :meth:`push` or
        :meth:`push_pull` pays no packing copy: the message leaves as it is. Valid until that
        push; tensors other than these are packed (copied) as usual.
        """
        self._check_open()
        views: list[torch.Tensor | None] = [None] * len(self._shapes)
        for k, link in enumerate(self._links):
            msg = self._reserved[k]
            if msg is None:
                msg = self._reserved[k] = self._take_message(k)
            pos = 0
            for i in link.order:
                n = math.prod(self._shapes[i])
                views[i] = msg.payload[pos : pos + n].view(self._shapes[i])
                pos += n
        return [v if v is not None else torch.zeros(0) for v in views]

    def push(self, wave: int, updates: Sequence[torch.Tensor]) -> None:
        """Push this stage's aggregated update of ``wave`` (one message per shard, async).

        Args:
            wave: 0-based wave number; each wave is pushed once.
            updates: one tensor per parameter, in the constructor's order (added to the
                global weights as is: pass ``-lr * sum of gradients`` or the weight delta).

        Raises:
            HetPipeRuntimeError: ``wave`` already pushed, an earlier push was rejected, or a
                shard is unreachable.
        """
        self._push(wave, updates, None)

    def push_pull(
        self,
        wave: int,
        updates: Sequence[torch.Tensor],
        min_clock: int,
        include_own: bool = True,
        out: Sequence[torch.Tensor] | None = None,
    ) -> PullHandle:
        """:meth:`push` and :meth:`pull_async` in one message per shard.

        The pull request rides in the push message, so a wave's push and the pull that
        follows it cost one message and one rendezvous each way instead of two.
        """
        return self._push(wave, updates, (min_clock, include_own, out))

    @overload
    def _push(self, wave: int, updates: Sequence[torch.Tensor], pull: None) -> None: ...

    @overload
    def _push(
        self,
        wave: int,
        updates: Sequence[torch.Tensor],
        pull: tuple[int, bool, Sequence[torch.Tensor] | None],
    ) -> PullHandle: ...

    def _push(
        self,
        wave: int,
        updates: Sequence[torch.Tensor],
        pull: tuple[int, bool, Sequence[torch.Tensor] | None] | None,
    ) -> PullHandle | None:
        self._checked(wave, updates)
        if pull is not None:
            self._check_out(pull[2])
        self._check_acks(block=False)
        self._pushed.add(wave)
        # the pull's receives are posted before the push leaves: the shard's reply never waits
        posted = (
            [
                self._post_pull(k, pull[0], pull[2], self._links[k].numel * 4, wave)  # float32
                for k in range(len(self._links))
            ]
            if pull is not None
            else []
        )
        for k in self._push_order:
            link = self._links[k]
            msg = self._reserved[k] or self._take_message(k)
            self._reserved[k] = None
            base, pos = msg.payload.data_ptr(), 0
            for i in link.order:  # pack the shard's parameters in shard order into the message
                n, u = updates[i].numel(), updates[i]
                if u.data_ptr() != base + 4 * pos:  # not written in place (update_buffers)
                    msg.payload[pos : pos + n].copy_(u.detach().reshape(-1))
                pos += n
            self._own[k][wave] = msg
            seq = posted[k].seq if posted else 0
            self._send_message(k, wave, msg, pull[0] if pull is not None else NO_PULL, seq)
        if pull is None:
            return None
        return PullHandle(self, pull[0], pull[1], posted, pull[2])

    def _send_push(self, k: int, wave: int, flat: torch.Tensor) -> None:
        """Post one push of a ready flat update to shard ``k`` (no client-side duplicate check:
        tests use it to probe the ledger)."""
        msg = Message(*push_message(self._links[k].numel))
        msg.payload.copy_(flat)
        self._send_message(k, wave, msg, NO_PULL, 0)

    def _send_message(self, k: int, wave: int, msg: Message, pull: int, seq: int) -> None:
        link, what = self._links[k], f"push of wave {wave}"
        ack, ack_work = None, None  # a push with a pull: the pull's reply acknowledges it
        if pull == NO_PULL:
            ack = torch.zeros(HEADER_LEN, dtype=torch.int64)
            ack_work = self._irecv(link, ack, TAG_ACK, what)
        msg.header.copy_(torch.tensor([wave, pull, seq, 0], dtype=torch.int64))
        send = self._send_paced(k, msg, what)
        self._inflight.append(Push(k, wave, ack_work, ack, send, msg))

    # -------------------------------------------------------------- shutdown
    def close(self) -> None:
        """Flush pushes and tell every shard this stage is done (idempotent): a last push
        message ends the shard's push reader, then ``BYE`` its request reader."""
        if self._closed:
            return
        self.flush()
        for k, link in enumerate(self._links):
            msg = self._take_message(k)
            msg.header.copy_(torch.tensor([0, NO_PULL, 0, LAST_PUSH], dtype=torch.int64))
            work = self._isend(link, msg.message, TAG_PUSH, "close")
            self._wait(link, work, "close", self.timeout_s)
            bye = torch.tensor([int(Op.BYE), 0, 0, 0], dtype=torch.int64)
            self._wait(link, self._isend(link, bye, TAG_REQUEST, "close"), "close", self.timeout_s)
        self._closed = True
        self._delay.close()
        self._arrivals.close()
        log.debug("%s parameter-server client closed", self._prefix)
