"""Tests of runtime/sync/allreduce_watch.py: collecting rank results and naming a stall."""

from __future__ import annotations

import io
import queue

import pytest
import torch

from profiler.errors import HetPipeRuntimeError
from runtime.sync.allreduce_watch import watch_ranks


def _payload(value: int) -> bytes:
    buf = io.BytesIO()
    torch.save({"value": value}, buf)
    return buf.getvalue()


def test_results_come_back_in_rank_order() -> None:
    events: queue.Queue[tuple[str, int, bytes]] = queue.Queue()
    events.put(("result", 1, _payload(11)))
    events.put(("result", 0, _payload(10)))
    out = watch_ranks(["R:0", "V:0"], {}, events, stall_s=5.0)
    assert [r["value"] for r in out] == [10, 11]


def test_silence_is_reported_as_a_stall() -> None:
    with pytest.raises(HetPipeRuntimeError, match="no progress"):
        watch_ranks(["R:0"], {}, queue.Queue(), stall_s=0.3)
