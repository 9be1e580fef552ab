"""The parameter server's wire protocol: message tags, headers, the push message, send/recv.

A client and a shard exchange torch.distributed point-to-point messages (gloo) on tags far
from the pipeline's. A push is one message: an int64 header then the float32 update
(:func:`push_message`); it may carry the client's next pull request. Standalone requests
(``PULL``, ``BYE``) travel on ``TAG_REQUEST``; a pull is answered by a header and the
client's flat slice of the weights. A push that carries no pull is acknowledged on ``TAG_ACK``;
one that carries a pull is acknowledged by that pull's reply header (its status rides there),
which saves a message, a posted receive and a wake-up of the client per shard per wave.
"""

from __future__ import annotations

from enum import IntEnum
from typing import Any

import torch
import torch.distributed as dist

from profiler.errors import HetPipeRuntimeError

__all__ = ["Op", "irecv", "isend", "one_message_pull", "pull_message", "push_message"]

TAG_BASE = 7_000_000  # far from any tag the pipeline runtime uses between stages
TAG_REQUEST = TAG_BASE + 1  # client -> shard: int64 [op, arg, seq, 0] (PULL, BYE)
TAG_PUSH = TAG_BASE + 2  # client -> shard: one push message, see push_message()
TAG_ACK = TAG_BASE + 3  # shard -> client: int64 [status, wave, global clock, 0] per push
TAG_PULL_HEADER = TAG_BASE + 4  # shard -> client: int64 [status, global clock, push, seq]
# (push: the status of the push the pull rode on, which gets no TAG_ACK; NO_PUSH: none)
TAG_PULL_DATA = TAG_BASE + 5  # shard -> client: the client's flat slice of the weights
HEADER_LEN = 4
HEADER_BYTES = HEADER_LEN * 8
NO_PULL = -1  # a push header's pull clock when the push asks for no pull
NO_PUSH = -1  # a pull header's push status when the pull came alone (not riding on a push)
ONE_MESSAGE_PULL_BYTES = 1 << 20  # a pull reply of at most this payload is one message


def one_message_pull(numel: int) -> bool:
    """Whether the reply to a pull of ``numel`` float32 values is **one** message on
    ``TAG_PULL_HEADER`` (the header, then the values: :func:`pull_message`) instead of a
    header and a payload on ``TAG_PULL_DATA``. Small replies go as one: a message costs a
    posted receive and a wake-up of the stage's process, more than the shard's copy of a
    small slice; large ones go as two, sent straight from the global weights (no copy)."""
    return 4 * numel <= ONE_MESSAGE_PULL_BYTES


def pull_message(numel: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A one-message pull reply buffer: ``(message, header, payload)`` views, laid out like
    :func:`push_message` (an int64 header of ``HEADER_LEN`` values, then float32 values)."""
    return push_message(numel)


LAST_PUSH = 1  # push header flag: no more pushes follow (the client is closing), no update


class Op(IntEnum):
    """Request kinds a client sends on ``TAG_REQUEST`` (pushes have their own tag)."""

    PULL = 2  # arg = minimum global clock, seq = the client's pull number
    BYE = 3  # the client is done; no more requests follow


def push_message(numel: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A push message buffer: ``(message, header, payload)``.

    One push is **one** gloo message of ``HEADER_BYTES + 4 * numel`` bytes: an int64 header
    ``[wave, pull clock or NO_PULL, pull seq, flags]`` followed by the float32 update. ``header`` and
    ``payload`` are views of ``message`` (uint8), so filling the payload in place is the only copy
    a push needs, and a push can carry the client's next pull request (saving a message and a
    rendezvous on the critical path of a wave).
    """
    msg = torch.empty(HEADER_BYTES + 4 * numel, dtype=torch.uint8)
    return msg, msg[:HEADER_BYTES].view(torch.int64), msg[HEADER_BYTES:].view(torch.float32)


def isend(tensor: torch.Tensor, dst: int, group: Any, tag: int) -> dist.Work:
    """``dist.isend`` that never returns ``None`` (which means this rank is not in ``group``).

    ``group``: ``None`` (the default group) or a group numbered like the world (a restarted
    VW's, :mod:`runtime.ps.rejoin`): ``dst`` is the global rank either way."""
    work = (
        dist.isend(tensor, dst=dst, group=group, tag=tag)
        if group is None
        else dist.isend(tensor, group=group, group_dst=dst, tag=tag)
    )
    if work is None:
        raise HetPipeRuntimeError(
            f"this rank is not in the parameter-server process group (send to rank {dst})"
        )
    return work


def irecv(tensor: torch.Tensor, src: int, group: Any, tag: int) -> dist.Work:
    """``dist.irecv`` that never returns ``None`` (which means this rank is not in ``group``);
    ``group`` as in :func:`isend`."""
    work = (
        dist.irecv(tensor, src=src, group=group, tag=tag)
        if group is None
        else dist.irecv(tensor, group=group, group_src=src, tag=tag)
    )
    if work is None:
        raise HetPipeRuntimeError(
            f"this rank is not in the parameter-server process group (recv from rank {src})"
        )
    return work
