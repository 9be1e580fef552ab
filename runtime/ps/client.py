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
"""

from __future__ import annotations

import datetime
import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import overload

import torch
import torch.distributed as dist

from profiler.errors import ConfigError, HetPipeRuntimeError
from runtime.ps.core import Status
from runtime.ps.layout import ShardSpec
from runtime.ps.server import (
    HEADER_LEN,
    LAST_PUSH,
    NO_PULL,
    TAG_ACK,
    TAG_PULL_DATA,
    TAG_PULL_HEADER,
    TAG_PUSH,
    TAG_REQUEST,
    Op,
    irecv,
    isend,
    push_message,
)

__all__ = ["PSClient", "PullHandle", "PullResult"]

log = logging.getLogger(__name__)


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
class _Link:
    """This stage's view of one shard: which of its parameters go there, in shard order."""

    spec: ShardSpec
    order: tuple[int, ...]  # indices into the client's parameter list, in shard order
    numel: int


@dataclass(frozen=True)
class _Message:
    """A push message (uint8) and its int64 header and float32 payload views."""

    message: torch.Tensor
    header: torch.Tensor
    payload: torch.Tensor


@dataclass(frozen=True)
class _Push:
    """A push in flight: its send and the receive of its acknowledgement."""

    link: int
    wave: int
    ack_work: dist.Work
    ack: torch.Tensor
    send: dist.Work
    msg: _Message


@dataclass(frozen=True)
class _Posted:
    """One shard's reply to a pull, posted: header and data receives and their buffers."""

    w_hdr: dist.Work
    w_data: dist.Work
    hdr: torch.Tensor
    data: torch.Tensor
    direct: bool  # ``data`` aliases the caller's ``out`` tensors (no copy when it arrives)
    seq: int


def _flat_alias(tensors: Sequence[torch.Tensor]) -> torch.Tensor | None:
    """One flat float32 tensor aliasing ``tensors`` when they lie back to back in one storage
    in this order (a single contiguous parameter, or views of one flat buffer); else ``None``."""
    if not tensors or any(t.dtype != torch.float32 or not t.is_contiguous() for t in tensors):
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
        client: PSClient,
        min_clock: int,
        include_own: bool,
        posted: list[_Posted],
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


