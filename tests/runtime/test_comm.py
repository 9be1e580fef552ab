"""The stage-to-stage transport: one flat message per minibatch per direction.

One process: ``runtime.stage.comm._post`` is replaced by an in-memory wire (a FIFO per tag),
so the tests see every send and receive the stages would post, with no process spawned.
"""

from __future__ import annotations

import queue
import threading
import weakref
from collections import defaultdict, deque
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import Tensor

from profiler.errors import HetPipeRuntimeError
from runtime.link_pacing import LinkPacer
from runtime.stage import comm
from runtime.stage.comm import (
    ACT_TAG,
    GRAD_TAG,
    STOP,
    Channel,
    Event,
    GradReceiver,
    TensorSpec,
    layout_of,
    start_activation_receiver,
)

SPECS = (
    TensorSpec("h", (4, 3), torch.float32),
    TensorSpec("mask", (4,), torch.bool),
    TensorSpec("skip", (4, 2), torch.bfloat16),
    TensorSpec("ids", (4,), torch.int64),
)
FLOATS = tuple(s for s in SPECS if s.is_float)


class Work:
    """A completed transport request that records whether it was waited on."""

    def __init__(
        self, error: BaseException | None = None, gate: threading.Event | None = None
    ) -> None:
        self.waited, self.error, self.gate = False, error, gate

    def wait(self, timeout: Any = None) -> bool:
        if self.gate is not None:  # a receive completes once the test opens the gate
            self.gate.wait(10)
        self.waited = True
        if self.error is not None:
            raise self.error
        return True


class Wire:
    """What ``_post`` would hand gloo: sends are kept per tag, receives take the oldest."""

    def __init__(self) -> None:
        self.sent: dict[int, deque[Tensor]] = defaultdict(deque)
        self.sends: list[tuple[Tensor, int, Work]] = []  # (buffer, tag, work) as posted
        self.recv_error: BaseException | None = None
        self.recvs = 0  # receives posted so far
        self.gate: threading.Event | None = None

    def post(self, op: Any, t: Tensor, peer: int, group: Any, tag: int) -> Work:
        if op is dist.isend:
            self.sent[tag].append(t.clone())
            self.sends.append((t, tag, Work()))
            return self.sends[-1][2]
        self.recvs += 1
        if self.recv_error is not None:
            return Work(self.recv_error)
        msg = self.sent[tag].popleft()
        assert msg.numel() == t.numel(), "gloo needs the receive to be the send's size"
        t.copy_(msg)
        return Work(gate=self.gate)


class Pacer(LinkPacer):
    """Records the bytes each message is charged for (and waits for none)."""

    def __init__(self) -> None:
        super().__init__(None)
        self.charged: list[float] = []

    def arrived(self, nbytes: float, start_s: float | None = None) -> float:
        self.charged.append(nbytes)
        return 0.0


@pytest.fixture
def wire(monkeypatch: pytest.MonkeyPatch) -> Wire:
    w = Wire()
    monkeypatch.setattr(comm, "_post", w.post)
    return w


def activations(mb: int) -> tuple[Tensor, ...]:
    return (
        torch.full((4, 3), float(mb), requires_grad=True) * 2,  # part of the sender's graph
        torch.arange(4) % 2 == mb % 2,
        torch.full((4, 2), mb / 4, dtype=torch.bfloat16),
        torch.arange(4) + mb,
    )


def drain(inbox: queue.SimpleQueue[Event]) -> list[Event]:
    return [inbox.get(timeout=10) for _ in range(inbox.qsize())]


def test_a_minibatch_crosses_as_one_send_of_one_buffer(wire: Wire) -> None:
    Channel(1, SPECS).send_activations(7, activations(7))
    ((buf, tag, _),) = wire.sends  # the header and the four tensors: one message
    assert tag == ACT_TAG and buf.dtype == torch.uint8
    assert not buf.requires_grad and buf.grad_fn is None  # the copy left the graph alone
    msg = layout_of(SPECS).message(buf)
    assert int(msg.header) == 7
    for got, want in zip(msg.tensors, activations(7), strict=True):
        torch.testing.assert_close(got, want.detach(), rtol=0, atol=0)


