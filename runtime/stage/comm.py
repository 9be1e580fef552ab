"""Point-to-point transport of the tensors crossing a cut (skip connections included).

Stage ``s`` sends minibatch ``p``'s crossing tensors to stage ``s+1`` as one message: one
flat byte buffer holding a header (``p``, or ``-1`` = no more minibatches) and every crossing
tensor, always in the same order (:class:`Layout`); stage ``s+1`` sends back one message of
``p`` and a gradient per floating-point crossing tensor (zeros when it does not depend on
it). One send per minibatch per direction: each gloo message wakes the peer's process, which
on a loaded host costs more than the bytes. Sends are asynchronous (``isend``) so they
overlap the next task; receives are posted by one thread per direction, which hands the
message's tensors (views of its buffer, no copy) to the stage's inbox, so the scheduler sees
arrivals in order and never polls. Shapes and dtypes come from the traced graph, so no
metadata travels. On an emulated cluster each receive thread holds a message back until its
link would deliver it (:class:`runtime.link_pacing.LinkPacer`): on one host until the
deadline the message carries, its window on the sender's queue (own link or node card,
:mod:`runtime.send_queues`, reserved when the send is posted), else (torchrun) until its
link's charge for the tensors' bytes has passed since it arrived. The stage computes
meanwhile, and the sender never waits for it.
"""

from __future__ import annotations

import dataclasses
import datetime
import logging
import math
import queue
import threading
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from profiler.errors import HetPipeRuntimeError, ModelError
from profiler.graph import ModelGraph
from profiler.precision import wire_dtype
from runtime.link_pacing import LinkPacer
from runtime.send_queues import Route

