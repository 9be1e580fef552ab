"""The per-stage task rules of paper Sec. 4 (planner/schedule.py), numbered as in the module."""

from __future__ import annotations

import heapq
import random

import pytest

from planner.schedule import Kind, StageQueue, Task, in_flight_bound


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
    assert [in_flight_bound(s, 4, 4) for s in range(4)] == [4, 4, 4, 1]
    assert [in_flight_bound(s, 3, 1) for s in range(3)] == [1, 1, 1]
    assert in_flight_bound(0, 1, 5) == 1  # a single stage is the last stage
    with pytest.raises(ValueError):
        in_flight_bound(0, 4, 0)


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
            assert peak[st] <= in_flight_bound(st, s, nm)
