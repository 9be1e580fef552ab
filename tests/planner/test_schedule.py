"""The per-stage task rules of paper Sec. 4 (planner/schedule.py), numbered as in the module."""

from __future__ import annotations

import doctest
import heapq
import itertools
import random

import pytest

import planner.schedule
from planner.schedule import (
    FLUSH,
    HETPIPE,
    SCHEDULES,
    Kind,
    Schedule,
    StageQueue,
    Task,
    actions,
    format_actions,
    schedule_named,
)
from profiler.errors import PlanError


def F(stage: int, mb: int) -> Task:
    return Task(stage, Kind.F, mb)


def B(stage: int, mb: int) -> Task:
    return Task(stage, Kind.B, mb)


def run_pipeline(
    n_stages: int, nm: int, n_mb: int, fwd: list[float], bwd: list[float]
) -> tuple[list[list[tuple[float, str]]], list[int]]:
    """A tiny zero-communication pipeline driven only by StageQueue and Nm admission.

    Returns each stage's (start time, task) list and each stage's peak in-flight count.
    """
    queues = [StageQueue(s, n_stages) for s in range(n_stages)]
    order: list[list[tuple[float, str]]] = [[] for _ in range(n_stages)]
    peak = [0] * n_stages
    events: list[tuple[float, int, int, Task]] = []  # (time, seq, stage, finished task)
    seq = 0
    admitted = 0
    vw_in_flight = 0

    def admit() -> None:
        nonlocal admitted, vw_in_flight
        while vw_in_flight < nm and admitted < n_mb:
            admitted += 1
            vw_in_flight += 1
            queues[0].ready(Task(0, queues[0].forward_kind, admitted))

    def start(now: float) -> None:
        nonlocal seq
        for s, q in enumerate(queues):
            t = q.next()
            if t is None:
                continue
            peak[s] = max(peak[s], q.in_flight)
            order[s].append((now, str(t)))
            dur = fwd[s] + bwd[s] if t.kind is Kind.FB else (fwd[s] if t.kind is Kind.F else bwd[s])
            heapq.heappush(events, (now + dur, seq, s, t))
            seq += 1

    admit()
    start(0.0)
    while events:
        now, _, s, t = heapq.heappop(events)
        queues[s].done(t)
        if t.kind is Kind.F:
            queues[s + 1].ready(Task(s + 1, queues[s + 1].forward_kind, t.mb))
        elif s > 0:
            queues[s - 1].ready(B(s - 1, t.mb))
        else:
            vw_in_flight -= 1
            admit()
        start(now)
    return order, peak


def tasks(order: list[tuple[float, str]]) -> list[str]:
    return [name for _, name in order]


def test_task_str_and_kinds() -> None:
    assert str(Task(2, Kind.F, 5)) == "2F5"
    assert str(Task(3, Kind.FB, 1)) == "3FB1"
    assert StageQueue(3, 4).forward_kind is Kind.FB
    assert StageQueue(0, 4).forward_kind is Kind.F


def test_rule1_forward_waits_for_previous_forward() -> None:
    q = StageQueue(1, 3)
    q.ready(F(1, 2))  # minibatch 2's activations arrive before minibatch 1's
    assert q.next() is None
    q.ready(F(1, 1))
    assert q.next() == F(1, 1)
    q.done(F(1, 1))
    assert q.next() == F(1, 2)


def test_rule2_backward_waits_for_previous_backward() -> None:
    q = StageQueue(0, 2)
    for mb in (1, 2):
        q.ready(F(0, mb))
        assert q.next() == F(0, mb)
        q.done(F(0, mb))
    q.ready(B(0, 2))
    assert q.next() is None
    q.ready(B(0, 1))
    assert q.next() == B(0, 1)
    q.done(B(0, 1))
    assert q.next() == B(0, 2)


def test_rule3_fifo_among_allowed_tasks() -> None:
    q = StageQueue(0, 2)
    q.ready(F(0, 1))
    assert q.next() == F(0, 1)
    q.done(F(0, 1))
    q.ready(B(0, 1))  # ready first
    q.ready(F(0, 2))
    assert q.next() == B(0, 1)
    q.done(B(0, 1))
    assert q.next() == F(0, 2)
    q.done(F(0, 2))
    q.ready(F(0, 3))  # now the forward is first
    q.ready(B(0, 2))
    assert q.next() == F(0, 3)


def test_rule4_last_stage_runs_fused_tasks() -> None:
    q = StageQueue(2, 3)
    with pytest.raises(ValueError, match="FB"):
        q.ready(F(2, 1))
    q.ready(Task(2, Kind.FB, 1))
    t = q.next()
    assert t == Task(2, Kind.FB, 1)
    assert q.in_flight == 1
    q.done(Task(2, Kind.FB, 1))
    assert q.in_flight == 0
    with pytest.raises(ValueError, match="FB"):
        StageQueue(0, 3).ready(Task(0, Kind.FB, 1))


