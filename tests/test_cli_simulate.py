"""`hetpipe simulate` end to end on a small synthetic plan (table, Gantt PNG/SVG, trace)."""

from __future__ import annotations

import json
from pathlib import Path

from typer.testing import CliRunner

from hetpipe.cli import app
from tests.planner.simplan import make_plan


def _plan(tmp_path: Path) -> Path:
    vw = [("V", 2.0, 4.0), ("R", 2.5, 5.0), ("G", 3.0, 6.0), ("Q", 3.0, 6.0)]
    return make_plan([vw, vw], nm=4, D=0, placement="local").save(tmp_path / "plan.yaml")


def _profile(tmp_path: Path) -> Path:
    """A profile of the synthetic plan's model (hetpipe cannot build it: simulate, like run,
    then needs the layers and bytes from somewhere)."""
    import pandas as pd

    from profiler.table import Profile, ProfileMeta

    rows = [
        {"layer": f"layer{j}", "op": "Linear", "inputs": f"layer{j - 1}" if j else "",
         "fwd_ms": 2.0, "bwd_ms": 4.0, "act_bytes": 1_000_000, "saved_bytes": 1_000_000,
         "param_bytes": 4_000_000, "buffer_bytes": 0, "mem_per_mb_bytes": 5_000_000,
         "peak_bytes": 0, "flops": 0.0}
        for j in range(4)
    ]  # fmt: skip
    meta = ProfileMeta("synthetic", "TITAN V", 32)
    return Profile(pd.DataFrame(rows), meta).save(tmp_path / "synthetic.csv")


def test_simulate_writes_table_gantt_and_trace(tmp_path: Path) -> None:
    plan = _plan(tmp_path)
    png, svg, trace = tmp_path / "g.png", tmp_path / "g.svg", tmp_path / "t.json"
    args = ["simulate", str(plan), "--waves", "5", "--baseline", "allreduce"]
    args += ["--profiles", str(_profile(tmp_path))]
    res = CliRunner().invoke(app, [*args, "--gantt", str(png), "--trace", str(trace)])
    assert res.exit_code == 0, res.output
    assert "samples/s" in res.output and "AllReduce" in res.output
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    doc = json.loads(trace.read_text())
    cats = {e.get("cat") for e in doc["traceEvents"] if e["ph"] == "X"}
    assert {"F", "B", "FB", "recv"} <= cats
    assert all(e["dur"] >= 0 for e in doc["traceEvents"] if e["ph"] == "X")
    res = CliRunner().invoke(app, [*args[:4], *args[6:], "--gantt", str(svg), "--actions"])
    assert res.exit_code == 0, res.output
    assert "<svg" in svg.read_text()[:2000]
    assert "schedule hetpipe" in res.output
    # Nm = 4 on four stages: stage 0 fills the pipeline, then one in as one completes
    assert "stage 0: F1 F2 F3 F4 B1 F5 " in res.output
    assert "stage 3: FB1 FB2 FB3 FB4 FB5 FB6 FB7 FB8\n" in res.output


def test_simulate_errors_are_one_line(tmp_path: Path) -> None:
    plan = _plan(tmp_path)
    for args in (
        ["simulate", str(plan), "--baseline", "horovod"],
        ["simulate", str(plan), "--gantt", str(tmp_path / "g.jpg")],
        ["simulate", str(tmp_path / "missing.yaml")],
        ["simulate", str(plan)],  # hetpipe cannot build its model, and no --profiles
    ):
        res = CliRunner().invoke(app, args)
        assert res.exit_code == 2, (args, res.output)
        assert "Traceback" not in res.output


def test_plan_and_simulate_the_allreduce_baseline(tmp_path: Path) -> None:
    """The DDP baseline has a plan like any run: made by 'plan --sync allreduce', predicted by
    'simulate' (BSP, ring all-reduce) with the same figure the plan records."""
    from planner.plan_file import load_plan

    out = tmp_path / "ar.yaml"
    cluster = Path(__file__).resolve().parents[1] / "examples" / "paper_cluster.yaml"
    res = CliRunner().invoke(
        app, ["plan", str(cluster), "--model", "resnet", "--sync", "allreduce", "-o", str(out)]
    )
    assert res.exit_code == 0, res.output
    plan = load_plan(out)
    assert plan.sync == "allreduce" and plan.shards == ()
    assert all(len(vw.stages) == 1 for vw in plan.virtual_workers)
    sim = CliRunner().invoke(app, ["simulate", str(out)])
    assert sim.exit_code == 0, sim.output
    assert f"{plan.predicted.throughput:.1f}" in sim.output
    bad = CliRunner().invoke(
        app, ["plan", str(cluster), "--model", "resnet", "--sync", "allreduce", "--nm", "2"]
    )
    assert bad.exit_code == 2 and "drop them with --sync allreduce" in bad.output


def test_simulate_adds_the_runtimes_overhead_per_task(tmp_path: Path) -> None:
    """``--overhead-ms-per-task`` (what ``run --profile-runtime`` measures) lengthens every
    task: the prediction drops; a negative one is one red line naming the flag."""
    import re

    plan = _plan(tmp_path)
    args = ["simulate", str(plan), "--waves", "5", "--profiles", str(_profile(tmp_path))]

    def throughput(*extra: str) -> float:
        res = CliRunner().invoke(app, [*args, *extra], env={"COLUMNS": "200"})
        assert res.exit_code == 0, res.output
        found = re.search(r"throughput: ([\d.]+) samples/s", res.output)
        assert found is not None, res.output
        return float(found.group(1))

    assert throughput("--overhead-ms-per-task", "3") < 0.9 * throughput()
    res = CliRunner().invoke(app, [*args, "--overhead-ms-per-task", "-1"])
    assert res.exit_code == 2 and "--overhead-ms-per-task -1.0" in res.output
