"""Messages a wave costs: a push that carries a pull is acknowledged by the pull's reply (no
acknowledgement message of its own), and a small pull reply is one message; one process, the
client's transport faked."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from profiler.errors import HetPipeRuntimeError
from runtime.ps import wire
from runtime.ps.client import PSClient
from runtime.ps.layout import make_shard_specs
from runtime.ps.outcome import Status
from runtime.ps.wire import HEADER_BYTES, NO_PUSH, TAG_ACK, TAG_PULL_DATA, TAG_PULL_HEADER


class _Done:
    """A transport request that has completed."""

    def wait(self, timeout: Any = None) -> bool:
        return True


def _client(push_status: int, posted: list[int]) -> PSClient:
    """A client of one parameter on shard 0 whose pull replies acknowledge the push they rode
    on with ``push_status``; the tag of every receive it posts goes to ``posted``."""
    specs = make_shard_specs({"w": (4,)}, {"w": 0}, [1], [(0, 0, 0, ["w"])])
    client = PSClient(0, 0, [("w", (4,))], specs)

    def irecv(link: Any, tensor: torch.Tensor, tag: int, what: str) -> _Done:
        posted.append(tag)
        if tag == TAG_PULL_HEADER:  # [status, global clock, push status, seq]
            tensor.zero_()
            head = tensor[:HEADER_BYTES].view(torch.int64)  # a one-message reply: its head
            head.copy_(torch.tensor([Status.OK, 1, push_status, client._seq[0]]))
        elif tag == TAG_ACK:  # [status, wave, global clock, 0]
            tensor.copy_(torch.tensor([Status.OK, 0, 0, 0]))
        return _Done()

    client._irecv = irecv  # type: ignore[method-assign,assignment]
    client._isend = lambda *args: _Done()  # type: ignore[method-assign,assignment,return-value]
    return client


def test_a_push_with_a_pull_posts_no_acknowledgement_receive() -> None:
    posted: list[int] = []
    client = _client(Status.OK, posted)
    client.push_pull(0, [torch.ones(4)], 1).wait()
    client.flush()
    assert TAG_ACK not in posted and TAG_PULL_HEADER in posted
    client.push(1, [torch.ones(4)])  # alone: acknowledged on its own
    client.flush()
    assert posted.count(TAG_ACK) == 1


def test_the_pull_reply_reports_a_rejected_push() -> None:
    client = _client(Status.DUPLICATE, [])
    handle = client.push_pull(0, [torch.ones(4)], 1)
    with pytest.raises(HetPipeRuntimeError, match="rejected the push of wave 0: DUPLICATE"):
        handle.wait()


def test_the_pull_reply_reports_a_dropped_push() -> None:
    client = _client(Status.DROPPED, [])
    client.push_pull(3, [torch.ones(4)], 1).wait()
    assert client.dropped == [(0, 3)]


def test_a_pull_alone_ignores_the_push_field() -> None:
    client = _client(NO_PUSH, [])
    assert client.pull(1).clock == 1 and client.dropped == []


def test_a_small_pull_reply_is_one_message_a_large_one_two(monkeypatch: pytest.MonkeyPatch) -> None:
    posted: list[int] = []
    client = _client(Status.OK, posted)
    torch.testing.assert_close(client.pull(1).tensors[0], torch.zeros(4))  # the fake's values
    assert posted == [TAG_PULL_HEADER]  # header and values: one receive
    monkeypatch.setattr(wire, "ONE_MESSAGE_PULL_BYTES", 8)  # 4 float32 values are 16 bytes
    posted.clear()
    client.pull(1)
    assert posted == [TAG_PULL_HEADER, TAG_PULL_DATA]
