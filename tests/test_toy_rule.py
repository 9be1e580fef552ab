"""A rule is one vertical slice: a toy rule registered from the tests alone (``tests/toy_rule``
through ``$HETPIPE_RULES``) is planned, simulated and trained by the unchanged CLI."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
from typer.testing import CliRunner

from hetpipe.cli import app
from planner.manual import multi_vw_plan
from planner.plan_file import load_plan
from planner.rules import PLUGINS_ENV, every_vw, rules, time_ranked
from profiler.graph import ModelGraph
from runtime.config import ModelSource
from runtime.stage.model import resolve_source
from runtime.sync.registry import parts
from tests import toy_rule
from tests.conftest import EXAMPLES, PIPEDREAM

pytestmark = pytest.mark.timeout(120)

runner = CliRunner()
CLUSTER = str(EXAMPLES / "paper_cluster.yaml")
VGG = str(PIPEDREAM / "vgg16")


@pytest.fixture
def toy(monkeypatch: pytest.MonkeyPatch) -> None:
    """The toy rule plugged in for one test (removed after it)."""
    monkeypatch.setenv(PLUGINS_ENV, "tests.toy_rule")


def _said(res: object) -> str:
    return " ".join(str(getattr(res, "output", "")).split())


def test_the_toy_rule_exists_only_while_plugged_in(
    toy: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert "toy" in rules() and parts("toy").stage is not None
    monkeypatch.delenv(PLUGINS_ENV)
    assert "toy" not in rules()
    res = runner.invoke(app, ["plan", CLUSTER, "--profiles", VGG, "--beta", "0.1"])
    assert res.exit_code != 0 and "No such option" in res.output  # no flag without the rule


def test_plan_and_simulate_a_toy_rule(toy: None, tmp_path: Path) -> None:
    base = ["plan", CLUSTER, "--profiles", VGG, "--policy", "hd", "--vws", "2"]
    for extra, msg in [
        (["--beta", "0.25"], "--beta applies to --sync toy, not --sync wsp"),
        (["--sync", "toy", "--beta", "2"], "--beta 2.0: must be a finite number in (0, 1]"),
        (["--sync", "toy", "--beta", "0.75"], "beta x VWs must be <= 1, got 0.75 x 2"),
    ]:
        res = runner.invoke(app, [*base, *extra])
        assert res.exit_code == 2 and msg in _said(res), res.output
    out = tmp_path / "plan.yaml"
    res = runner.invoke(app, [*base, "--sync", "toy", "--beta", "0.25", "-o", str(out)])
    assert res.exit_code == 0, res.output
    assert "synchronisation: toy (beta 0.25)" in _said(res)
    plan = load_plan(out)
    assert plan.sync == "toy" and dict(plan.sync_params) == {"beta": 0.25}
    res = runner.invoke(app, ["simulate", str(out), "--profiles", VGG])
    assert res.exit_code == 0, res.output
    assert "toy beta=0.25" in _said(res) and "WSP D=0" in _said(res)


def test_run_a_toy_rule_on_two_vws(toy: None, tmp_path: Path) -> None:
    graph = ModelGraph.from_spec(resolve_source(ModelSource(ref="mlp"), 16, meta=True))
    path = multi_vw_plan(graph, [(4,), (6,)], "mlp", 16, nm=2, D=1, n_shards=2).save(
        tmp_path / "plan.yaml"
    )
    out = tmp_path / "run"
    args = ["run", str(path), "--sync", "toy", "--beta", "0.5", "--steps", "4", "--out", str(out)]
    res = runner.invoke(app, [*args, "--no-progress", "--no-emulate"], env={"COLUMNS": "200"})
    assert res.exit_code == 0, res.output
    assert "2 VWs through 2 parameter-server shards (toy beta=0.5)" in _said(res)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["sync"] == "toy" and summary["sync_params"] == {"beta": 0.5}
    assert all(vw["steps"] == 4 for vw in summary["vws"])


def test_a_broken_plug_in_is_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(PLUGINS_ENV, "tests.no_such_rule")
    res = runner.invoke(app, ["plan", CLUSTER, "--profiles", VGG])
    assert res.exit_code == 2, res.output
    assert "HETPIPE_RULES: cannot import rule module 'tests.no_such_rule'" in _said(res)
    monkeypatch.setenv(PLUGINS_ENV, "tests.conftest")  # a module, but not a rule's
    res = runner.invoke(app, ["plan", CLUSTER, "--profiles", VGG])
    assert res.exit_code == 2 and "rule module 'tests.conftest' defines no RULE" in _said(res)


def test_objective_time_reads_the_rules_declaration(
    toy: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The toy rule declares no ``time_delays``: ``--objective time`` refuses it (it used to
    rank it as WSP); once declared, it is ranked with no edit outside the tests."""
    res = runner.invoke(app, ["plan", CLUSTER, "--sync", "toy", "--objective", "time"])
    assert res.exit_code == 2, res.output
    assert "under --sync wsp or backup with AllReduce; drop --sync toy" in _said(res)
    assert "toy" not in time_ranked()
    monkeypatch.setattr(toy_rule, "RULE", replace(toy_rule.RULE, time_delays=every_vw))
    assert time_ranked() == ("wsp", "backup", "toy")
