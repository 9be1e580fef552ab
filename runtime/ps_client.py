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
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from profiler.errors import ConfigError, HetPipeRuntimeError
from runtime.ps import (
    HEADER_LEN,
    TAG_ACK,
    TAG_PULL_DATA,
    TAG_PULL_HEADER,
    TAG_PUSH_DATA,
    TAG_REQUEST,
    Op,
    ShardSpec,
    Status,
    irecv,
    isend,
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


class PullHandle:
    """A pull in flight; :meth:`wait` returns its :class:`PullResult`."""

    def __init__(
        self,
        client: PSClient,
        min_clock: int,
        include_own: bool,
        posted: list[tuple[dist.Work, dist.Work, torch.Tensor, torch.Tensor]],
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
        self._own: list[dict[int, torch.Tensor]] = [{} for _ in links]
        self._spare: list[list[torch.Tensor]] = [[] for _ in links]  # own buffers to reuse
        self._recv_spare: list[list[torch.Tensor]] = [[] for _ in links]  # pull(out=) buffers
        self._inflight: list[
            tuple[
                int,
                int,
                dist.Work,
                torch.Tensor,
                list[dist.Work],
                tuple[torch.Tensor, torch.Tensor],
            ]
        ] = []
        self._closed = False

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
    def push(self, wave: int, updates: Sequence[torch.Tensor]) -> None:
        """Push this stage's aggregated update of ``wave`` (one flat message per shard, async).

        Args:
            wave: 0-based wave number; each wave is pushed once.
            updates: one tensor per parameter, in the constructor's order (added to the
                global weights as is: pass ``-lr * sum of gradients`` or the weight delta).

        Raises:
            HetPipeRuntimeError: ``wave`` already pushed, an earlier push was rejected, or a
                shard is unreachable.
        """
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
        self._check_acks(block=False)
        self._pushed.add(wave)
        for k, link in enumerate(self._links):
            # one message per shard: its parameters in shard order, in a recycled buffer
            flat = self._spare[k].pop() if self._spare[k] else torch.empty(link.numel)
            pos = 0
            for i in link.order:
                n = updates[i].numel()
                flat[pos : pos + n].copy_(updates[i].detach().reshape(-1))
                pos += n
            self._own[k][wave] = flat
            self._send_push(k, wave, flat)

    def _send_push(self, k: int, wave: int, flat: torch.Tensor) -> None:
        """Post one push to shard ``k`` (no client-side duplicate check: tests use it to probe the ledger)."""
        link, what = self._links[k], f"push of wave {wave}"
        ack = torch.zeros(HEADER_LEN, dtype=torch.int64)
        ack_work = self._irecv(link, ack, TAG_ACK, what)
        hdr = torch.tensor([int(Op.PUSH), wave, 0, 0], dtype=torch.int64)
        sends = [
            self._isend(link, hdr, TAG_REQUEST, what),
            self._isend(link, flat, TAG_PUSH_DATA, what),
        ]
        self._inflight.append((k, wave, ack_work, ack, sends, (hdr, flat)))

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
            k, wave, ack_work, ack, sends, _ = self._inflight[0]
            link, what = self._links[k], f"push of wave {wave}"
            for w in sends:
                self._wait(link, w, what, self.timeout_s)
            self._wait(link, ack_work, f"{what} (acknowledgement)", self.timeout_s)
            self._inflight.pop(0)
            status = Status(int(ack[0]))
            if status != Status.OK:
                raise HetPipeRuntimeError(
                    f"{self._prefix} shard {link.spec.id} rejected the push of wave {wave}: {status.name} "
                    f"(global clock {int(ack[2])}); see the shard's log"
                )

    def flush(self) -> None:
        """Wait until every push was delivered and acknowledged.

        Raises:
            HetPipeRuntimeError: a push was rejected or a shard is unreachable.
        """
        self._check_acks(block=True)

    # -------------------------------------------------------------- pull
    def pull_async(
        self, min_clock: int, include_own: bool = True, out: Sequence[torch.Tensor] | None = None
    ) -> PullHandle:
        """Ask every shard for its weights once its global clock is ``>= min_clock``.

        Args:
            min_clock: the global clock needed (e.g. ``planner.wsp.required_global_clock``).
            include_own: add this stage's pushed updates the global weights do not hold yet.
            out: tensors (the constructor's order and shapes, e.g. the stage's parameters) to
                copy the result into when :meth:`PullHandle.wait` returns; they are untouched
                until then, and the message is received into a recycled buffer instead of a
                fresh one. ``None``: the result holds fresh tensors.
        """
        self._check_open()
        if out is not None and [tuple(t.shape) for t in out] != self._shapes:
            raise HetPipeRuntimeError(
                f"{self._prefix} pull(out=...) needs tensors of shapes {self._shapes}, got {[tuple(t.shape) for t in out]}"
            )
        self._check_acks(block=False)
        posted = []
        for k, link in enumerate(self._links):
            spare = self._recv_spare[k]
            data = spare.pop() if out is not None and spare else torch.empty(link.numel)
            hdr = torch.zeros(HEADER_LEN, dtype=torch.int64)
            what = f"pull of clock {min_clock}"
            w_hdr = self._irecv(link, hdr, TAG_PULL_HEADER, what)
            w_data = self._irecv(link, data, TAG_PULL_DATA, what)
            req = torch.tensor([int(Op.PULL), min_clock, 0, 0], dtype=torch.int64)
            self._wait(link, self._isend(link, req, TAG_REQUEST, what), what, self.timeout_s)
            posted.append((w_hdr, w_data, hdr, data))
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
        posted: list[tuple[dist.Work, dist.Work, torch.Tensor, torch.Tensor]],
        out: Sequence[torch.Tensor] | None = None,
    ) -> PullResult:
        result: list[torch.Tensor | None] = [None] * len(self._shapes)
        clocks = []
        for k, (link, (w_hdr, w_data, hdr, data)) in enumerate(
            zip(self._links, posted, strict=True)
        ):
            what = f"pull of clock {min_clock}"
            self._wait(link, w_hdr, what, self.pull_timeout_s)
            self._wait(link, w_data, what, self.timeout_s)
            clock = int(hdr[1])
            if int(hdr[0]) != Status.OK or clock < min_clock:
                raise HetPipeRuntimeError(
                    f"{self._prefix} shard {link.spec.id} answered the {what} with status {int(hdr[0])} at clock {clock}"
                )
            own = self._own[k]
            for w in sorted(own):
                if w < clock:  # folded into the global weights (so its send completed): recycle
                    spare = self._spare[k]
                    buf = own.pop(w)
                    if len(spare) < 2:
                        spare.append(buf)
                elif include_own:
                    data += own[w]
            clocks.append(clock)
            pos = 0
            for i in link.order:
                n = 1
                for d in self._shapes[i]:
                    n *= d
                piece = data[pos : pos + n].view(self._shapes[i])
                if out is not None:
                    with torch.no_grad():
                        out[i].copy_(piece)
                    result[i] = out[i]
                else:
                    result[i] = piece
                pos += n
            if out is not None and len(self._recv_spare[k]) < 2:
                self._recv_spare[k].append(data)
        tensors = tuple(t if t is not None else torch.zeros(0) for t in result)
        return PullResult(min(clocks) if clocks else min_clock, tuple(clocks), tensors)

    # -------------------------------------------------------------- shutdown
    def _check_open(self) -> None:
        if self._closed:
            raise HetPipeRuntimeError(f"{self._prefix} the parameter-server client is closed")

    def close(self) -> None:
        """Flush pushes and tell every shard this stage is done (idempotent)."""
        if self._closed:
            return
        self.flush()
        for link in self._links:
            bye = torch.tensor([int(Op.BYE), 0, 0, 0], dtype=torch.int64)
            self._wait(link, self._isend(link, bye, TAG_REQUEST, "close"), "close", self.timeout_s)
        self._closed = True
        log.debug("%s parameter-server client closed", self._prefix)
