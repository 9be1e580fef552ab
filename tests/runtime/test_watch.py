"""Tests of runtime/launch/failures.watch: collecting rank results and naming a stall."""

from __future__ import annotations

import queue

import pytest

from profiler.errors import HetPipeRuntimeError
from runtime.launch.failures import watch


def _fail(errors: dict[int, str], done: dict[int, bytes]) -> HetPipeRuntimeError:
    return HetPipeRuntimeError(f"rank {min(errors)} failed: {errors[min(errors)]}")


def test_results_come_back_by_rank_and_progress_is_passed_on() -> None:
    events: queue.Queue[tuple[object, ...]] = queue.Queue()
    events.put(("result", 1, b"one"))
    events.put(("loss", 0, 1, 0.5))
    events.put(("result", 0, b"zero"))
    seen: list[object] = []
    out = watch({}, events, 2, seen.append, _fail, stall_s=5.0)
    assert out == {0: b"zero", 1: b"one"} and seen == [("loss", 0, 1, 0.5)]


def test_an_error_is_blamed_through_fail() -> None:
    events: queue.Queue[tuple[object, ...]] = queue.Queue()
    events.put(("error", 3, "boom"))
    with pytest.raises(HetPipeRuntimeError, match="rank 3 failed: boom"):
        watch({}, events, 1, lambda _: None, _fail, stall_s=5.0)


def test_silence_is_reported_as_a_stall() -> None:
    with pytest.raises(HetPipeRuntimeError, match="no progress"):
        watch({}, queue.Queue(), 1, lambda _: None, _fail, stall_s=0.3, first_event_s=0.3)