def test_one_task_at_a_time_and_errors() -> None:
    q = StageQueue(0, 2)
    q.ready(F(0, 1))
    q.ready(F(0, 2))
    assert q.next() == F(0, 1)
    assert q.next() is None  # F1 still running
    with pytest.raises(ValueError, match="not running"):
        q.done(F(0, 2))
    with pytest.raises(ValueError, match="already"):
        q.ready(F(0, 2))
    with pytest.raises(ValueError, match="belongs to stage"):
        q.ready(F(1, 3))
    with pytest.raises(ValueError):
        StageQueue(2, 2)


def test_in_flight_bound() -> None:
    assert [HETPIPE.in_flight_bound(s, 4, 4) for s in range(4)] == [4, 4, 4, 1]
    assert [HETPIPE.in_flight_bound(s, 3, 1) for s in range(3)] == [1, 1, 1]
    assert HETPIPE.in_flight_bound(0, 1, 5) == 1  # a single stage is the last stage
    with pytest.raises(ValueError):
        HETPIPE.in_flight_bound(0, 4, 0)


def test_paper_figure1_nm4_four_stages() -> None:
    """Fig. 1: 4 GPUs, Nm = 4; GPU4 runs F/B of a minibatch side by side, GPU1 holds Nm."""
    fwd = [1.0] * 4
    bwd = [2.0] * 4
    order, peak = run_pipeline(4, 4, 12, fwd, bwd)
    assert tasks(order[0]) == [
        "0F1", "0F2", "0F3", "0F4", "0B1", "0F5", "0B2", "0F6", "0B3", "0F7", "0B4", "0F8",
        "0B5", "0F9", "0B6", "0F10", "0B7", "0F11", "0B8", "0F12", "0B9", "0B10", "0B11", "0B12",
    ]  # fmt: skip
    assert tasks(order[3]) == [f"3FB{p}" for p in range(1, 13)]
    # minibatch 5 enters only after minibatch 1 left stage 0 (Nm = 4 in flight)
    start = {name: t for t, name in order[0]}
    assert start["0F5"] >= start["0B1"] + bwd[0]
    # with these timings every non-last GPU reaches the bound Nm; the last GPU holds one
    assert peak == [4, 4, 4, 1]


def test_nm1_is_naive_model_parallelism() -> None:
    order, peak = run_pipeline(3, 1, 3, [1.0, 1.0, 1.0], [1.0, 1.0, 1.0])
    assert tasks(order[0]) == ["0F1", "0B1", "0F2", "0B2", "0F3", "0B3"]
    assert peak == [1, 1, 1]
    # one minibatch every 2*2 + 2 = 6 time units
    assert [t for t, n in order[0] if "F" in n] == [0.0, 6.0, 12.0]


def test_rules_hold_under_random_timings() -> None:
    rng = random.Random(1)
    for _ in range(200):
        s = rng.randint(1, 5)
        nm = rng.randint(1, 6)
        fwd = [rng.uniform(0.1, 3.0) for _ in range(s)]
        bwd = [rng.uniform(0.1, 3.0) for _ in range(s)]
        order, peak = run_pipeline(s, nm, 10, fwd, bwd)
        for st in range(s):
            names = tasks(order[st])
            fw = [n for n in names if "B" not in n or "FB" in n]
            bw = [n for n in names if "B" in n and "FB" not in n]
            assert [int(n.split("F")[-1].lstrip("B")) for n in fw] == list(range(1, 11))
            assert [int(n.split("B")[-1]) for n in bw] == (list(range(1, 11)) if st < s - 1 else [])
            assert peak[st] <= HETPIPE.in_flight_bound(st, s, nm)


# ---------------------------------------------------------------- named schedules
#
# Rules checked on the action lists of :func:`actions`, one process, no clocks:
#   S1. every stage runs every minibatch once: forwards in order, backwards in order;
#   S2. a stage never holds more than its schedule's in-flight bound (at most Nm);
#   S3. hetpipe, equal stages, Nm <= stages: stage 0 runs min(Nm, total) forwards, then a
#       backward and a forward in turn (1F1B: one in as one completes), then the last backwards
#       (flush does not, once a second wave has to wait);
#   S4. flush: no stage starts a minibatch of wave k + 1 before its backward of wave k's last.


def _cases() -> list[tuple[int, int, int, float]]:
    """``(stages, Nm, minibatches, forward time)``; a backward takes twice the forward."""
    rng = random.Random(3)
    return [
        (rng.randint(1, 5), rng.randint(1, 5), rng.randint(1, 14), rng.uniform(0.2, 2))
        for _ in range(60)
    ]


