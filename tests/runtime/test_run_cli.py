"""`hetpipe run` on a plan file: trains, prints the summary, writes metrics."""

from __future__ import annotations

import csv
import itertools
import json
from pathlib import Path

from typer.testing import CliRunner

from hetpipe.cli import app
from planner.manual import balanced_cuts, cpu_cluster, manual_plan
from profiler.graph import ModelGraph
from runtime.config import ModelSource
from runtime.persist.snapshot import committed_clocks
from runtime.stage.model import resolve_source


def test_run_plan_file_prints_summary_and_writes_metrics(tmp_path: Path) -> None:
    graph = ModelGraph.from_spec(resolve_source(ModelSource(ref="mlp"), 16, meta=True))
    cluster = cpu_cluster(2, speed=1.0, memory_bytes=64 << 20)
    plan = manual_plan(graph, balanced_cuts(graph, 2), "mlp", 16, 2, cluster)
    plan_path = plan.save(tmp_path / "plan.yaml")
    out = tmp_path / "run"
    res = CliRunner().invoke(
        app,
        ["run", str(plan_path), "--steps", "8", "--out", str(out), "--no-progress", "--seed", "2"],
    )
    assert res.exit_code == 0, res.output
    assert "8 minibatches x 16 samples" in res.output
    assert "bound" in res.output  # emulated: the calibrated 1/slowest-stage bound is shown
    with (out / "metrics.csv").open() as f:
        rows = list(csv.DictReader(f))
    assert [int(r["minibatch"]) for r in rows] == list(range(1, 9))
    assert (out / "calibration.json").exists() and (out / "weights.pt").exists()
    # the measured timeline: every task of every stage, one at a time per device
    assert (out / "timeline.png").stat().st_size > 0
    events = json.loads((out / "trace.json").read_text())["traceEvents"]
    tasks = [e for e in events if e["ph"] == "X" and e["cat"] in ("F", "B", "FB")]
    for tid, n_tasks in ((1, 16), (2, 8)):  # stage 0: F and B of 8 minibatches; last: FB
        mine = sorted((e["ts"], e["ts"] + e["dur"]) for e in tasks if e["tid"] == tid)
        assert len(mine) == n_tasks
        assert all(end <= nxt + 1e-3 for (_, end), (nxt, _) in itertools.pairwise(mine))


def test_run_cluster_with_a_bad_sync_is_one_red_line(tmp_path: Path) -> None:
    # a cluster without --model plans the built-in default (mlp): the README's first command
    cluster = tmp_path / "c.yaml"
    cluster.write_text("nodes:\n  - {name: A, gpu: TITAN V, count: 1}\n")
    res = CliRunner().invoke(app, ["run", str(cluster), "--sync", "bogus"])
    assert res.exit_code == 2
    assert "--sync 'bogus'" in res.output


def test_emulated_planned_run_is_paced_by_the_plans_stage_times(tmp_path: Path) -> None:
    """The pacing table of a planned run is the plan's own stage times (x speed = solo), not a
    fresh measurement: the simulator and the emulated devices share one source of truth."""
    from hetpipe.planning import profiles_for
    from planner.cluster import load_cluster
    from planner.planner import make_plan

    root = Path(__file__).resolve().parents[2]
    cluster = load_cluster(root / "examples" / "emulated_cluster.yaml")
    cpu = profiles_for(cluster, [], "mlp", 16)
    plan = make_plan(cluster, cpu, model="mlp", batch_size=16, policy="ed", optimizer="sgd")
    path = plan.save(tmp_path / "plan.yaml")
    out = tmp_path / "run"
    args = ["run", str(path), "--vw", "0", "--steps", "4", "--out", str(out), "--no-progress",
            "--profile-runtime"]  # fmt: skip
    res = CliRunner().invoke(app, args)
    assert res.exit_code == 0, res.output
    _check_breakdown(out, res.output, len(plan.virtual_workers[0].stages))
    table = json.loads((out / "calibration.json").read_text())
    worker = plan.virtual_workers[0]
    speeds = [worker.gpus[st.gpu].speed for st in worker.stages]
    assert table["key"].endswith("|plan")
    for s, (st, v) in enumerate(zip(worker.stages, speeds, strict=True)):
        assert abs(table["fwd_s"][s] / v * 1e3 - st.fwd_ms) < 1e-9
        assert abs(table["bwd_s"][s] / v * 1e3 - st.bwd_ms) < 1e-9


