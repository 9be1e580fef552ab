"""Tests of runtime/launch/failures.watch: collecting rank results and naming a stall."""

from __future__ import annotations

import os
import queue
import signal
import time

import pytest

from profiler.errors import HetPipeRuntimeError
from runtime.launch.failures import root_cause_rank, watch


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


class _Proc:
    def __init__(self, exitcode: int | None) -> None:
        self.exitcode = exitcode


def test_a_vw_the_run_went_on_without_is_not_blamed_for_a_later_failure() -> None:
    """VW 1 (ranks 4, 5) died and was absorbed; later VW 0's rank 2 fails with a timeout (a
    'secondary' message). The blame is rank 2's, not the long-dead rank 4's exit code (a CI
    failure message blamed the evicted rank and hid the real error)."""
    procs = {2: _Proc(None), 3: _Proc(None), 4: _Proc(1), 5: _Proc(-9)}
    events: queue.Queue[tuple[object, ...]] = queue.Queue()
    events.put(("error", 5, "killed"))
    absorbed: list[dict[int, str]] = []

    def absorb(errors: dict[int, str]) -> set[int] | None:
        absorbed.append(errors)
        return {4, 5} if len(absorbed) == 1 else None  # the first VW goes, the second ends it

    def fail(errors: dict[int, str], done: dict[int, bytes]) -> HetPipeRuntimeError:
        rank = root_cause_rank(procs, queue.Queue(), errors, done, grace_s=0.0)
        return HetPipeRuntimeError(f"rank {rank} failed: {errors[rank]}")

    events.put(("error", 2, "no message from a neighbour stage for 72 s"))
    with pytest.raises(HetPipeRuntimeError, match="rank 2 failed: no message from a neighbour"):
        watch(procs, events, 4, lambda _: None, fail, stall_s=5.0, absorb=absorb)


def test_a_waves_reports_travel_in_one_message_and_arrive_one_by_one() -> None:
    """A stage sends its wave's ``loss``/``done`` reports as one pipe message (one wake-up of
    the launcher); :class:`Reports` hands them on in order, between the child's other messages."""
    import multiprocessing

    from runtime.launch.reports import Reports
    from runtime.messages import REPORTS

    reports = Reports(multiprocessing.get_context("spawn"))
    channel, _ = reports.channel(key=3)
    wave = (("loss", 3, 1, 0.5, 0.0), ("loss", 3, 2, 0.4, 0.0))
    channel.put(("joined", 3, None))
    channel.put((REPORTS, 3, wave))
    channel.put(("result", 3, b"x"))
    got = [reports.get(timeout=5.0) for _ in range(4)]
    assert got == [("joined", 3, None), *wave, ("result", 3, b"x")]
    channel.put((REPORTS, 3, wave))
    assert reports.get(timeout=5.0) == wave[0]
    reports.drop(3)  # a restarted rank's old reports are stale, its batched ones too
    with pytest.raises(queue.Empty):
        reports.get(timeout=0.1)
    reports.close()
