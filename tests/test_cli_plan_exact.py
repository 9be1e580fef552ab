"""`hetpipe plan`: the auto candidates table, the proven-optimal / gap line, option errors."""

from __future__ import annotations

import json
from pathlib import Path

from typer.testing import CliRunner

from hetpipe.cli import app
from tests.conftest import EXAMPLES, PIPEDREAM

runner = CliRunner()
CLUSTER = str(EXAMPLES / "paper_cluster.yaml")
VGG = str(PIPEDREAM / "vgg16")


def test_auto_prints_the_candidates_it_compared() -> None:
    res = runner.invoke(
        app, ["plan", CLUSTER, "--profiles", VGG, "--policy", "auto", "--auto-max-vw-gpus", "4"]
    )
    assert res.exit_code == 0, res.output
    assert "candidates compared" in res.output and "chosen" in res.output
    out = " ".join(res.output.split())
    assert "4xVRGQ" in out and "2xVVQQ 2xRRGG" in out  # ED and HD, Table 3
    assert "infeasible (1)" in out and "(1) np" in out  # NP with 8 VWs: GG cannot hold vgg16
    assert "proven" in out and "chosen (exact)" in out
    res = runner.invoke(
        app,
        ["plan", CLUSTER, "--profiles", VGG, "--policy", "auto", "--auto-max-vw-gpus", "4",
         "--auto-budget", "0"],
    )  # fmt: skip
    assert res.exit_code == 0, res.output
    out = " ".join(res.output.split())
    # no budget: the plain policies' own allocations are solved, the other candidates are cut
    assert "budget 0 CPU s" in out and out.count("cut by budget") == 3
    assert "4xVRGQ" in out and "2xVVQQ 2xRRGG" in out and out.count("exact") == 3


def test_max_cuts_plan_states_its_gap(tmp_path: Path) -> None:
    one = tmp_path / "one.yaml"
    one.write_text("nodes:\n  - {name: n, gpu: V100, count: 4}\n", encoding="utf-8")
    gnmt = str(PIPEDREAM / "gnmt")
    res = runner.invoke(app, ["plan", str(one), "-p", gnmt, "--policy", "np", "--max-cuts", "0"])
    assert res.exit_code == 2 and "--vws" in res.output  # gnmt keeps 1 cut: 2 segments < 4 GPUs
    res = runner.invoke(
        app,
        ["plan", str(one), "-p", gnmt, "--policy", "np", "--vws", "2", "--max-cuts", "0", "--json"],
    )
    assert res.exit_code == 0, res.output
    vw = json.loads(res.stdout)["virtual_workers"][0]
    slowest = max(s["time_ms"] for s in vw["stages"])
    assert 0 < vw["bound_ms"] < slowest  # coarsened: a proven lower bound, and a gap
    exact = runner.invoke(
        app, ["plan", str(one), "-p", gnmt, "--policy", "np", "--vws", "2", "--json"]
    )
    vw_exact = json.loads(exact.stdout)["virtual_workers"][0]
    assert vw_exact["bound_ms"] == max(s["time_ms"] for s in vw_exact["stages"])
    assert vw["bound_ms"] <= vw_exact["bound_ms"] * (1 + 1e-9)


def test_bad_limits_are_one_line() -> None:
    res = runner.invoke(app, ["plan", CLUSTER, "--profiles", VGG, "--time-limit", "0"])
    assert res.exit_code == 2 and "--time-limit 0.0: must be a finite number > 0" in res.output


def test_many_vws_print_a_summary_unless_full(tmp_path: Path) -> None:
    types = ("TITAN V", "TITAN RTX", "GeForce RTX 2060", "Quadro P4000")
    nodes = "\n".join(f"  - {{name: n{i}, gpu: {types[i % 4]}, count: 4}}" for i in range(12))
    cluster = tmp_path / "c.yaml"
    cluster.write_text(f"name: twelve\nnodes:\n{nodes}\n")
    args = ["plan", str(cluster), "--profiles", VGG, "--policy", "np"]
    res = runner.invoke(app, args)
    assert res.exit_code == 0, res.output
    out = " ".join(res.output.split())
    assert "12 VWs of 4 kinds: one of each shown" in out and out.count("(x3)") == 4
    assert "11 VVVV" not in out.replace("│", " ") and "--full lists every VW" in out
    full = runner.invoke(app, [*args, "--full"])
    assert full.exit_code == 0, full.output
    rows = " ".join(full.output.replace("│", " ").split())
    assert all(f"{v} {t * 4}" in rows for v, t in zip(range(12), "VRGQ" * 3, strict=True))
    assert "(x3)" not in rows and "kinds" not in rows
