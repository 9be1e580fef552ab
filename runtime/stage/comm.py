"""Point-to-point transport of the tensors crossing a cut (skip connections included).

Stage ``s`` sends each forward message to stage ``s+1`` as a header (the 1-based minibatch
number, or ``-1`` = no more minibatches) followed by every crossing tensor, each on its own
tag, always in the same order; stage ``s+1`` sends back one gradient per floating-point
crossing tensor (zeros when it does not depend on it), in backward order. Sends are
asynchronous (``isend``) so they overlap the next task; receives are posted by one thread
per direction, which hands complete messages to the stage's inbox, so the scheduler sees
arrivals in order and never polls. Shapes and dtypes come from the traced graph, so no
metadata travels. On an emulated cluster each receive thread holds a message back until its
link's charged time has passed (:class:`runtime.link_pacing.LinkPacer`): the stage computes
meanwhile, and the sender never waits for it.
"""

from __future__ import annotations

import dataclasses
import datetime
import logging
import queue
import threading
from collections import deque
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from profiler.errors import ModelError
from profiler.graph import ModelGraph
from profiler.precision import wire_dtype
from runtime.link_pacing import LinkPacer
from runtime.stage.device import to_host

__all__ = [
    "Channel",
    "Event",
    "GradReceiver",
    "TensorSpec",
    "cut_specs",
    "message_bytes",
    "start_activation_receiver",
    "wire_specs",
]

log = logging.getLogger(__name__)

STOP = -1


