"""`hetpipe run` on a plan file: trains, prints the summary, writes metrics."""

from __future__ import annotations

import csv
from pathlib import Path

from typer.testing import CliRunner

from hetpipe.cli import app
from profiler.graph import ModelGraph
from runtime.config import ModelSource
from runtime.model import resolve_source
from runtime.plans import balanced_cuts, cpu_cluster, manual_plan


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


def test_run_cluster_with_a_bad_sync_is_one_red_line(tmp_path: Path) -> None:
    # a cluster without --model plans the built-in default (mlp): the README's first command
    cluster = tmp_path / "c.yaml"
    cluster.write_text("nodes:\n  - {name: A, gpu: TITAN V, count: 1}\n")
    res = CliRunner().invoke(app, ["run", str(cluster), "--sync", "bogus"])
    assert res.exit_code == 2
    assert "--sync 'bogus'" in res.output