def test_received_tensors_are_views_of_their_message_charged_for_their_bytes(
    wire: Wire,
) -> None:
    sender = Channel(1, SPECS)
    for mb in (1, 2):
        sender.send_activations(mb, activations(mb))
    sender.send_stop()
    inbox: queue.SimpleQueue[Event] = queue.SimpleQueue()
    pacer = Pacer()
    start_activation_receiver(0, SPECS, inbox, timeout_s=5, pacer=pacer).join(10)
    first, second, stop = drain(inbox)
    assert [e.kind for e in (first, second, stop)] == ["act", "act", "stop"]
    assert (first.mb, second.mb) == (1, 2)
    for got, want in zip(second.tensors, activations(2), strict=True):
        assert got.shape == want.shape and got.dtype == want.dtype
        torch.testing.assert_close(got, want.detach(), rtol=0, atol=0)
    one = {t.untyped_storage().data_ptr() for t in first.tensors}
    two = {t.untyped_storage().data_ptr() for t in second.tensors}
    assert len(one) == len(two) == 1 and one != two  # no copy; kept until the backward
    payload = sum(t.numel() * t.element_size() for t in activations(1))
    assert pacer.charged == [payload, payload]  # the tensors' bytes, not the header's


def test_gradients_come_back_one_message_per_minibatch(wire: Wire) -> None:
    back = Channel(0, SPECS)
    grads: list[Tensor | None] = [torch.ones(4, 3), None]
    back.send_grads(1, grads)
    back.send_grads(2, [torch.full((4, 3), 2.0), torch.ones(4, 2, dtype=torch.bfloat16)])
    assert [tag for _, tag, _ in wire.sends] == [GRAD_TAG, GRAD_TAG]
    inbox: queue.SimpleQueue[Event] = queue.SimpleQueue()
    pacer = Pacer()
    rx = GradReceiver(1, SPECS, inbox, timeout_s=5, pacer=pacer)
    rx.expect(1)
    rx.expect(2)
    rx.close()
    rx.thread.join(10)
    first, second = drain(inbox)
    assert (first.kind, first.mb, second.kind, second.mb) == ("grad", 1, "grad", 2)
    torch.testing.assert_close(first.tensors[0], torch.ones(4, 3), rtol=0, atol=0)
    torch.testing.assert_close(first.tensors[1], torch.zeros(4, 2, dtype=torch.bfloat16))
    assert pacer.charged == [sum(s.nbytes for s in FLOATS)] * 2


def test_gradients_of_another_minibatch_are_an_error_event(wire: Wire) -> None:
    Channel(0, SPECS).send_grads(2, [None, None])
    inbox: queue.SimpleQueue[Event] = queue.SimpleQueue()
    rx = GradReceiver(1, SPECS, inbox, timeout_s=5)
    rx.expect(1)
    (event,) = [inbox.get(timeout=10)]
    assert event.kind == "error" and "minibatch 2" in str(event.error)
    assert "minibatch 1's were due" in str(event.error)


def test_a_failed_receive_is_an_error_event(wire: Wire) -> None:
    wire.recv_error = RuntimeError("Connection closed by peer")
    inbox: queue.SimpleQueue[Event] = queue.SimpleQueue()
    start_activation_receiver(0, SPECS, inbox, timeout_s=5).join(10)
    (event,) = drain(inbox)
    assert event.kind == "error" and "closed by peer" in str(event.error)


