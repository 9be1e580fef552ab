"""A parameter-server client's connections to its shards: which parameters go where, the
transport and its errors, and the acknowledgements of pushes in flight.

:class:`ShardLinks` is the base of :class:`runtime.ps.client.PSClient` (through
:class:`runtime.ps.pull.PullingClient`); see there for the protocol. Any failure of the
transport (a shard died, or did not answer within the timeout) raises
:class:`~profiler.errors.HetPipeRuntimeError` naming the shard and what was being done.
"""

from __future__ import annotations

import datetime
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from planner.cluster import OWN_LINK
from profiler.errors import ConfigError, HetPipeRuntimeError
from runtime.link_pacing import (
    NO_LINKS,
    REAL_PACE,
    Arrival,
    ArrivalWatcher,
    DelayedWork,
    DelayLine,
    LocalQueue,
    Pace,
    StageLinks,
)
from runtime.ps.layout import ShardSpec
from runtime.ps.outcome import Status
from runtime.ps.wire import TAG_PUSH, irecv, isend, push_message
from runtime.send_queues import SendQueues

__all__ = ["Link", "Message", "Push", "ShardLinks"]


@dataclass(frozen=True)
class Link:
    """This stage's view of one shard: which of its parameters go there, in shard order."""

    spec: ShardSpec
    order: tuple[int, ...]  # indices into the client's parameter list, in shard order
    numel: int


@dataclass(frozen=True)
class Message:
    """A push message (uint8) and its int64 header and float32 payload views."""

    message: torch.Tensor
    header: torch.Tensor
    payload: torch.Tensor


@dataclass(frozen=True)
class Push:
    """A push in flight: its send and the receive of its acknowledgement (``None``: the push
    carries a pull, whose reply acknowledges it: :meth:`PullingClient._finish_pull`)."""

    link: int
    wave: int
    ack_work: dist.Work | None
    ack: torch.Tensor | None
    send: dist.Work | DelayedWork  # delayed: posted when its emulated link delivers it
    msg: Message


Waitable = dist.Work | DelayedWork | Arrival
"""What a transport wait takes: a ``dist.Work`` or a paced stand-in for one."""


