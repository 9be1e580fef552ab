"""The pull half of a parameter-server client: ask the shards for weights, receive them.

Pulls are synchronous (:meth:`PullingClient.pull`) or split (:meth:`PullingClient.pull_async`
then :meth:`PullHandle.wait`), so a stage can keep computing while it waits for the global
clock. By default a pull returns the VW's *local copy* of the paper: the pulled global weights
(holding waves ``0..clock-1`` of every VW) plus this stage's own pushed updates of waves
``>= clock``, which the global weights do not include yet.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from profiler.errors import HetPipeRuntimeError
from runtime.link_pacing import Arrival
from runtime.ps.links import ShardLinks
from runtime.ps.outcome import Status
from runtime.ps.wire import (
    HEADER_LEN,
    NO_PULL,
    TAG_PULL_DATA,
    TAG_PULL_HEADER,
    TAG_REQUEST,
    Op,
    one_message_pull,
    pull_message,
)

__all__ = ["PullHandle", "PullResult", "PullingClient"]


@dataclass(frozen=True)
class PullResult:
    """Weights returned by a pull.

    Attributes:
        clock: the smallest of the shards' global clocks at reply time (``>=`` the request).
        clocks: each shard's global clock, in the order of :attr:`PSClient.shards`.
        tensors: the stage's parameters, in the order given to :class:`PSClient`.
    """

    clock: int
    clocks: tuple[int, ...]
    tensors: tuple[torch.Tensor, ...]


@dataclass(frozen=True)
class Posted:
    """One shard's reply to a pull, posted: header and data receives and their buffers."""

    w_hdr: dist.Work | Arrival  # an Arrival on an emulated link: when the reply came
    w_data: dist.Work | None  # None: a one-message reply (``hdr`` and ``data`` are its views)
    hdr: torch.Tensor
    data: torch.Tensor
    direct: bool  # ``data`` aliases the caller's ``out`` tensors (no copy when it arrives)
    seq: int
    start_s: float = 0.0  # when it was posted (clock seconds)
    push_s: float = 0.0  # the emulated link's charge of the push it rides on (0: none)
    pull_s: float = 0.0  # the emulated link's charge of the reply (0: not paced)
    rides: int = NO_PULL  # the wave of the push it rides on, acknowledged by the reply


def flat_alias(tensors: Sequence[torch.Tensor]) -> torch.Tensor | None:
    """One flat float32 tensor aliasing ``tensors`` when they lie back to back in one storage
    in this order (a single contiguous parameter, or views of one flat buffer) in host memory
    (the wire's); else ``None``."""
    if not tensors or any(
        t.dtype != torch.float32 or not t.is_contiguous() or t.device.type != "cpu" for t in tensors
    ):
        return None
    first = tensors[0]
    storage, ptr = first.untyped_storage(), first.data_ptr()
    for t in tensors:
        if t.untyped_storage().data_ptr() != storage.data_ptr() or t.data_ptr() != ptr:
            return None
        ptr += t.numel() * 4
    total = sum(t.numel() for t in tensors)
    return torch.empty(0, dtype=torch.float32).set_(storage, first.storage_offset(), (total,), (1,))


class PullHandle:
    """A pull in flight; :meth:`wait` returns its :class:`PullResult`."""

    def __init__(
        self,
        client: PullingClient,
        min_clock: int,
        include_own: bool,
        posted: list[Posted],
        out: Sequence[torch.Tensor] | None = None,
    ) -> None:
        self._client, self._min, self._own, self._posted = client, min_clock, include_own, posted
        self._out = out
        self._result: PullResult | None = None

    def wait(self) -> PullResult:
        """Block until every shard answered (at most the client's pull timeout per shard)."""
        if self._result is None:
            self._result = self._client._finish_pull(self._min, self._own, self._posted, self._out)
        return self._result