__all__ = [
    "Channel",
    "Event",
    "GradReceiver",
    "Layout",
    "Message",
    "TensorSpec",
    "cut_specs",
    "join_receivers",
    "layout_of",
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
    def nbytes(self) -> int:
        """Bytes of the tensor."""
        return math.prod(self.shape) * self.dtype.itemsize

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
ACT_TAG, GRAD_TAG = 0, 1  # forward messages / gradient messages (opposite directions)
HEADER_BYTES = 16  # every message opens with its int64 minibatch number, then its float64
# delivery deadline (runtime.send_queues; NaN: the receiver paces it)


@dataclass(frozen=True)
class Layout:
    """Where the header and each tensor of one message lie in its flat byte buffer.

    Attributes:
        specs: the message's tensors, in order.
        offsets: byte offset of each tensor, a multiple of its element size (so a typed view
            of the buffer can start there).
        nbytes: bytes of the whole buffer: header, padding and tensors.
        payload_bytes: bytes of the tensors alone (what the link is charged for).

    >>> lay = layout_of((TensorSpec("h", (2, 3), torch.float32), TensorSpec("m", (2,), torch.bool)))
    >>> lay.offsets, lay.nbytes, lay.payload_bytes
    ((16, 40), 42, 26)
    """

    specs: tuple[TensorSpec, ...]
    offsets: tuple[int, ...]
    nbytes: int
    payload_bytes: int

    def message(self, buf: Tensor | None = None) -> Message:
        """Typed views of ``buf`` (``None``: a new buffer) laid out like this."""
        if buf is None:
            buf = torch.empty(self.nbytes, dtype=torch.uint8)
        views = tuple(
            buf[o : o + s.nbytes].view(s.dtype).view(s.shape)
            for o, s in zip(self.offsets, self.specs, strict=True)
        )
        header, deadline = buf[:8].view(torch.int64), buf[8:HEADER_BYTES].view(torch.float64)
        return Message(self, buf, header, views, deadline)


def layout_of(specs: tuple[TensorSpec, ...]) -> Layout:
    """The :class:`Layout` of a message of ``specs``: the header, then each tensor at the next
    multiple of its element size."""
    offsets, end = [], HEADER_BYTES
    for s in specs:
        size = s.dtype.itemsize
        end = -(-end // size) * size
        offsets.append(end)
        end += s.nbytes
    return Layout(specs, tuple(offsets), end, sum(s.nbytes for s in specs))


@dataclass(frozen=True)
class Message:
    """One message's flat byte buffer and its typed views (no copies: they share ``buf``).

    Attributes:
        layout: where everything lies in ``buf``.
        buf: the ``uint8`` buffer that travels.
        header: its int64 minibatch number (a one-element view).
        tensors: a view of each tensor of ``layout.specs``.
        deadline: when its sender's queue delivers it (a one-element float64 view, seconds
            of ``time.perf_counter``; NaN: the receiver paces it, :mod:`runtime.send_queues`).
    """

    layout: Layout
    buf: Tensor
    header: Tensor
    tensors: tuple[Tensor, ...]
    deadline: Tensor

    def fill(self, mb: int, tensors: Iterable[Tensor | None]) -> None:
        """Copy minibatch number ``mb`` and ``tensors`` (``None`` -> zeros) into the buffer.

        Raises:
            HetPipeRuntimeError: a tensor's shape is not its spec's.
        """
        self.header.fill_(mb)
        with torch.no_grad():  # the copy must not join (and keep alive) the sender's graph
            for dst, t, spec in zip(self.tensors, tensors, self.layout.specs, strict=True):
                if t is None:
                    dst.zero_()
                elif t.shape != dst.shape:
                    raise HetPipeRuntimeError(
                        f"tensor {spec.name!r} crossing the cut has shape {tuple(t.shape)}, "
                        f"the traced graph's is {spec.shape}; keep every minibatch at the "
                        "traced batch size"
                    )
                else:
                    dst.copy_(t)  # from any device and layout, to the wire dtype


class Channel:
    """Sending side towards one peer, with the asynchronous sends still in flight.

    Each message is one send of one flat buffer (:class:`Layout`): the header and every
    tensor; the buffer of a send already waited on is reused for a later message.

    Args:
        peer: global rank of the peer.
        specs: tensors crossing the cut between the two stages.
        group: process group numbered like the world (``None``: the default group).
    """

    def __init__(
        self,
        peer: int,
        specs: tuple[TensorSpec, ...],
        group: Any = None,
        route: Route | None = None,
    ) -> None:
        self.peer = peer
        self.specs = specs
        self.group = group
        self.route = route
        self.acts = layout_of(specs)
        self.grads = layout_of(tuple(s for s in specs if s.is_float))
        self._pending: deque[tuple[Any, Message]] = deque()

    def _buffer(self, layout: Layout) -> Message:
        """A message buffer of ``layout``: the oldest send's once more than
        ``MAX_PENDING_SENDS`` are in flight (after waiting on it), else a new one.

        gloo's ``Work.is_completed()`` stays ``False`` until ``wait()`` is called, so only a
        waited send frees its buffer; the peer's receiver thread always posts the next
        receive, so a send that old is complete and its ``wait`` returns at once.
        """
        if len(self._pending) < MAX_PENDING_SENDS:
            return layout.message()
        work, msg = self._pending.popleft()
        work.wait()
        return msg if msg.layout is layout else layout.message()

    def _send(
        self,
        layout: Layout,
        mb: int,
        tensors: Iterable[Tensor | None],
        tag: int,
        not_before_s: float = -math.inf,
    ) -> None:
        msg = self._buffer(layout)
        msg.fill(mb, tensors)
        route = self.route if mb != STOP else None  # the stop is no transfer of the model's
        nbytes = layout.payload_bytes
        msg.deadline.fill_(math.nan if route is None else route.deadline(nbytes, not_before_s))
        work = _post(dist.isend, msg.buf, self.peer, self.group, tag)
        self._pending.append((work, msg))  # the buffer lives until the send completes

    def send_activations(self, mb: int, tensors: tuple[Tensor, ...]) -> None:
        """Post minibatch ``mb``'s crossing tensors as one message."""
        self._send(self.acts, mb, tensors, ACT_TAG)

    def send_stop(self) -> None:
        """Tell the next stage no more minibatches come (a forward message whose header is
        :data:`STOP`; its tensors are zeros)."""
        self._send(self.acts, STOP, (None,) * len(self.specs), ACT_TAG)

    def send_grads(
        self, mb: int, grads: list[Tensor | None], not_before_s: float = -math.inf
    ) -> None:
        """Post minibatch ``mb``'s gradient of each floating-point crossing tensor as one
        message (``None`` -> zeros); on a sender-side queue its transfer begins no sooner than
        ``not_before_s`` (``time.perf_counter``: when the emulated backward ends)."""
        self._send(self.grads, mb, grads, GRAD_TAG, not_before_s)

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


@dataclass(frozen=True)
class _Posted:
    """A receive posted into a new buffer (a new one: the stage keeps the tensors it receives
    until the minibatch's backward is done)."""

    msg: Message
    work: Any

    def wait(self, timeout_s: float | None) -> Message:
        """The message, once received (waiting at most ``timeout_s``; ``None``: the group's
        timeout)."""
        if self.work is not None:
            limit = None if timeout_s is None else datetime.timedelta(seconds=timeout_s)
            self.work.wait() if limit is None else self.work.wait(limit)
        return self.msg


def _post_recv(layout: Layout, peer: int, group: Any, tag: int) -> _Posted:
    """Post the receive of one message of ``layout`` from ``peer``.

    A receive posted before its send lets gloo write the data at once (a send that comes
    first only announces itself and waits for the receiver's notice), so each receiver keeps
    the next receive posted while it paces and hands over the current message.
    """
    msg = layout.message()
    return _Posted(msg, _post(dist.irecv, msg.buf, peer, group, tag))


def _now(pacer: LinkPacer | None) -> float:
    """Now on ``pacer``'s clock (0 when not paced)."""
    return 0.0 if pacer is None else pacer.pace.clock()


def start_activation_receiver(
    peer: int,
    specs: tuple[TensorSpec, ...],
    inbox: queue.SimpleQueue[Event],
    group: Any = None,
    timeout_s: float | None = None,
    pacer: LinkPacer | None = None,
) -> threading.Thread:
    """Receive forward messages from ``peer`` until the stop header, into ``inbox`` (waiting
    at most ``timeout_s`` for each; ``None``: the group's timeout), each held back until
    ``pacer``'s link charge for its tensors' bytes has passed (``None``: not paced).

    The thread drops its last receive's work before it hands over the stop: a daemon thread
    that frees a gloo work once the interpreter is finalizing aborts the process (freeing
    it releases and retakes the GIL; Python ends the thread there, unwinding through a C++
    destructor: "terminate called without an active exception"). The stage joins the
    thread too (:func:`join_receivers`).
    """
    layout = layout_of(specs)

    def loop() -> None:
        try:
            posted = _post_recv(layout, peer, group, ACT_TAG)
            while True:
                msg = posted.wait(timeout_s)
                mb = int(msg.header)
                if mb == STOP:
                    del posted  # its gloo work dies here, before the stage can reach exit
                    inbox.put(Event("stop"))
                    return
                arrived_s = _now(pacer)
                posted = _post_recv(layout, peer, group, ACT_TAG)  # the next one, ahead
                if pacer is not None:
                    pacer.delivered(layout.payload_bytes, arrived_s, float(msg.deadline))
                inbox.put(Event("act", mb, msg.tensors))
        except Exception as exc:  # a dead peer or a timeout: hand it to the stage loop
            inbox.put(Event("error", error=exc))

    thread = threading.Thread(target=loop, name=f"recv-act-from-{peer}", daemon=True)
    thread.start()
    return thread


class GradReceiver:
    """Receives one gradient message from ``peer`` per activation message sent to it.

    Call :meth:`expect` after each forward send and :meth:`close` when no more come; each
    message is awaited at most ``timeout_s`` (``None``: the group's timeout) and held back
    until ``pacer``'s link charge for its tensors' bytes has passed (``None``: not paced).
    """

    def __init__(
        self,
        peer: int,
        specs: tuple[TensorSpec, ...],
        inbox: queue.SimpleQueue[Event],
        group: Any = None,
        timeout_s: float | None = None,
        pacer: LinkPacer | None = None,
    ):
        self._pacer = pacer
        self._layout = layout_of(tuple(s for s in specs if s.is_float))
        self._timeout_s = timeout_s
        self._expected: queue.SimpleQueue[int] = queue.SimpleQueue()
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

    def _post(self) -> _Posted:
        return _post_recv(self._layout, self._peer, self._group, GRAD_TAG)

    def _next(self, block: bool) -> int | None:
        """The next expected minibatch (or :data:`STOP`); ``None``: none known yet."""
        try:
            return self._expected.get() if block else self._expected.get_nowait()
        except queue.Empty:
            return None

    def _loop(self) -> None:
        try:
            mb = self._next(block=True)
            posted = None if mb == STOP else self._post()
            while posted is not None and mb is not None:
                msg = posted.wait(self._timeout_s)
                if int(msg.header) != mb:
                    raise HetPipeRuntimeError(
                        f"gradients of minibatch {int(msg.header)} came from rank {self._peer} "
                        f"while minibatch {mb}'s were due; the stages disagree on the order"
                    )
                arrived_s = _now(self._pacer)
                nxt = self._next(block=False)  # already expected: post its receive ahead
                posted = self._post() if nxt is not None and nxt != STOP else None
                if self._pacer is not None:
                    self._pacer.delivered(
                        self._layout.payload_bytes, arrived_s, float(msg.deadline)
                    )
                self._inbox.put(Event("grad", mb, msg.tensors))
                if nxt is None:
                    nxt = self._next(block=True)
                    posted = None if nxt == STOP else self._post()
                mb = nxt
        except Exception as exc:  # a dead peer or a timeout: hand it to the stage loop
            self._inbox.put(Event("error", error=exc))


def join_receivers(threads: Iterable[threading.Thread], timeout_s: float, where: str) -> None:
    """Wait until every receiver thread of a stage whose run ended has ended: a daemon thread
    still alive when the process exits may free a gloo work during interpreter teardown,
    which aborts the process (:func:`start_activation_receiver`). Their last messages are in,
    so each ends at once; ``timeout_s`` only turns a bug into an error.

    Raises:
        HetPipeRuntimeError: a thread still runs after ``timeout_s``.
    """
    for thread in threads:
        thread.join(timeout_s)
        if thread.is_alive():
            raise HetPipeRuntimeError(
                f"[{where}] receiver thread {thread.name} still runs {timeout_s:.0f} s after "
                "the stage's last message; the stages disagree on the number of minibatches"
            )
