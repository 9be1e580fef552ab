"""Tests of runtime/launch/failures.watch: collecting rank results and naming a stall."""

from __future__ import annotations

import os
import queue
import signal
import time

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


def test_ctrl_c_waits_until_a_started_process_is_in_the_launchers_table() -> None:
    """Ctrl-C inside the block is raised after it, never between a process's start and its
    entry in the table the launcher stops at the end (a child left out ran on after Ctrl-C,
    and the launcher's exit waited for it)."""
    from runtime.launch.supervise import ctrl_c_deferred

    reached = False
    # Python's own handler, whatever this process inherited (a background job ignores SIGINT)
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with pytest.raises(KeyboardInterrupt), ctrl_c_deferred():
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.05)  # without the hold the handler raises here
            reached = True
    finally:
        signal.signal(signal.SIGINT, previous)
    assert reached