class PullingClient(ShardLinks):
    """A :class:`ShardLinks` that pulls; :class:`runtime.ps.client.PSClient` adds the pushes."""

    def _check_out(self, out: Sequence[torch.Tensor] | None) -> None:
        if out is not None and [tuple(t.shape) for t in out] != self._shapes:
            raise HetPipeRuntimeError(
                f"{self._prefix} pull(out=...) needs tensors of shapes {self._shapes}, got {[tuple(t.shape) for t in out]}"
            )

    def _post_pull(
        self,
        k: int,
        min_clock: int,
        out: Sequence[torch.Tensor] | None,
        push_bytes: int = 0,
        rides: int = NO_PULL,
    ) -> Posted:
        """Post the receives of shard ``k``'s reply to this client's next pull (riding on the
        push of wave ``rides`` of ``push_bytes``, charged before the reply on an emulated
        link; :data:`NO_PULL`: on none)."""
        link, what = self._links[k], f"pull of clock {min_clock}"
        start = self._pace.clock()
        w_data: dist.Work | None = None
        if one_message_pull(link.numel):  # header and values in one message: one receive
            msg, hdr, data = pull_message(link.numel)
            direct = None
            w_hdr: dist.Work | Arrival = self._irecv(link, msg, TAG_PULL_HEADER, what)
        else:
            direct = flat_alias([out[i] for i in link.order]) if out is not None else None
            if direct is not None:
                data = direct  # the reply lands in the caller's tensors: no copy
            else:
                spare = self._recv_spare[k]
                data = spare.pop() if out is not None and spare else torch.empty(link.numel)
            hdr = torch.zeros(HEADER_LEN, dtype=torch.int64)
            w_hdr = self._irecv(link, hdr, TAG_PULL_HEADER, what)
            w_data = self._irecv(link, data, TAG_PULL_DATA, what)
        seq = self._seq[k]
        self._seq[k] += 1
        push_s = self._charge_s(k, push_bytes)
        pull_s = self._charge_s(k, data.numel() * data.element_size())
        if pull_s > 0:  # an emulated link: learn when the reply arrives, even if waited late
            w_hdr = Arrival(w_hdr, self._arrivals, self._pace)
        return Posted(
            w_hdr, w_data, hdr, data, direct is not None, seq, start, push_s, pull_s, rides
        )

    def _pace_pull(self, posted: Sequence[Posted]) -> None:
        """On an emulated link: return no sooner than the shards' pushes and replies, one after
        another, took since the pull was posted, nor than the replies took since the last one
        arrived (a reply the global clock held back is charged from then, as simulated)."""
        pull_s = sum(p.pull_s for p in posted)
        if not posted or pull_s <= 0:
            return
        start = min(p.start_s for p in posted)
        arrived = max(p.w_hdr.arrived_s for p in posted if isinstance(p.w_hdr, Arrival))
        deadline = max(start + sum(p.push_s for p in posted) + pull_s, arrived + pull_s)
        self._pace.since(start, deadline - start)

    def pull_async(
        self, min_clock: int, include_own: bool = True, out: Sequence[torch.Tensor] | None = None
    ) -> PullHandle:
        """Ask every shard for its weights once its global clock is ``>= min_clock``.

        Args:
            min_clock: the global clock needed (e.g. ``planner.wsp.required_global_clock``).
            include_own: add this stage's pushed updates the global weights do not hold yet.
            out: tensors (the constructor's order and shapes, e.g. the stage's parameters) that
                receive the result. When a shard's tensors lie back to back in one storage (one
                flat tensor, or views of one flat buffer) its reply is received straight into
                them, **possibly before** :meth:`PullHandle.wait`: do not read them in between.
                Otherwise the reply is received into a recycled buffer and copied at ``wait``.
                ``None``: the result holds fresh tensors.
        """
        self._check_open()
        self._check_out(out)
        self._check_acks(block=False)
        posted = []
        for k, link in enumerate(self._links):
            post = self._post_pull(k, min_clock, out)
            what = f"pull of clock {min_clock}"
            req = torch.tensor([int(Op.PULL), min_clock, post.seq, 0], dtype=torch.int64)
            self._wait(link, self._isend(link, req, TAG_REQUEST, what), what, self.timeout_s)
            posted.append(post)
        return PullHandle(self, min_clock, include_own, posted, out)

    def pull(
        self, min_clock: int, include_own: bool = True, out: Sequence[torch.Tensor] | None = None
    ) -> PullResult:
        """:meth:`pull_async` and wait: the stage's weights at global clock ``>= min_clock``."""
        return self.pull_async(min_clock, include_own, out).wait()

    def _finish_pull(
        self,
        min_clock: int,
        include_own: bool,
        posted: list[Posted],
        out: Sequence[torch.Tensor] | None = None,
    ) -> PullResult:
        result: list[torch.Tensor | None] = [None] * len(self._shapes)
        clocks = []
        for k, (link, post) in enumerate(zip(self._links, posted, strict=True)):
            what = f"pull of clock {min_clock}"
            self._wait(link, post.w_hdr, what, self.pull_timeout_s)
            if post.w_data is not None:
                self._wait(link, post.w_data, what, self.timeout_s)
            hdr, data = post.hdr, post.data
            clock = int(hdr[1])
            if post.rides != NO_PULL:  # the reply acknowledges the push the pull rode on
                self._acknowledged(k, post.rides, int(hdr[2]), clock)
            if int(hdr[0]) != Status.OK or clock < min_clock or int(hdr[3]) != post.seq:
                raise HetPipeRuntimeError(
                    f"{self._prefix} shard {link.spec.id} answered the {what} (pull {post.seq}) "
                    f"with status {int(hdr[0])} at clock {clock} for pull {int(hdr[3])}"
                )
            own = self._own[k]
            with torch.no_grad():
                for w in sorted(own):
                    if w < clock:  # folded into the global weights (so its send completed)
                        msg = own.pop(w)
                        if len(self._spare[k]) < 2:
                            self._spare[k].append(msg)
                    elif include_own:
                        data += own[w].payload
            clocks.append(clock)
            pos = 0
            for i in link.order:
                n = math.prod(self._shapes[i])
                piece = data[pos : pos + n].view(self._shapes[i])
                if out is not None:
                    if post.direct:  # written behind autograd's back: mark the tensor changed
                        torch.autograd.graph.increment_version(out[i])
                    else:
                        with torch.no_grad():
                            out[i].copy_(piece)
                    result[i] = out[i]
                else:
                    result[i] = piece
                pos += n
            if (
                out is not None
                and post.w_data is not None
                and not post.direct
                and len(self._recv_spare[k]) < 2
            ):
                self._recv_spare[k].append(data)
        self._pace_pull(posted)
        tensors = tuple(t if t is not None else torch.zeros(0) for t in result)
        return PullResult(min(clocks) if clocks else min_clock, tuple(clocks), tensors)