def test_a_buffer_is_reused_only_after_its_send_was_waited_on(
    wire: Wire, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(comm, "MAX_PENDING_SENDS", 2)
    ch = Channel(1, SPECS)
    for mb in (1, 2, 3):
        ch.send_activations(mb, activations(mb))
    (b1, _, w1), (b2, _, w2), (b3, _, w3) = wire.sends
    assert w1.waited and not w2.waited and not w3.waited
    assert b3.data_ptr() == b1.data_ptr() != b2.data_ptr()
    assert [int(layout_of(SPECS).message(m).header) for m in wire.sent[ACT_TAG]] == [1, 2, 3]
    ch.flush()
    assert w2.waited and w3.waited


def test_a_tensor_of_another_shape_is_refused_naming_it(wire: Wire) -> None:
    wrong = list(activations(1))
    wrong[0] = torch.zeros(3, 3)  # a smaller last batch
    with pytest.raises(HetPipeRuntimeError, match=r"'h' .* shape \(3, 3\).* \(4, 3\)"):
        Channel(1, SPECS).send_activations(1, tuple(wrong))
    assert wire.sends == []


def test_the_stop_is_one_message_of_the_same_size(wire: Wire) -> None:
    Channel(1, SPECS).send_stop()
    ((buf, tag, _),) = wire.sends
    assert tag == ACT_TAG and buf.numel() == layout_of(SPECS).nbytes
    assert int(layout_of(SPECS).message(buf).header) == STOP


class PostedAt(LinkPacer):
    """Records how many receives were posted when each message was paced."""

    def __init__(self, wire: Wire) -> None:
        super().__init__(None)
        self.wire, self.posted = wire, list[int]()

    def arrived(self, nbytes: float, start_s: float | None = None) -> float:
        self.posted.append(self.wire.recvs)
        return 0.0


def test_the_next_receive_is_posted_before_a_message_is_paced(wire: Wire) -> None:
    forward, back = Channel(1, SPECS), Channel(0, SPECS)
    for mb in (1, 2):
        forward.send_activations(mb, activations(mb))
        back.send_grads(mb, [None, None])
    forward.send_stop()
    inbox: queue.SimpleQueue[Event] = queue.SimpleQueue()
    acts = PostedAt(wire)
    start_activation_receiver(0, SPECS, inbox, timeout_s=5, pacer=acts).join(10)
    assert acts.posted == [2, 3]  # message 2's receive, then the stop's, already waiting
    wire.recvs, wire.gate = 0, threading.Event()
    grads = PostedAt(wire)
    rx = GradReceiver(1, SPECS, inbox, timeout_s=5, pacer=grads)
    rx.expect(1)
    rx.expect(2)  # known before 1's gradients arrive, as when 2's activations left first
    rx.close()
    wire.gate.set()
    rx.thread.join(10)
    assert grads.posted == [2, 2]  # 2's ahead of 1; none after the last
    assert [e.kind for e in drain(inbox)] == ["act", "act", "stop", "grad", "grad"]


class StopWatch(queue.SimpleQueue[Event]):
    """An inbox that records, when the stop is handed over, whether any receive's work is
    still alive (a work freed later may be freed by the thread during interpreter teardown)."""

    def __init__(self, works: list[weakref.ref[Work]]) -> None:
        self.works, self.alive_at_stop = works, -1

    def put(self, item: Event, block: bool = True, timeout: float | None = None) -> None:
        if item.kind == "stop":
            self.alive_at_stop = sum(w() is not None for w in self.works)
        super().put(item, block, timeout)


def test_the_activation_receiver_frees_its_works_before_it_hands_over_the_stop(
    wire: Wire, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A torchrun rank aborted at exit ("terminate called without an active exception"): the
    receiver thread still held the stop's gloo work when the stage, handed the stop, finished
    and the interpreter began its teardown; freeing the work there ended the thread inside a
    C++ destructor. The thread now frees it first, and the stage joins it."""
    works: list[weakref.ref[Work]] = []

    def post(op: Any, t: Tensor, peer: int, group: Any, tag: int) -> Work:
        work = wire.post(op, t, peer, group, tag)
        if op is dist.irecv:
            works.append(weakref.ref(work))
        return work

    monkeypatch.setattr(comm, "_post", post)
    forward = Channel(1, SPECS)
    forward.send_activations(1, activations(1))
    forward.send_stop()
    inbox = StopWatch(works)
    thread = start_activation_receiver(0, SPECS, inbox, timeout_s=5)
    comm.join_receivers([thread], 10, "vw 0 | stage 1 | rank 1")
    assert not thread.is_alive() and len(works) == 2
    assert inbox.alive_at_stop == 0
    assert [e.kind for e in drain(inbox)] == ["act", "stop"]


def test_a_receiver_that_does_not_end_is_an_error_naming_it() -> None:
    release = threading.Event()
    thread = threading.Thread(target=release.wait, name="recv-act-from-0", daemon=True)
    thread.start()
    try:
        with pytest.raises(HetPipeRuntimeError, match=r"\[stage 1\] receiver thread recv-act"):
            comm.join_receivers([thread], 0.01, "stage 1")
    finally:
        release.set()
        thread.join(10)
