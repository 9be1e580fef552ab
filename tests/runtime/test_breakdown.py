"""``--profile-runtime``: lap timers by task kind and category, their JSON and table."""

from __future__ import annotations

from collections.abc import Iterator

from rich.console import Console

from runtime.results.breakdown import (
    CATEGORIES,
    Breakdown,
    breakdown_json,
    breakdown_table,
    mean_overhead_ms_per_task,
)
from runtime.results.metrics import StageResult
from runtime.stage.timers import LapTimer, lap_timer


def _clock(*ns: int) -> Iterator[int]:
    yield from ns


def test_laps_charge_each_interval_to_its_task_kind_and_category() -> None:
    ticks = _clock(0, 1_000, 3_000, 7_000, 7_500, 9_500, 10_000)
    timer = LapTimer(lambda: next(ticks))  # starts at 0
    timer.lap("wait_neighbour")  # 0..1000: between tasks
    timer.task("FB")  # 1000..3000: the loop's other
    timer.lap("real_compute")  # 3000..7000
    timer.lap("ps", waited_s=3e-7)  # 7000..7500: 300 ns of it waiting for the clock
    timer.idle()  # 7500..9500: the task's other
    b = timer.result()  # 9500..10000: the loop's other
    assert b is not None
    assert b.wall_ns == 10_000 and sum(ns for _, _, ns in b.ns) == b.wall_ns
    assert dict(((k, c), ns) for k, c, ns in b.ns) == {
        ("loop", "wait_neighbour"): 1_000,
        ("loop", "other"): 2_000 + 500,
        ("FB", "real_compute"): 4_000,
        ("FB", "ps"): 200,
        ("FB", "wsp_wait"): 300,
        ("FB", "other"): 2_000,
    }
    assert b.tasks == (("FB", 1),)


def test_a_wait_longer_than_its_lap_is_cut_to_the_lap() -> None:
    ticks = _clock(0, 100, 200)
    timer = LapTimer(lambda: next(ticks))
    timer.lap("ps", waited_s=1.0)  # the hook's wait was measured with another clock
    b = timer.result()
    assert b is not None and b.total_ms("wsp_wait") == 100 / 1e6 and b.total_ms("ps") == 0.0


def test_without_the_flag_nothing_is_timed() -> None:
    timer = lap_timer(False)
    timer.task("F")
    timer.lap("real_compute")
    assert timer.result() is None


def test_summary_and_table_show_each_category_per_task() -> None:
    stage = StageResult(rank=1, vw=0, stage=1, device="V:0", wall_s=0.01)
    ns = (("FB", "real_compute", 4_000_000), ("FB", "optimizer", 1_000_000),
          ("loop", "wait_neighbour", 3_000_000), ("FB", "other", 2_000_000))  # fmt: skip
    stage.breakdown = Breakdown(10_000_000, ns, (("FB", 4),))
    unprofiled = StageResult(rank=0, vw=0, stage=0, device="Q:0")
    [row] = breakdown_json([unprofiled, stage])
    assert row["ms"] == {c: 0.0 for c in CATEGORIES} | {
        "real_compute": 4.0, "optimizer": 1.0, "wait_neighbour": 3.0, "other": 2.0
    }  # fmt: skip
    assert row["overhead_ms_per_task"] == (1.0 + 2.0) / 4  # optimizer + other, per task
    assert row["ms_by_kind"]["loop"] == {"wait_neighbour": 3.0}
    table = breakdown_table([unprofiled, stage])
    assert table is not None
    console = Console(width=120, record=True)
    console.print(table)
    text = console.export_text()
    assert "vw0 s1" in text and "1.000 (40%)" in text  # real compute: 4 ms / 4 tasks, 40 %
    assert breakdown_table([unprofiled]) is None


def test_the_note_predicts_the_plan_again_with_the_measured_overhead() -> None:
    """The front end's note (:mod:`hetpipe.overhead`) over the runtime's measured overhead."""
    import re

    from hetpipe.overhead import overhead_note
    from planner.sim.simulator import simulate
    from tests.planner.simplan import make_plan

    plan = make_plan([[("V", 2.0, 4.0), ("R", 2.5, 5.0)]], nm=2, D=0)
    stages = [StageResult(rank=s, vw=0, stage=s, device=f"G:{s}") for s in range(2)]
    for s, other_ms in zip(stages, (1.0, 3.0), strict=True):  # 1 and 3 ms per task
        s.breakdown = Breakdown(int(other_ms * 1e6), (("FB", "other", int(other_ms * 1e6)),),
                                (("FB", 1),))  # fmt: skip
    assert mean_overhead_ms_per_task(stages) == 2.0
    note = overhead_note(plan, stages, measured=10.0)
    found = re.search(r"\(2\.000 ms per task, mean of the stages\): ([\d.]+) samples/s", note)
    assert found is not None, note
    predicted = float(found.group(1))
    assert predicted == round(simulate(plan, overhead_ms_per_task=2.0).throughput, 1)
    assert predicted < simulate(plan).throughput
    assert mean_overhead_ms_per_task([StageResult(rank=0, vw=0, stage=0, device="G:0")]) == 0.0


def test_on_an_emulated_device_work_inside_the_planned_window_is_not_overhead() -> None:
    """The optimizer step runs inside an emulated task's planned window (device work): only
    the time outside it (a send here) and any lateness count as the runtime's overhead."""
    ticks = _clock(0, 0, 10_000_000)
    timer = LapTimer(lambda: next(ticks))
    timer.task("FB")
    timer.planned(0.006)  # 6 ms planned
    b = timer.result()
    assert b is not None and b.planned_ns == 6_000_000
    ms = {"real_compute": 2, "optimizer": 1, "paced": 3, "wsp_wait": 2, "send_recv": 2}
    ns = tuple(("FB", c, v * 1_000_000) for c, v in ms.items())
    paced = Breakdown(10_000_000, ns, (("FB", 1),), planned_ns=6_000_000)
    assert paced.overhead_ms_per_task() == 2.0  # 10 - 2 waiting - 6 planned: the send
    late = Breakdown(10_000_000, ns, (("FB", 1),), planned_ns=2_000_000)
    assert late.overhead_ms_per_task() == 6.0  # the task ran 4 ms past its plan, +2 send
    unpaced = Breakdown(10_000_000, ns, (("FB", 1),))
    assert unpaced.overhead_ms_per_task() == 6.0  # 10 - 2 waiting - 2 real compute
