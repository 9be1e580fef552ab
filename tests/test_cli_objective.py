"""``hetpipe plan --objective time`` end to end on the emulated example cluster."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from hetpipe.cli import app
from planner.plan_file import load_plan
from tests.conftest import EXAMPLES

CLUSTER = str(EXAMPLES / "emulated_cluster.yaml")


def test_time_objective_ranks_candidates_and_records_the_pick(tmp_path: Path) -> None:
    out = tmp_path / "plan.yaml"
    args = ["plan", CLUSTER, "--model", "mlp", "--vws", "1", "--policy", "ed", "--optimizer",
            "sgd", "--objective", "time", "--target-samples", "46080", "-o", str(out)]  # fmt: skip
    res = CliRunner().invoke(app, args, env={"COLUMNS": "200"})
    assert res.exit_code == 0, res.output
    assert "objective time: candidates by predicted time to target" in res.output
    assert "allreduce" in res.output and "wsp ed 1 VW Nm 1 " in res.output
    assert "default (no data)" in res.output  # no --calibrate-efficiency: says so
    chosen = [line for line in res.output.splitlines() if "chosen" in line]
    assert len(chosen) == 1 and "x1.00" in chosen[0]
    plan = load_plan(out)
    assert plan.objective["objective"] == "time" and plan.objective["candidates"] > 3
    assert plan.objective["target_samples"] == 46080 and plan.objective["seconds_to_target"] > 0
    label = chosen[0].split("│")[1].strip()
    assert label.startswith(f"{plan.sync} ")
    pipelined = plan.sync != "allreduce"  # the baseline's label names its devices, not an Nm
    assert (f"Nm {plan.nm}" in label) == pipelined
    assert (plan.remedy != "none") == (f"--remedy {plan.remedy}" in res.output)


def test_throughput_is_the_default_and_is_recorded(tmp_path: Path) -> None:
    out = tmp_path / "plan.yaml"
    res = CliRunner().invoke(
        app, ["plan", CLUSTER, "--model", "mlp", "-o", str(out)], env={"COLUMNS": "200"}
    )
    assert res.exit_code == 0, res.output
    assert "objective time" not in res.output
    plan = load_plan(out)
    assert plan.objective == {"objective": "throughput"}
    pr = plan.predicted  # the example cluster's runtime_overhead, charged and shown
    assert pr.overhead_ms_per_task > 0 and pr.throughput < pr.throughput_without_overhead
    shown = f"{pr.overhead_ms_per_task:.2f} ms per task (the cluster's runtime_overhead)"
    assert shown in res.output and f"without it {pr.throughput_without_overhead:.1f}" in res.output
    waves = f"{pr.overhead_ms_per_wave:.2f} ms + {pr.overhead_ms_per_mb:.2f} ms per MB of its"
    assert pr.overhead_ms_per_wave > 0 and waves in res.output  # the per-wave terms too


def test_time_objective_refuses_rules_it_does_not_model() -> None:
    res = CliRunner().invoke(app, ["plan", CLUSTER, "--sync", "easgd", "--objective", "time"])
    assert res.exit_code == 2
    assert (
        "--objective time compares HetPipe plans" in res.output
        and "drop --sync easgd" in res.output
    )


def test_json_gets_the_plan_on_stdout_and_the_table_on_stderr() -> None:
    args = ["plan", CLUSTER, "--model", "mlp", "--vws", "1", "--policy", "ed", "--objective",
            "time", "--nm", "2", "--json"]  # fmt: skip
    res = CliRunner().invoke(app, args)
    assert res.exit_code == 0, res.output
    doc = json.loads(res.stdout)
    assert doc["objective"]["objective"] == "time" and doc["objective"]["candidates"] >= 2
    assert doc["nm"] <= 2 and "Nm 3" not in res.stderr  # --nm caps every candidate
    assert "objective time: candidates" in res.stderr


def test_calibrated_inputs_reach_the_table_and_the_plan(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``--calibrate-efficiency builtin`` calibrates on the model's own data (digits for mlp);
    the measurement itself is tests/test_calibrate.py's, replaced here by a stand-in."""
    from hetpipe.calibrate import Recipe
    from planner.efficiency import EfficiencyInputs
    from runtime.config import OptimizerConfig

    seen: dict[str, object] = {}

    def fake(dataset: object, spec: object, batch: int, recipe: Recipe,
             progress: object) -> EfficiencyInputs:  # fmt: skip
        seen.update(n=len(dataset), batch=batch, recipe=recipe)  # type: ignore[arg-type]
        progress("sequential lr 0.02")  # type: ignore[operator]
        record = {"lr": recipe.lr, "lr_mode": "fixed"}
        return EfficiencyInputs(1e9, {"none": 5.0, "predict": 5.0}, "calibrated (stand-in)", record)

    monkeypatch.setattr("hetpipe.calibrate.calibrate", fake)
    out = tmp_path / "plan.yaml"
    args = ["plan", CLUSTER, "--model", "mlp", "--vws", "1", "--policy", "ed", "--nm", "2",
            "--objective", "time", "--calibrate-efficiency", "builtin", "--lr", "0.02",
            "--calibrate-lr", "fixed", "-o", str(out)]  # fmt: skip
    res = CliRunner().invoke(app, args, env={"COLUMNS": "200"})
    assert res.exit_code == 0, res.output
    # --optimizer momentum: momentum 0.9 by default; the run's default seed
    recipe = Recipe(OptimizerConfig("sgd", lr=0.02, momentum=0.9), tuned=False, seed=0)
    assert seen == {"n": 1797, "batch": 32, "recipe": recipe}
    assert "calibrated (stand-in)" in res.output and "default (no data)" not in res.output
    assert "calibration: 1 run in" in res.output
    plan = load_plan(out)  # phi 1e9: big batches are free, delay costs 5 per update
    assert plan.sync == "allreduce" and plan.objective["source"] == "calibrated (stand-in)"
    assert plan.objective["calibration"] == {"lr": 0.02, "lr_mode": "fixed"}
    assert "AllReduce on" in res.output