class PSClient:
    """Parameter-server client of stage ``stage`` of VW ``vw``.

    Args:
        vw, stage: who this client is (must appear in the shards' client lists).
        params: ``(name, shape)`` of the stage's parameters, in the order of the tensors
            given to :meth:`push` and returned by :meth:`pull`.
        shards: every shard's spec (shards this stage does not use are ignored).
        group: process group holding the shards and this rank (``None``: default group).
        timeout_s: longest wait for a push to be sent/acknowledged, in seconds.
        pull_timeout_s: longest wait for a pull (it may wait for slower VWs); default ``timeout_s``.
    """

    def __init__(
        self,
        vw: int,
        stage: int,
        params: Sequence[tuple[str, Sequence[int]]],
        shards: Sequence[ShardSpec],
        group: dist.ProcessGroup | None = None,
        timeout_s: float = 60.0,
        pull_timeout_s: float | None = None,
    ) -> None:
        self.vw, self.stage, self.group = vw, stage, group
        self.timeout_s = timeout_s
        self.pull_timeout_s = timeout_s if pull_timeout_s is None else pull_timeout_s
        self._shapes = [tuple(int(d) for d in shape) for _, shape in params]
        index = {name: i for i, (name, _) in enumerate(params)}
        links, seen = [], set()
        for spec in shards:
            try:
                me = spec.client(vw, stage)
            except KeyError:
                continue
            for n in me.params:
                if n not in index:
                    raise ConfigError(
                        f"shard {spec.id} expects parameter {n!r} from vw {vw} stage {stage}, which does not hold it"
                    )
                seen.add(n)
            links.append(_Link(spec, tuple(index[n] for n in me.params), spec.client_numel(me)))
        orphans = sorted(set(index) - seen)
        if orphans:
            raise ConfigError(
                f"vw {vw} stage {stage}: parameters {orphans} are on no parameter-server shard; fix the shard assignment"
            )
        self._links = tuple(links)
        self._prefix = (
            f"[vw {vw} | stage {stage} | rank {dist.get_rank() if dist.is_initialized() else '?'}]"
        )
        self._pushed: set[int] = set()
        # per shard: this stage's pushed updates not yet in the global weights (wave -> push
        # message; the local copy adds them), and spare push messages to reuse: fresh
        # multi-MB buffers cost page faults that are slower than the copy itself
        self._own: list[dict[int, _Message]] = [{} for _ in links]
        self._spare: list[list[_Message]] = [[] for _ in links]
        self._recv_spare: list[list[torch.Tensor]] = [[] for _ in links]  # pull(out=) buffers
        self._seq = [0] * len(links)  # pulls asked of each shard (replies come in this order)
        self._reserved: list[_Message | None] = [None] * len(links)  # from update_buffers()
        self._inflight: list[_Push] = []
        self._closed = False
        self.dropped: list[tuple[int, int]] = []  # (shard, wave): pushes a backup rule dropped

    @property
    def shards(self) -> tuple[ShardSpec, ...]:
        """The shards this stage talks to, in the order of :attr:`PullResult.clocks`."""
        return tuple(link.spec for link in self._links)

    # -------------------------------------------------------------- errors
    def _fail(self, link: _Link, what: str, exc: BaseException) -> HetPipeRuntimeError:
        text = str(exc).splitlines()[0][:200] if str(exc) else type(exc).__name__
        why = (
            "died (connection closed)"
            if "closed" in text or "reset" in text.lower()
            else f"did not answer ({text})"
        )
        return HetPipeRuntimeError(
            f"{self._prefix} parameter-server shard {link.spec.id} (rank {link.spec.rank}) {why} during {what}; "
            "stop the run and resume from the last checkpoint (hetpipe run --resume DIR)"
        )

    def _isend(self, link: _Link, tensor: torch.Tensor, tag: int, what: str) -> dist.Work:
        try:
            return isend(tensor, link.spec.rank, self.group, tag)
        except RuntimeError as exc:
            raise self._fail(link, what, exc) from None

    def _irecv(self, link: _Link, tensor: torch.Tensor, tag: int, what: str) -> dist.Work:
        try:
            return irecv(tensor, link.spec.rank, self.group, tag)
        except RuntimeError as exc:
            raise self._fail(link, what, exc) from None

    def _wait(self, link: _Link, work: dist.Work, what: str, timeout_s: float) -> None:
        try:
            work.wait(datetime.timedelta(seconds=timeout_s))
        except RuntimeError as exc:
            raise self._fail(link, what, exc) from None

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

    def _take_message(self, k: int) -> _Message:
        """A push message for shard ``k``: a recycled one, else a fresh one."""
        spare = self._spare[k]
        return spare.pop() if spare else _Message(*push_message(self._links[k].numel))

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
            [self._post_pull(k, pull[0], pull[2]) for k in range(len(self._links))]
            if pull is not None
            else []
        )
        for k, link in enumerate(self._links):
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
        msg = _Message(*push_message(self._links[k].numel))
        msg.payload.copy_(flat)
        self._send_message(k, wave, msg, NO_PULL, 0)

    def _send_message(self, k: int, wave: int, msg: _Message, pull: int, seq: int) -> None:
        link, what = self._links[k], f"push of wave {wave}"
        ack = torch.zeros(HEADER_LEN, dtype=torch.int64)
        ack_work = self._irecv(link, ack, TAG_ACK, what)
        msg.header.copy_(torch.tensor([wave, pull, seq, 0], dtype=torch.int64))
        send = self._isend(link, msg.message, TAG_PUSH, what)
        self._inflight.append(_Push(k, wave, ack_work, ack, send, msg))

    def _check_acks(self, block: bool) -> None:
        """Retire acknowledged pushes (in order); raise on the first rejected one.

        ``block=False`` keeps only the newest two waves' pushes (per shard) in flight and waits
        for the older ones: gloo's ``Work.is_completed()`` stays ``False`` until ``wait()`` is
        called, so it cannot be polled, and a shard acknowledges a push as soon as it reads
        it, so those waits return at once. This bounds the buffers held and surfaces a rejected
        push within two waves.
        """
        keep = 0 if block else 2 * len(self._links)
        while len(self._inflight) > keep:
            push = self._inflight[0]
            link, what = self._links[push.link], f"push of wave {push.wave}"
            self._wait(link, push.send, what, self.timeout_s)
            self._wait(link, push.ack_work, f"{what} (acknowledgement)", self.timeout_s)
            self._inflight.pop(0)
            status = Status(int(push.ack[0]))
            if status == Status.DROPPED:  # backup workers: the wave closed without this VW
                self.dropped.append((link.spec.id, push.wave))
                continue
            if status != Status.OK:
                raise HetPipeRuntimeError(
                    f"{self._prefix} shard {link.spec.id} rejected the push of wave {push.wave}: {status.name} "
                    f"(global clock {int(push.ack[2])}); see the shard's log"
                )

    def flush(self) -> None:
        """Wait until every push was delivered and acknowledged.

        Raises:
            HetPipeRuntimeError: a push was rejected or a shard is unreachable.
        """
        self._check_acks(block=True)

    # -------------------------------------------------------------- pull
    def _check_out(self, out: Sequence[torch.Tensor] | None) -> None:
        if out is not None and [tuple(t.shape) for t in out] != self._shapes:
            raise HetPipeRuntimeError(
                f"{self._prefix} pull(out=...) needs tensors of shapes {self._shapes}, got {[tuple(t.shape) for t in out]}"
            )

    def _post_pull(self, k: int, min_clock: int, out: Sequence[torch.Tensor] | None) -> _Posted:
        """Post the receives of shard ``k``'s reply to this client's next pull."""
        link, what = self._links[k], f"pull of clock {min_clock}"
        direct = _flat_alias([out[i] for i in link.order]) if out is not None else None
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
        return _Posted(w_hdr, w_data, hdr, data, direct is not None, seq)

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
        posted: list[_Posted],
        out: Sequence[torch.Tensor] | None = None,
    ) -> PullResult:
        result: list[torch.Tensor | None] = [None] * len(self._shapes)
        clocks = []
        for k, (link, post) in enumerate(zip(self._links, posted, strict=True)):
            what = f"pull of clock {min_clock}"
            self._wait(link, post.w_hdr, what, self.pull_timeout_s)
            self._wait(link, post.w_data, what, self.timeout_s)
            hdr, data = post.hdr, post.data
            clock = int(hdr[1])
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
            if out is not None and not post.direct and len(self._recv_spare[k]) < 2:
                self._recv_spare[k].append(data)
        tensors = tuple(t if t is not None else torch.zeros(0) for t in result)
        return PullResult(min(clocks) if clocks else min_clock, tuple(clocks), tensors)

    # -------------------------------------------------------------- shutdown
    def _check_open(self) -> None:
        if self._closed:
            raise HetPipeRuntimeError(f"{self._prefix} the parameter-server client is closed")

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
        log.debug("%s parameter-server client closed", self._prefix)