def _check_breakdown(out: Path, output: str, n_stages: int) -> None:
    """``--profile-runtime``: every stage's categories add up to its wall time, the summary
    holds them and the terminal shows the table."""
    from runtime.results.breakdown import CATEGORIES

    assert "where each stage's time went" in output
    stages = json.loads((out / "summary.json").read_text())["runtime_breakdown"]
    assert [s["stage"] for s in stages] == list(range(n_stages))
    for s in stages:
        assert set(s["ms"]) == set(CATEGORIES)
        assert all(ms >= 0 for ms in s["ms"].values())
        assert abs(sum(s["ms"].values()) - s["wall_ms"]) < 0.01 * s["wall_ms"] + 1.0
        assert abs(s["wall_ms"] - s["stage_wall_ms"]) < 0.1 * s["stage_wall_ms"] + 50.0
        assert s["ms"]["real_compute"] > 0 and s["ms"]["paced"] > 0  # emulated: both timed
        assert s["planned_ms"] > 0 and s["overhead_ms_per_task"] >= 0
        assert sum(s["tasks"].values()) == (8 if s["stage"] < n_stages - 1 else 4)


def test_run_sync_allreduce_takes_the_run_options_and_prints_the_summary(tmp_path: Path) -> None:
    """The AllReduce baseline runs a plan made by the planner, with the same options as the
    pipelines (here --time-limit, --lr-schedule, --out), and prints a summary table."""
    examples = Path(__file__).resolve().parents[2] / "examples"
    out = tmp_path / "ddp"
    res = CliRunner().invoke(
        app,
        ["run", str(examples / "emulated_cluster.yaml"), "--sync", "allreduce", "--time-limit",
         "1", "--lr-schedule", "cosine", "--out", str(out), "--no-progress"],
    )  # fmt: skip
    assert res.exit_code == 0, res.output
    assert "allreduce (BSP)" in res.output and "predicted" in res.output  # the summary table
    figures = json.loads((out / "summary.json").read_text())  # the same outputs as WSP's
    assert figures["sync"] == "allreduce" and figures["stopped_by"].startswith("time limit")
    assert len({vw["steps"] for vw in figures["vws"]}) == 1 and figures["vws"][0]["steps"] >= 2
    assert (out / "weights.pt").exists()


def test_run_sync_allreduce_refuses_pipeline_options() -> None:
    examples = Path(__file__).resolve().parents[2] / "examples"
    res = CliRunner().invoke(
        app, ["run", str(examples / "emulated_cluster.yaml"), "--sync", "allreduce", "--nm", "3"]
    )
    assert res.exit_code == 2
    assert "--nm does not apply to --sync allreduce" in res.output


def test_run_sync_allreduce_resumes_from_its_out_directory(tmp_path: Path) -> None:
    """``--resume DIR`` of an AllReduce run goes on from its newest snapshot (its plan.json);
    ``--keep 0`` keeps every snapshot (one per ``--checkpoint-every`` steps)."""
    examples = Path(__file__).resolve().parents[2] / "examples"
    out = tmp_path / "ddp"
    base = ["run", str(examples / "emulated_cluster.yaml"), "--sync", "allreduce", "--no-progress",
            "--no-emulate", "--checkpoint-every", "2"]  # fmt: skip
    res = CliRunner().invoke(app, [*base, "--steps", "4", "--out", str(out), "--keep", "0"])
    assert res.exit_code == 0, res.output
    assert committed_clocks(out / "checkpoints") == [2, 4]  # --keep 0: every snapshot stays
    res = CliRunner().invoke(app, [*base, "--steps", "6", "--resume", str(out)])
    assert res.exit_code == 0, res.output
    figures = json.loads((out / "summary.json").read_text())
    assert {vw["steps"] for vw in figures["vws"]} == {2}  # steps 5-6 only
    assert figures["final_loss"] is not None


def test_run_with_a_bad_remedy_is_one_red_line(tmp_path: Path) -> None:
    cluster = tmp_path / "c.yaml"
    cluster.write_text("nodes:\n  - {name: A, gpu: TITAN V, count: 1}\n")
    res = CliRunner().invoke(app, ["run", str(cluster), "--remedy", "later"])
    assert res.exit_code == 2
    assert "--remedy 'later': use one of none, predict, pipemare" in res.output
    res = CliRunner().invoke(
        app, ["run", str(cluster), "--remedy", "predict", "--optimizer", "adam"]
    )
    assert res.exit_code == 2
    assert "--remedy predict follows SGD's update rule" in res.output