class ShardLinks:
    """The shards one stage of one VW talks to (the arguments are :class:`PSClient`'s)."""

    def __init__(
        self,
        vw: int,
        stage: int,
        params: Sequence[tuple[str, Sequence[int]]],
        shards: Sequence[ShardSpec],
        group: dist.ProcessGroup | None = None,
        timeout_s: float = 60.0,
        pull_timeout_s: float | None = None,
        paced: StageLinks = NO_LINKS,
        pace: Pace = REAL_PACE,
        queues: SendQueues | None = None,
    ) -> None:
        self.vw, self.stage, self.group = vw, stage, group
        self._paced, self._pace = paced, pace  # emulated links (runtime.link_pacing)
        self._queues = queues  # the stage's sender-side queues (runtime.send_queues)
        self._delay = DelayLine(pace)  # posts paced pushes when their link delivers them
        self._arrivals = ArrivalWatcher()  # stamps when paced pull replies arrive
        self._push_queue = LocalQueue()  # paced pushes without sender-side queues
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
            links.append(Link(spec, tuple(index[n] for n in me.params), spec.client_numel(me)))
        orphans = sorted(set(index) - seen)
        if orphans:
            raise ConfigError(
                f"vw {vw} stage {stage}: parameters {orphans} are on no parameter-server shard; fix the shard assignment"
            )
        self._links = tuple(links)
        self._push_order = _push_order(self._links, paced)
        self._prefix = (
            f"[vw {vw} | stage {stage} | rank {dist.get_rank() if dist.is_initialized() else '?'}]"
        )
        self._pushed: set[int] = set()
        # per shard: this stage's pushed updates not yet in the global weights (wave -> push
        # message; the local copy adds them), and spare push messages to reuse: fresh
        # multi-MB buffers cost page faults that are slower than the copy itself
        self._own: list[dict[int, Message]] = [{} for _ in links]
        self._spare: list[list[Message]] = [[] for _ in links]
        self._recv_spare: list[list[torch.Tensor]] = [[] for _ in links]  # pull(out=) buffers
        self._seq = [0] * len(links)  # pulls asked of each shard (replies come in this order)
        self._reserved: list[Message | None] = [None] * len(links)  # from update_buffers()
        self._inflight: list[Push] = []
        self._closed = False
        self.dropped: list[tuple[int, int]] = []  # (shard, wave): pushes a backup rule dropped

    @property
    def shards(self) -> tuple[ShardSpec, ...]:
        """The shards this stage talks to, in the order of :attr:`PullResult.clocks`."""
        return tuple(link.spec for link in self._links)

    # -------------------------------------------------------------- errors
    def _fail(self, link: Link, what: str, exc: BaseException) -> HetPipeRuntimeError:
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

    def _isend(self, link: Link, tensor: torch.Tensor, tag: int, what: str) -> dist.Work:
        try:
            return isend(tensor, link.spec.rank, self.group, tag)
        except RuntimeError as exc:
            raise self._fail(link, what, exc) from None

    def _irecv(self, link: Link, tensor: torch.Tensor, tag: int, what: str) -> dist.Work:
        try:
            return irecv(tensor, link.spec.rank, self.group, tag)
        except RuntimeError as exc:
            raise self._fail(link, what, exc) from None

    def _wait(self, link: Link, work: Waitable, what: str, timeout_s: float) -> None:
        try:
            work.wait(datetime.timedelta(seconds=timeout_s))
        except RuntimeError as exc:
            raise self._fail(link, what, exc) from None

    def _charge_s(self, k: int, nbytes: int) -> float:
        """Seconds the emulated link to shard ``k`` is charged for ``nbytes`` (0: not paced)."""
        link = self._paced.shard(self._links[k].spec.id)
        return 0.0 if link is None else link.time_s(nbytes)

    def _send_paced(self, k: int, msg: Message, what: str) -> dist.Work | DelayedWork:
        """Send push ``msg`` to shard ``k``: at once, or on an emulated link when its window on
        the stage's sender-side queue ends (its own link's for a shard on its node, its node
        card's for another, :mod:`runtime.send_queues`), else (no shared queues: torchrun)
        when its charge has passed since the stage's previous push landed."""
        link = self._links[k]
        charge = self._charge_s(k, msg.payload.numel() * msg.payload.element_size())
        if charge <= 0:
            return self._isend(link, msg.message, TAG_PUSH, what)
        if self._queues is not None:
            queue = self._paced.shard_queue(link.spec.id)
            deadline = self._queues.push_deadline(queue, charge)
        else:
            deadline = self._push_queue.reserve(charge, self._pace.clock())
        return self._delay.post(deadline, lambda: self._isend(link, msg.message, TAG_PUSH, what))

    def _take_message(self, k: int) -> Message:
        """A push message for shard ``k``: a recycled one, else a fresh one."""
        spare = self._spare[k]
        return spare.pop() if spare else Message(*push_message(self._links[k].numel))

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
            self._inflight.pop(0)
            if push.ack_work is None or push.ack is None:  # acknowledged by its pull's reply
                continue
            self._wait(link, push.ack_work, f"{what} (acknowledgement)", self.timeout_s)
            self._acknowledged(push.link, push.wave, int(push.ack[0]), int(push.ack[2]))

    def _acknowledged(self, k: int, wave: int, status: int, clock: int) -> None:
        """Record shard ``k``'s status of the push of ``wave`` (``clock``: its global clock);
        raise if it rejected it."""
        link = self._links[k]
        if status == Status.DROPPED:  # backup workers: the wave closed without this VW
            self.dropped.append((link.spec.id, wave))
        elif status != Status.OK:
            raise HetPipeRuntimeError(
                f"{self._prefix} shard {link.spec.id} rejected the push of wave {wave}: "
                f"{Status(status).name} (global clock {clock}); see the shard's log"
            )

    def flush(self) -> None:
        """Wait until every push was delivered and acknowledged.

        Raises:
            HetPipeRuntimeError: a push was rejected or a shard is unreachable.
        """
        self._check_acks(block=True)

    # -------------------------------------------------------------- shutdown
    def _check_open(self) -> None:
        if self._closed:
            raise HetPipeRuntimeError(f"{self._prefix} the parameter-server client is closed")


def _push_order(links: Sequence[Link], paced: StageLinks) -> tuple[int, ...]:
    """The order a push's parts leave in: to shards on the stage's node first, then to other
    nodes (the simulator charges the local part on the own link, then the rest on the card)."""
    local = [paced.shard_queue(link.spec.id) == OWN_LINK for link in links]
    return tuple(sorted(range(len(links)), key=lambda k: not local[k]))
