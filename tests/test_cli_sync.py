"""`--sync backup` / `--sync easgd` on the command line: plan, refuse, simulate."""

from __future__ import annotations

from pathlib import Path

import yaml
from typer.testing import CliRunner

from hetpipe.cli import app
from planner.plan_file import load_plan
from tests.conftest import EXAMPLES, PIPEDREAM

runner = CliRunner()
CLUSTER = str(EXAMPLES / "paper_cluster.yaml")
VGG = str(PIPEDREAM / "vgg16")


def test_plan_with_a_rule_then_simulate_it(tmp_path: Path) -> None:
    out = tmp_path / "plan.yaml"
    args = ["plan", CLUSTER, "--profiles", VGG, "--policy", "hd", "-D", "2", "-o", str(out)]
    res = runner.invoke(app, [*args, "--sync", "backup", "--backups", "1"])
    assert res.exit_code == 0, res.output
    plan = load_plan(out)
    assert plan.sync == "backup" and dict(plan.sync_params) == {"backups": 1.0} and plan.D == 0
    assert "synchronisation: backup (backups 1)" in res.output
    res = runner.invoke(app, ["simulate", str(out), "--profiles", VGG])
    assert res.exit_code == 0, res.output
    assert "backup b=1" in res.output and "WSP D=0" in res.output
    res = runner.invoke(app, ["simulate", str(out), "--profiles", VGG, "--backups", "2"])
    assert res.exit_code == 0 and "backup b=2" in res.output, res.output  # its own rule
    again = ["simulate", str(out), "--profiles", VGG, "--sync", "easgd", "--tau", "3"]
    res = runner.invoke(app, again)
    assert res.exit_code == 0 and "EASGD tau=3" in res.output, res.output  # another rule
    res = runner.invoke(app, ["simulate", str(out), "--tau", "3"])
    assert res.exit_code == 2 and "--tau applies to --sync easgd, not --sync backup" in res.output
    doc = yaml.safe_load(out.read_text())
    doc["sync"], doc["sync_params"] = "easgd", {"tau": 2, "alpha": 0.2}
    out.write_text(yaml.safe_dump(doc))
    res = runner.invoke(app, ["simulate", str(out), "--profiles", VGG])
    assert res.exit_code == 0, res.output
    assert "EASGD tau=2" in res.output and "alpha=0.2" in res.output  # the cell may wrap


def test_rule_options_are_checked() -> None:
    base = ["plan", CLUSTER, "--profiles", VGG, "--policy", "hd"]
    cases = [
        (["--sync", "wsp", "--tau", "2"], "--tau applies to --sync easgd, not --sync wsp"),
        (["--sync", "backup", "--backups", "4"], "backups must be in 0..3"),
        (["--sync", "easgd", "--alpha", "0.5"], "use alpha <= 0.25"),
        (["--sync", "gossip"], "--sync 'gossip': use one of"),
    ]
    for extra, msg in cases:
        res = runner.invoke(app, [*base, *extra])
        assert res.exit_code == 2, res.output
        assert msg in " ".join(res.output.split()), res.output


def test_backup_with_a_time_limit_is_refused_before_training_starts(tmp_path: Path) -> None:
    cluster = str(EXAMPLES / "emulated_cluster.yaml")
    args = ["run", cluster, "--sync", "backup", "--backups", "1", "--time-limit", "5"]
    res = runner.invoke(app, [*args, "--out", str(tmp_path / "r")])
    assert res.exit_code == 2, res.output
    assert "--time-limit with --sync backup" in " ".join(res.output.split())
    assert "training" not in res.output.lower()  # refused before the header, nothing started
    assert not (tmp_path / "r").exists()


def test_every_command_takes_each_declared_rule_parameter() -> None:
    from planner.rules import BUILTIN

    declared = [(r.name, p) for r in BUILTIN.values() for p in r.params]
    assert {p.name for _, p in declared} == {"backups", "tau", "alpha"}
    for command in ("plan", "simulate", "run"):
        res = runner.invoke(app, [command, "--help"], env={"COLUMNS": "400"})
        assert res.exit_code == 0, res.output
        for rule, p in declared:
            assert f"--{p.name}" in res.output and f"--sync {rule}: {p.help}" in res.output