@dataclass(frozen=True)
class TensorSpec:
    """Shape and dtype of one tensor crossing a cut."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def is_float(self) -> bool:
        """Whether a gradient flows back for it."""
        return self.dtype.is_floating_point

    def empty(self) -> Tensor:
        """A receive buffer."""
        return torch.empty(self.shape, dtype=self.dtype)


def wire_specs(specs: tuple[TensorSpec, ...], precision: str) -> tuple[TensorSpec, ...]:
    """``specs`` as they travel under ``precision``: floating-point tensors in bfloat16 under
    ``bf16`` (:func:`profiler.precision.wire_dtype`)."""
    return tuple(dataclasses.replace(s, dtype=wire_dtype(s.dtype, precision)) for s in specs)


def cut_specs(graph: ModelGraph, cut: int, precision: str = "fp32") -> tuple[TensorSpec, ...]:
    """The tensors crossing cut ``cut`` in the order stage modules use (``graph.cut_names``),
    as they travel under ``precision`` (:func:`wire_specs`).

    Raises:
        ModelError: a crossing value is not a single tensor (e.g. a tuple output).
    """
    nodes = list(graph.gm.graph.nodes)
    specs = []
    for i in graph.crossing[cut]:
        meta = nodes[i].meta.get("tensor_meta")
        if meta is None or not hasattr(meta, "shape"):
            raise ModelError(
                f"layer {graph.layers[i].name!r} crosses cut {cut} but its output is not a single tensor; "
                "move the cut so it does not separate a tuple from its getitem"
            )
        specs.append(
            TensorSpec(
                graph.layers[i].name,
                tuple(int(d) for d in meta.shape),
                wire_dtype(meta.dtype, precision),
            )
        )
    return tuple(specs)


@dataclass(frozen=True)
class Event:
    """Something the stage's inbox received.

    Attributes:
        kind: ``act`` (activations of ``mb``), ``grad`` (gradients of ``mb``), ``stop`` (no
            more minibatches) or ``error`` (a receive failed; ``error`` holds the exception).
    """

    kind: str
    mb: int = 0
    tensors: tuple[Tensor, ...] = ()
    error: BaseException | None = None


MAX_PENDING_SENDS = 64  # posted sends a Channel keeps before waiting on the oldest


class Channel:
    """Sending side towards one peer, with the asynchronous sends still in flight.

    Args:
        peer: global rank of the peer.
        specs: tensors crossing the cut between the two stages.
        group: process group numbered like the world (``None``: the default group).
    """

    def __init__(self, peer: int, specs: tuple[TensorSpec, ...], group: Any = None) -> None:
        self.peer = peer
        self.specs = specs
        self.group = group
        self._pending: deque[tuple[Any, Tensor]] = deque()

    def _isend(self, t: Tensor, tag: int) -> None:
        t = to_host(t.detach()).contiguous()  # gloo's point-to-point takes host tensors
        work = _post(dist.isend, t, self.peer, self.group, tag)
        self._pending.append((work, t))  # keep the buffer alive until the send completes

    def _prune(self) -> None:
        """Retire the oldest sends by waiting on them, keeping at most ``MAX_PENDING_SENDS``.

        gloo's ``Work.is_completed()`` stays ``False`` until ``wait()`` is called, so polling
        it never retires anything: the list (and every tensor it keeps alive) would grow for the
        whole run and each prune would cost O(sends so far). The peer's receiver thread always
        posts the next receive, so an old send is complete and its ``wait`` returns at once.
        """
        while len(self._pending) > MAX_PENDING_SENDS:
            work, _ = self._pending.popleft()
            work.wait()

    def send_activations(self, mb: int, tensors: tuple[Tensor, ...]) -> None:
        """Post the header and the crossing tensors of minibatch ``mb``."""
        self._prune()
        self._isend(torch.tensor([mb], dtype=torch.int64), 0)
        for i, t in enumerate(tensors):
            self._isend(t, i + 1)

    def send_stop(self) -> None:
        """Tell the next stage no more minibatches come (a full message with zero tensors, so
        the receiver's pre-posted receives all complete)."""
        self.send_activations(STOP, tuple(s.empty().zero_() for s in self.specs))

    def send_grads(self, grads: list[Tensor | None]) -> None:
        """Post one gradient per floating-point crossing tensor (``None`` -> zeros)."""
        self._prune()
        floats = [s for s in self.specs if s.is_float]
        for i, (spec, g) in enumerate(zip(floats, grads, strict=True)):
            self._isend(g if g is not None else torch.zeros(spec.shape, dtype=spec.dtype), i + 1)

    def flush(self) -> None:
        """Wait for every posted send."""
        for work, _ in self._pending:
            work.wait()
        self._pending.clear()


def _post(op: Any, t: Tensor, peer: int, group: Any, tag: int) -> Any:
    """``dist.isend``/``dist.irecv`` to or from global rank ``peer``: in the default group, or
    in ``group`` numbered like the world (a restarted VW's, :mod:`runtime.ps.rejoin`)."""
    if group is None:
        return op(t, peer, tag=tag)
    return op(t, group=group, tag=tag, **{"group_dst" if op is dist.isend else "group_src": peer})


def _recv(
    buffers: list[Tensor], peer: int, group: Any, first_tag: int = 1, timeout_s: float | None = None
) -> None:
    """Post every receive of one message at once (one round trip, not one per tensor), then
    wait (at most ``timeout_s`` each; ``None``: the group's timeout)."""
    works = [_post(dist.irecv, buf, peer, group, first_tag + i) for i, buf in enumerate(buffers)]
    limit = None if timeout_s is None else datetime.timedelta(seconds=timeout_s)
    for work in works:
        if work is not None:
            work.wait() if limit is None else work.wait(limit)


def message_bytes(tensors: list[Tensor]) -> int:
    """Bytes of one message's tensors (what its link is charged for)."""
    return sum(t.numel() * t.element_size() for t in tensors)


def start_activation_receiver(
    peer: int,
    specs: tuple[TensorSpec, ...],
    inbox: queue.Queue[Event],
    group: Any = None,
    timeout_s: float | None = None,
    pacer: LinkPacer | None = None,
) -> threading.Thread:
    """Receive forward messages from ``peer`` until the stop header, into ``inbox`` (waiting
    at most ``timeout_s`` for each; ``None``: the group's timeout), each held back until
    ``pacer``'s link charge has passed (``None``: not paced)."""

    def loop() -> None:
        try:
            while True:
                header = torch.empty(1, dtype=torch.int64)
                bufs = [s.empty() for s in specs]
                _recv([header, *bufs], peer, group, first_tag=0, timeout_s=timeout_s)
                mb = int(header.item())
                if mb == STOP:
                    inbox.put(Event("stop"))
                    return
                if pacer is not None:
                    pacer.arrived(message_bytes(bufs))
                inbox.put(Event("act", mb, tuple(bufs)))
        except Exception as exc:  # a dead peer or a timeout: hand it to the stage loop
            inbox.put(Event("error", error=exc))

    thread = threading.Thread(target=loop, name=f"recv-act-from-{peer}", daemon=True)
    thread.start()
    return thread


class GradReceiver:
    """Receives one gradient message from ``peer`` per activation message sent to it.

    Call :meth:`expect` after each forward send and :meth:`close` when no more come; each
    message is awaited at most ``timeout_s`` (``None``: the group's timeout) and held back
    until ``pacer``'s link charge has passed (``None``: not paced).
    """

    def __init__(
        self,
        peer: int,
        specs: tuple[TensorSpec, ...],
        inbox: queue.Queue[Event],
        group: Any = None,
        timeout_s: float | None = None,
        pacer: LinkPacer | None = None,
    ):
        self._pacer = pacer
        self._floats = [s for s in specs if s.is_float]
        self._timeout_s = timeout_s
        self._expected: queue.Queue[int] = queue.Queue()
        self._peer = peer
        self._group = group
        self._inbox = inbox
        self.thread = threading.Thread(
            target=self._loop, name=f"recv-grad-from-{peer}", daemon=True
        )
        self.thread.start()

    def expect(self, mb: int) -> None:
        """Gradients of minibatch ``mb`` will come (in increasing ``mb`` order)."""
        self._expected.put(mb)

    def close(self) -> None:
        """No more gradients: end the thread."""
        self._expected.put(STOP)

    def _loop(self) -> None:
        try:
            while True:
                mb = self._expected.get()
                if mb == STOP:
                    return
                bufs = [s.empty() for s in self._floats]
                _recv(bufs, self._peer, self._group, timeout_s=self._timeout_s)
                if self._pacer is not None:
                    self._pacer.arrived(message_bytes(bufs))
                self._inbox.put(Event("grad", mb, tuple(bufs)))
        except Exception as exc:  # a dead peer or a timeout: hand it to the stage loop
            self._inbox.put(Event("error", error=exc))
