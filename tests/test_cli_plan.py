"""`hetpipe plan` on the command line."""

from __future__ import annotations

import json
from pathlib import Path

from typer.testing import CliRunner

from hetpipe.cli import app
from planner.plan_file import load_plan
from tests.conftest import EXAMPLES, PIPEDREAM

runner = CliRunner()
CLUSTER = str(EXAMPLES / "paper_cluster.yaml")
VGG = str(PIPEDREAM / "vgg16")


def test_json_contract(tmp_path: Path) -> None:
    out = tmp_path / "plan.yaml"
    res = runner.invoke(
        app, ["plan", CLUSTER, "--profiles", VGG, "--policy", "hd", "-o", str(out), "--json"]
    )
    assert res.exit_code == 0, res.output
    d = json.loads(res.stdout)
    vw = d["virtual_workers"][0]
    assert {"node", "type"} <= set(vw["gpus"][0])
    assert {"gpu", "first_layer", "last_layer"} <= set(vw["stages"][0])
    assert d["nm"] >= 1 and d["D"] == 0 and d["predicted"]["throughput"] > 0
    # Table 3 HD: two VWs of two V + two Q, two of two R + two G (pipeline order is the MILP's)
    letters = sorted("".join(sorted(v["signature"])) for v in d["virtual_workers"])
    assert letters == ["GGRR", "GGRR", "QQVV", "QQVV"]
    assert load_plan(out).to_dict() == d


def test_table_output_and_notes() -> None:
    res = runner.invoke(
        app,
        ["plan", CLUSTER, "--profiles", VGG, "--policy", "ed", "--placement", "local", "-D", "2"],
    )
    assert res.exit_code == 0, res.output
    assert "predicted throughput" in res.output and "scaled from V100" in res.output
    assert "global staleness" in res.output


def test_bad_inputs_exit_2(tmp_path: Path) -> None:
    out = tmp_path / "plan.yaml"
    res = runner.invoke(app, ["plan", CLUSTER, "--profiles", VGG, "--policy", "xx", "-o", str(out)])
    assert res.exit_code == 2 and "unknown allocation policy" in res.output
    res = runner.invoke(
        app, ["plan", CLUSTER, "--profiles", VGG, "--model", "resnet152", "-o", str(out)]
    )
    assert res.exit_code == 2 and "not 'resnet152'" in res.output
    res = runner.invoke(
        app, ["plan", CLUSTER, "--profiles", VGG, "--policy", "np", "--placement", "local"]
    )
    assert res.exit_code == 2 and "placement 'local'" in res.output
    assert not out.exists()


def test_memory_manager_column_and_bad_memory(tmp_path: Path) -> None:
    emulated = str(EXAMPLES / "emulated_cluster.yaml")
    args = ["plan", emulated, "--model", "mlp(hidden=400,depth=8)", "--batch-size", "32"]
    args += ["--policy", "ed", "--vws", "1", "--optimizer", "sgd"]
    out = tmp_path / "plan.yaml"
    res = runner.invoke(app, [*args, "--memory", "auto", "-o", str(out)], env={"COLUMNS": "200"})
    assert res.exit_code == 0, res.output
    assert "WAOG host" in res.output
    assert any(s.memory != "keep" for s in load_plan(out).virtual_workers[0].stages)
    res = runner.invoke(app, [*args, "--memory", "all:offload"])
    assert res.exit_code == 2 and "--memory" in res.output