def test_an_adam_plan_is_calibrated_with_adam_at_the_given_seed_and_decay(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``--optimizer adam --seed 7 --weight-decay 0.01``: the calibration trains Adam (no SGD
    momentum, no ``predict``) with that weight decay from the weights a run with ``--seed 7``
    starts from."""
    from hetpipe.calibrate import Recipe
    from planner.efficiency import EfficiencyInputs
    from runtime.config import OptimizerConfig

    seen: list[Recipe] = []

    def fake(dataset: object, spec: object, batch: int, recipe: Recipe,
             progress: object) -> EfficiencyInputs:  # fmt: skip
        seen.append(recipe)
        return EfficiencyInputs(64.0, {"none": 0.5, "pipemare": 0.5}, "calibrated (stand-in)")

    monkeypatch.setattr("hetpipe.calibrate.calibrate", fake)
    args = ["plan", CLUSTER, "--model", "mlp", "--vws", "1", "--policy", "ed", "--nm", "2",
            "--objective", "time", "--optimizer", "adam", "--calibrate-efficiency", "builtin",
            "--lr", "0.01", "--seed", "7", "--weight-decay", "0.01"]  # fmt: skip
    res = CliRunner().invoke(app, args, env={"COLUMNS": "200"})
    assert res.exit_code == 0, res.output
    assert seen == [Recipe(OptimizerConfig("adam", lr=0.01, weight_decay=0.01), seed=7)]
    assert seen[0].remedies == ("none", "pipemare")


@pytest.mark.parametrize(
    ("args", "fragment"),
    [(["--lr", "0"], "--lr 0.0: must be"),
     (["--momentum", "1.5"], "--momentum 1.5: must be"),
     (["--calibrate-lr", "best"], "--calibrate-lr"),
     (["--lr", "0.01"], "--lr 0.01 sets how the efficiency calibration trains; add "
                        "--calibrate-efficiency DATA, or drop --lr"),
     (["--seed", "3"], "--seed 3 sets how the efficiency calibration trains"),
     (["--weight-decay", "0.1"], "--weight-decay 0.1 sets how the efficiency calibration "
                                 "trains"),
     (["--seed", "-1"], "--seed -1: must be"),
     (["--calibrate-efficiency", "builtin", "--optimizer", "adam", "--momentum", "0.9"],
      "--momentum 0.9 with --optimizer adam: Adam's moments follow its betas, not SGD's "
      "momentum; drop --momentum, or give --optimizer momentum"),
     (["--calibrate-lr", "fixed"], "drop --calibrate-lr"),
     (["--calibrate-efficiency", "builtin", "--optimizer", "sgd", "--momentum", "0.9"],
      "--momentum 0.9 with --optimizer sgd: plain SGD keeps no velocity; give --optimizer "
      "momentum, or drop --momentum")],
)  # fmt: skip
def test_calibration_step_size_options_are_one_line(args: list[str], fragment: str) -> None:
    base = ["plan", CLUSTER, "--model", "mlp", "--objective", "time"]
    res = CliRunner().invoke(app, [*base, *args], env={"COLUMNS": "300"})
    assert res.exit_code == 2 and fragment in res.output, res.output
    assert len(res.output.strip().splitlines()) == 1, res.output


def test_d_values_reach_the_table_and_the_plan(tmp_path: Path) -> None:
    """``--d-values 0,1``: the one VW through shards is planned at each D (D = 1 drops the
    fold wait), the table shows each candidate's D and the plan records what was compared."""
    out = tmp_path / "plan.yaml"
    args = ["plan", CLUSTER, "--model", "mlp", "--vws", "1", "--policy", "ed", "--nm", "2",
            "--objective", "time", "--d-values", "1, 0", "-o", str(out)]  # fmt: skip
    res = CliRunner().invoke(app, args, env={"COLUMNS": "200"})
    assert res.exit_code == 0, res.output
    rows = {line.split("│")[1].strip(): line.split("│")[2].strip()
            for line in res.output.splitlines() if "│ wsp ed" in line}  # fmt: skip
    assert rows["wsp ed 1 VW Nm 2 D 1"] == "1" and rows["wsp ed 1 VW Nm 2"] == "0"
    plan = load_plan(out)
    assert plan.objective["d_values"] == [0, 1]


def test_an_explicit_d_is_the_only_one_compared(tmp_path: Path) -> None:
    out = tmp_path / "plan.yaml"
    args = ["plan", CLUSTER, "--model", "mlp", "--vws", "1", "--policy", "ed", "--nm", "1",
            "--objective", "time", "-D", "2", "-o", str(out)]  # fmt: skip
    res = CliRunner().invoke(app, args, env={"COLUMNS": "200"})
    assert res.exit_code == 0, res.output
    labels = [line.split("│")[1].strip() for line in res.output.splitlines() if "│ wsp" in line]
    assert labels == ["wsp ed 1 VW Nm 1 D 2"]  # not at D 0, 1
    assert load_plan(out).objective["d_values"] == [2]


@pytest.mark.parametrize(
    ("args", "fragment"),
    [(["--objective", "time", "--d-values", "0,x"],
      "--d-values '0,x': 'x' is not a whole number >= 0; give thresholds such as 0,1,2"),
     (["--objective", "time", "--d-values", "0,-1"], "'-1' is not a whole number >= 0"),
     (["--objective", "time", "--d-values", "1,\u00b2"], "'\u00b2' is not a whole number"),
     (["--objective", "time", "--d-values", "0,1", "-D", "1"],
      "--d-values '0,1' and -D 1 both set D; give one of them"),
     (["--d-values", "0,1"], "--d-values '0,1' sets the D values --objective time compares; "
                             "add --objective time, or drop --d-values")],
)  # fmt: skip
def test_bad_d_values_are_one_line(args: list[str], fragment: str) -> None:
    res = CliRunner().invoke(app, ["plan", CLUSTER, "--model", "mlp", *args],
                             env={"COLUMNS": "300"})  # fmt: skip
    assert res.exit_code == 2 and fragment in res.output, res.output
    assert len(res.output.strip().splitlines()) == 1, res.output