def _held(tasks: tuple[Task, ...]) -> list[int]:
    """Minibatches the stage holds while running each task (an ``FB`` holds its own one)."""
    held, out = 0, []
    for t in tasks:
        held += {Kind.F: 1, Kind.B: 0, Kind.FB: 0}[t.kind]
        out.append(held if t.kind is not Kind.FB else 1)
        held -= t.kind is Kind.B
    return out


@pytest.mark.parametrize("schedule", list(SCHEDULES.values()), ids=list(SCHEDULES))
def test_action_lists_obey_rules_s1_s2(schedule: Schedule) -> None:
    for n, nm, total, fwd in _cases():
        bwd = 2 * fwd
        per_stage = actions(schedule, n, nm, total, fwd, bwd)
        for s, tasks in enumerate(per_stage):
            last = s == n - 1
            fw = [t.mb for t in tasks if t.kind is not Kind.B]
            bw = [t.mb for t in tasks if t.kind is not Kind.F]
            assert fw == bw == list(range(1, total + 1))  # S1
            assert all(t.kind is (Kind.FB if last else t.kind) for t in tasks)
            assert max(_held(tasks)) <= schedule.in_flight_bound(s, n, nm) <= nm  # S2


@pytest.mark.parametrize("schedule", list(SCHEDULES.values()), ids=list(SCHEDULES))
def test_hetpipe_is_1f1b_after_warm_up_s3(schedule: Schedule) -> None:
    for n, nm, total in itertools.product(range(2, 6), range(1, 6), range(1, 15)):
        if nm > n:
            continue  # more in flight than stages: FIFO may run two backwards in a row
        first = [f"{t.kind.value}{t.mb}" for t in actions(schedule, n, nm, total)[0]]
        warm = min(nm, total)
        steady = [x for p in range(1, total - warm + 1) for x in (f"B{p}", f"F{p + warm}")]
        tail = [f"B{p}" for p in range(total - warm + 1, total + 1)]
        one_f_one_b = first == [f"F{p}" for p in range(1, warm + 1)] + steady + tail
        assert one_f_one_b == (schedule is HETPIPE or nm == 1 or total <= nm), (n, nm, first)


def test_flush_waits_for_the_wave_s4() -> None:
    for n, nm, total, fwd in _cases():
        for tasks in actions(FLUSH, n, nm, total, fwd, 2 * fwd):
            seen_done = 0  # backwards (or FB) done on this stage so far
            for t in tasks:
                if t.kind is not Kind.B:
                    wave_start = (t.mb - 1) // nm * nm
                    assert seen_done >= wave_start
                if t.kind is not Kind.F:
                    seen_done += 1


def test_action_list_text() -> None:
    text = format_actions(actions(HETPIPE, n_stages=3, nm=3, total=6))
    assert text.splitlines() == [
        "stage 0: F1 F2 F3 B1 F4 B2 F5 B3 F6 B4 B5 B6",
        "stage 1: F1 F2 F3 B1 B2 F4 B3 F5 B4 F6 B5 B6",
        "stage 2: FB1 FB2 FB3 FB4 FB5 FB6",
    ]
    flushed = format_actions(actions(FLUSH, n_stages=2, nm=2, total=4)).splitlines()
    assert flushed[0] == "stage 0: F1 F2 B1 B2 F3 F4 B3 B4"


def test_admission() -> None:
    assert HETPIPE.admissible(0, 0, nm=4, total=10) == 4
    assert HETPIPE.admissible(4, 1, nm=4, total=10) == 1
    assert HETPIPE.admissible(9, 7, nm=4, total=10) == 1  # never beyond total
    assert HETPIPE.admissible(10, 2, nm=4, total=8) == 0  # total lowered (time limit)
    assert FLUSH.admissible(4, 3, nm=4, total=10) == 0
    assert FLUSH.admissible(8, 8, nm=4, total=10) == 2
    with pytest.raises(ValueError, match="completed"):
        HETPIPE.admissible(2, 3, nm=4, total=10)
    with pytest.raises(ValueError, match="nm"):
        FLUSH.admissible(0, 0, nm=0, total=10)


def test_schedule_registry() -> None:
    assert list(SCHEDULES) == ["hetpipe", "flush"]
    assert schedule_named("flush") is FLUSH
    with pytest.raises(
        PlanError,
        match=r"^plan.yaml: schedule: unknown pipeline schedule 'gpipe'; choose one of hetpipe, flush$",
    ):
        schedule_named("gpipe", "plan.yaml: schedule")


def test_doctests() -> None:
    res = doctest.testmod(planner.schedule)
    assert res.attempted >= 4 and res.failed == 0
