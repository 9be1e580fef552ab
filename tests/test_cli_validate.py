"""Every number the command line takes is checked at once: a bad value is one line naming the
option, the value and the fix, exit code 2, before any file is read, anything is planned or
any process starts (``hetpipe run``/``plan``/``simulate`` and torchrun's ``python -m runtime``)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st
from typer.testing import CliRunner

from hetpipe.cli import app
from runtime.options import OPTIONS
from tests.conftest import EXAMPLES

CLUSTER = str(EXAMPLES / "emulated_cluster.yaml")

RUN_BAD = [
    ("--lr", "nan", "must be a finite number > 0"),
    ("--lr", "inf", "must be a finite number > 0"),
    ("--lr", "-1", "must be a finite number > 0"),
    ("--lr", "0", "must be a finite number > 0"),
    ("--momentum", "nan", "in [0, 1)"),
    ("--momentum", "1", "in [0, 1)"),
    ("--momentum", "-0.1", "in [0, 1)"),
    ("--weight-decay", "-1", ">= 0"),
    ("--epochs", "nan", ">= 0"),
    ("--epochs", "-1", ">= 0"),
    ("--timeout", "nan", "in (0, 1000000)"),
    ("--timeout", "0", "in (0, 1000000)"),
    ("--timeout", "1e300", "in (0, 1000000)"),
    ("--time-limit", "nan", ">= 0"),
    ("--time-limit", "-inf", ">= 0"),
    ("--checkpoint-every", "-1", "whole number >= 0"),
    ("--keep", "-1", "whole number >= 0"),
    ("--max-restarts", "-1", "whole number >= 0"),
    ("--remedy-warmup", "-5", "whole number >= 0"),
    ("--steps", "-1", "whole number >= 0"),
    ("--D", "-1", "whole number >= 0"),
    ("--nm", "-1", "whole number >= 0"),
    ("--vw", "-2", "whole number >= -1"),
    ("--seed", "-1", "whole number in [0, "),
]
"""Each numeric option of the shared table (``hetpipe run`` and ``python -m runtime``)."""

PLANNING_BAD = [
    ("run", "--batch-size", "0", ">= 1"),
    ("run", "--stages", "-1", ">= 0"),
    ("run", "--vws", "-1", ">= 0"),
    ("run", "--backups", "-1", ">= 0"),
    ("run", "--tau", "0", ">= 1"),
    ("run", "--alpha", "nan", "in (0, 1]"),
    ("run", "--alpha", "1.5", "in (0, 1]"),
    ("plan", "--batch-size", "0", ">= 1"),
    ("plan", "--nm", "0", ">= 1"),
    ("plan", "-D", "-1", ">= 0"),
    ("plan", "--vws", "0", ">= 1"),
    ("plan", "--time-limit", "nan", "> 0"),
    ("plan", "--time-limit", "0", "> 0"),
    ("plan", "--auto-budget", "nan", ">= 0"),
    ("plan", "--auto-budget", "-1", ">= 0"),
    ("plan", "--auto-max-vw-gpus", "0", ">= 1"),
    ("plan", "--max-cuts", "-1", ">= 0"),
    ("plan", "--tau", "0", ">= 1"),
    ("plan", "--target-samples", "-1", ">= 0"),
    ("plan", "--lr", "0", "> 0"),
    ("plan", "--momentum", "1.5", "in [0, 1)"),
    ("plan", "--seed", "-1", "in [0, "),
    ("plan", "--weight-decay", "-1", ">= 0"),
    ("simulate", "--waves", "1", ">= 2"),
    ("simulate", "--waves", "-5", ">= 2"),
]
"""The options only ``hetpipe run`` (planning on the fly), ``plan`` or ``simulate`` take."""

_RULE_OF = {"--backups": "backup", "--tau": "easgd", "--alpha": "easgd"}


@pytest.fixture
def nothing_read(monkeypatch: pytest.MonkeyPatch) -> None:
    """Reading the plan or cluster file, or planning, fails the test: the refusal must come
    first (it then takes no more than the CLI's start-up, not the 12-40 s of planning)."""

    def boom(*_: Any, **__: Any) -> None:
        raise AssertionError("a file was read or a plan made before the options were checked")

    for target in (
        "hetpipe.commands.run.load_plan_or_cluster",
        "hetpipe.commands.run.load_plan",
        "hetpipe.commands.plan.load_cluster",
        "hetpipe.commands.simulate.load_plan",
        "runtime.__main__.load_plan",
        "planner.planner.make_plan",
    ):
        monkeypatch.setattr(target, boom)


def _one_red_line(output: str, flag: str, value: str, fragment: str) -> None:
    lines = output.strip().splitlines()
    assert len(lines) == 1, output
    assert lines[0].startswith(f"error: {flag} "), output
    assert fragment in lines[0] and "give such a value, or drop it" in lines[0], output
    echoed = float(lines[0].split()[2].rstrip(":"))  # the value as parsed, e.g. 1e+300
    assert echoed == float(value) or (math.isnan(echoed) and math.isnan(float(value))), output


@pytest.mark.usefixtures("nothing_read")
@pytest.mark.parametrize(("flag", "value", "fragment"), RUN_BAD)
def test_run_refuses_a_number_out_of_range(flag: str, value: str, fragment: str) -> None:
    res = CliRunner().invoke(app, ["run", CLUSTER, flag, value])
    assert res.exit_code == 2, res.output
    _one_red_line(res.output, flag, value, fragment)


@pytest.mark.usefixtures("nothing_read")
@pytest.mark.parametrize(("flag", "value", "fragment"), RUN_BAD)
def test_torchrun_entry_refuses_the_same_numbers(
    flag: str, value: str, fragment: str, caplog: pytest.LogCaptureFixture
) -> None:
    from runtime.__main__ import main

    assert main([CLUSTER, f"{flag}={value}"]) == 2  # argparse reads a bare -1 as an option
    errors = [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]
    assert len(errors) == 1 and errors[0].startswith(f"{flag} "), errors
    assert fragment in errors[0]


CHOICES_BAD = [
    ("--optimizer", "lamb", "use one of sgd, adam"),
    ("--lr-schedule", "linear", "use one of constant, step, cosine, warmup"),
    ("--on-failure", "retry", "use one of stop, restart, continue"),
    ("--remedy", "spectrain", "use one of none, predict, pipemare"),
    ("--precision", "fp16", "use one of fp32, bf16"),
    ("--on-nonfinite", "ignore", "use one of stop, skip"),
]
"""Each text option of the shared table with a fixed set of values."""


@pytest.mark.usefixtures("nothing_read")
@pytest.mark.parametrize(("flag", "value", "fix"), CHOICES_BAD)
def test_run_and_torchrun_refuse_an_unknown_choice(
    flag: str, value: str, fix: str, caplog: pytest.LogCaptureFixture
) -> None:
    from runtime.__main__ import main

    res = CliRunner().invoke(app, ["run", CLUSTER, flag, value])
    assert res.exit_code == 2, res.output
    assert res.output.strip() == f"error: {flag} {value!r}: {fix}", res.output
    assert main([CLUSTER, flag, value]) == 2
    errors = [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]
    assert errors == [f"{flag} {value!r}: {fix}"]


@pytest.mark.usefixtures("nothing_read")
@pytest.mark.parametrize(
    ("flag", "value", "fix"),
    [("--objective", "speed", "use one of throughput, time"),
     ("--remedy", "spectrain", "use one of none, predict, pipemare")],
)  # fmt: skip
def test_plan_refuses_an_unknown_choice(flag: str, value: str, fix: str) -> None:
    res = CliRunner().invoke(app, ["plan", CLUSTER, flag, value])
    assert res.exit_code == 2, res.output
    assert res.output.strip() == f"error: {flag} {value!r}: {fix}", res.output


def test_the_old_schedule_flag_names_lr_schedule(caplog: pytest.LogCaptureFixture) -> None:
    """``--schedule`` was the lr schedule; it would now read as the pipeline schedule."""
    from runtime.__main__ import main

    fix = (
        "--schedule 'cosine': the learning-rate schedule is now --lr-schedule (a plan's "
        "schedule is its pipeline schedule); give --lr-schedule 'cosine'"
    )
    res = CliRunner().invoke(app, ["run", CLUSTER, "--schedule", "cosine"])
    assert res.exit_code == 2, res.output
    assert res.output.strip() == f"error: {fix}", res.output
    assert main([CLUSTER, "--schedule", "cosine"]) == 2
    errors = [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]
    assert errors == [fix]


def test_train_refuses_the_old_schedule_keyword() -> None:
    """``hetpipe.train(schedule=...)`` is refused like ``--schedule``, naming ``--lr-schedule``."""
    import hetpipe
    from profiler.errors import ConfigError

    with pytest.raises(ConfigError, match="is now --lr-schedule"):
        hetpipe.train("mlp", schedule="cosine")


@pytest.mark.usefixtures("nothing_read")
@pytest.mark.parametrize(("command", "flag", "value", "fragment"), PLANNING_BAD)
def test_planning_options_out_of_range(command: str, flag: str, value: str, fragment: str) -> None:
    rule = ["--sync", _RULE_OF[flag]] if flag in _RULE_OF else []
    res = CliRunner().invoke(app, [command, CLUSTER, *rule, flag, value])
    assert res.exit_code == 2, res.output
    _one_red_line(res.output, flag, value, fragment)


def test_every_numeric_option_of_the_table_has_a_range_and_a_bad_value_here() -> None:
    """A numeric option added to the table without a range (or without a case above) fails."""
    numeric = {
        o.flag
        for o in OPTIONS.values()
        if o.default is None or type(o.default) in (int, float)  # bool is not numeric here
    }
    assert numeric == {o.flag for o in OPTIONS.values() if o.range is not None}
    assert numeric == {flag for flag, _, _ in RUN_BAD}
    assert {o.flag for o in OPTIONS.values() if o.choices} == {f for f, _, _ in CHOICES_BAD}


# ---------------------------------------------------------------- simulate and run agree


def _plan_doc() -> dict[str, Any]:
    """A valid two-stage plan of the built-in mlp on two emulated CPU devices."""
    from planner.manual import cpu_cluster, hand_cut_plan
    from profiler.graph import ModelGraph
    from runtime.config import ModelSource
    from runtime.stage.model import resolve_source

    graph = ModelGraph.from_spec(resolve_source(ModelSource(ref="mlp"), 8, meta=True))
    cluster = cpu_cluster(2, speed=0.1, memory_bytes=1 << 30)
    doc = hand_cut_plan(graph, "mlp", 8, 2, cluster, 2).to_dict()
    for stage in doc["virtual_workers"][0]["stages"]:  # times, so that it can be simulated
        stage.update(fwd_ms=1.0, bwd_ms=2.0, time_ms=3.0)
    return doc


def _one_byte(doc: dict[str, Any]) -> None:
    """Every emulated device has 1 byte (consistent everywhere in the file)."""
    for node in doc["cluster"]["nodes"]:
        node["memory"] = node["emulate"]["memory"] = 1
    for vw in doc["virtual_workers"]:
        for gpu in vw["gpus"]:
            gpu["memory_bytes"] = 1
        for stage in vw["stages"]:
            stage["capacity_bytes"] = 1


PARITY = {
    "unknown model": (
        lambda d: d.update(model="nosuchmodel"),
        "model: unknown model 'nosuchmodel'",
    ),
    "not a factory": (lambda d: d.update(model="math:pi"), "has no callable 'pi'"),
    "1 byte": (_one_byte, "virtual_workers[0].stages[0]: its weights, gradients and optimizer"),
}


@pytest.mark.parametrize("case", list(PARITY))
def test_simulate_and_run_refuse_the_same_plans(
    case: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """What ``run`` refuses ``simulate`` refuses, in the same line, before it simulates or any
    process starts."""
    import json

    def boom(*_: Any, **__: Any) -> None:
        raise AssertionError("simulated or started although the plan does not fit its model")

    monkeypatch.setattr("planner.sim.simulator.simulate", boom)
    monkeypatch.setattr("runtime.run.run_plan", boom)
    doc = _plan_doc()
    mutate, fragment = PARITY[case]
    mutate(doc)
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(doc))
    lines = []
    for args in (["simulate", str(path)], ["run", str(path), "--out", str(tmp_path / "o")]):
        res = CliRunner().invoke(app, args)
        assert res.exit_code == 2, res.output
        assert len(res.output.strip().splitlines()) == 1 and fragment in res.output, res.output
        lines.append(res.output.strip())
    assert lines[0] == lines[1]
    assert lines[0].startswith(f"error: {path}: ")
    from runtime.__main__ import main

    assert main([str(path)]) == 2  # torchrun's entry: the same line, logged
    errors = [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]
    assert [f"error: {e}" for e in errors] == lines[:1]


def test_simulate_still_takes_the_unmutated_plan(tmp_path: Path) -> None:
    """The checks refuse what cannot run, not what can."""
    import json

    path = tmp_path / "plan.json"
    path.write_text(json.dumps(_plan_doc()))
    res = CliRunner().invoke(app, ["simulate", str(path), "--waves", "2"])
    assert res.exit_code == 0, res.output


# ---------------------------------------------------------------- --resume keeps the run's inputs


@pytest.fixture
def resumable(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[Path, Path, Path]:
    """A run directory whose ``plan.json`` was made for the emulated example cluster (what a
    run leaves), that cluster file and the plan file; training is replaced by a marker."""
    import yaml

    from planner.cluster import load_cluster
    from planner.manual import multi_vw_plan
    from profiler.errors import ConfigError
    from profiler.graph import ModelGraph
    from runtime.config import ModelSource
    from runtime.stage.model import resolve_source

    def reached(*_: Any, **__: Any) -> None:
        raise ConfigError("reached training")

    monkeypatch.setattr("runtime.run.run_plan", reached)
    cluster = load_cluster(CLUSTER)
    graph = ModelGraph.from_spec(resolve_source(ModelSource(ref="mlp"), 8, meta=True))
    plan = multi_vw_plan(graph, [[2], [2]], "mlp", 8, 2, cluster=cluster)  # 2 VWs, 1 shard
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    plan.save(run_dir / "plan.json")
    same = tmp_path / "cluster.yaml"
    same.write_text(yaml.safe_dump(cluster.to_dict()))
    return run_dir, same, plan.save(tmp_path / "plan.yaml")


def _resume(path: Path, run_dir: Path, *extra: str) -> tuple[int, str]:
    """Exit code and output of ``hetpipe run PATH --resume RUN_DIR``."""
    res = CliRunner().invoke(app, ["run", str(path), "--resume", str(run_dir), *extra])
    return res.exit_code, res.output.strip()


def test_resume_refuses_another_cluster_file(
    resumable: tuple[Path, Path, Path], tmp_path: Path
) -> None:
    import yaml

    run_dir, same, _ = resumable
    code, out = _resume(same, run_dir)  # its own cluster file: resumes
    assert code == 2 and out.endswith("\nerror: reached training"), out
    doc = yaml.safe_load(same.read_text())
    doc["nodes"][1]["emulate"]["speed"] = 0.5
    other = tmp_path / "other.yaml"
    other.write_text(yaml.safe_dump(doc))
    code, out = _resume(other, run_dir)
    assert code == 2 and len(out.splitlines()) == 1 and out.startswith("error: --resume"), out
    assert f"{other} is not the cluster of the run being resumed" in out
    assert "nodes[1].emulate.speed is 0.5 but the run's" in out and "is 0.2" in out


def test_resume_refuses_another_plan_or_model(
    resumable: tuple[Path, Path, Path], tmp_path: Path
) -> None:
    from dataclasses import replace

    from planner.plan_file import load_plan

    run_dir, same, plan_file = resumable
    code, out = _resume(plan_file, run_dir)  # its own plan file: resumes
    assert code == 2 and out.endswith("\nerror: reached training"), out
    other = replace(load_plan(plan_file), batch_size=16).save(tmp_path / "other.yaml")
    code, out = _resume(other, run_dir)
    assert code == 2 and len(out.splitlines()) == 1, out
    assert f"{other} is not the plan of the run being resumed" in out, out
    assert "batch_size is 16 but the run's" in out
    code, out = _resume(same, run_dir, "--model", "resnet")
    assert code == 2 and "--model resnet does not match the plan's model 'mlp'" in out, out


# ---------------------------------------------------------------- pacing on this machine's cores


def _fast_plan(tmp_path: Path, speed: float) -> Path:
    """The two-device plan of :func:`_plan_doc` with both devices at ``speed``."""
    import json

    doc = _plan_doc()
    for node in doc["cluster"]["nodes"]:
        node["emulate"]["speed"] = speed
    for gpu in doc["virtual_workers"][0]["gpus"]:
        gpu["speed"] = speed
    path = tmp_path / f"plan-{speed}.json"
    path.write_text(json.dumps(doc))
    return path


@pytest.mark.parametrize(
    ("cores", "speed", "refused"),
    [
        (1, 0.6, "need 1.2 cores (the sum of their speeds) but this machine has 1"),
        (4, 1.5, "device cpu:0 has speed 1.5: faster than one core"),
        (2, 0.6, None),
    ],
)
def test_run_refuses_devices_it_cannot_pace(
    cores: int, speed: float, refused: str | None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import os

    from profiler.errors import ConfigError

    def reached(*_: Any, **__: Any) -> None:
        raise ConfigError("reached training")

    monkeypatch.setattr("runtime.run.run_plan", reached)
    monkeypatch.setattr(os, "cpu_count", lambda: cores)
    path = _fast_plan(tmp_path, speed)
    res = CliRunner().invoke(app, ["run", str(path), "--steps", "1"])
    last = res.output.strip().splitlines()[-1]
    assert res.exit_code == 2, res.output
    if refused is None:
        assert last == "error: reached training", res.output
        return
    assert refused in last and "pass --no-emulate" in last and len(res.output.splitlines()) == 1
    res = CliRunner().invoke(app, ["run", str(path), "--steps", "1", "--no-emulate"])
    assert res.output.strip().splitlines()[-1] == "error: reached training", res.output


def test_plan_warns_of_devices_this_machine_cannot_pace(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A plan may be made here and run elsewhere: plan warns, run refuses."""
    import os

    import yaml

    from profiler.errors import ConfigError

    def stop(*_: Any, **__: Any) -> None:
        raise ConfigError("planning")

    monkeypatch.setattr("planner.planner.make_plan", stop)
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    res = CliRunner().invoke(app, ["plan", CLUSTER])  # its speeds sum to 0.525
    assert res.output.strip() == "error: planning", res.output
    doc = yaml.safe_load(Path(CLUSTER).read_text())
    for node in doc["nodes"]:
        node["emulate"]["speed"] = 0.6
    fast = tmp_path / "fast.yaml"
    fast.write_text(yaml.safe_dump(doc))
    res = CliRunner().invoke(app, ["plan", str(fast)])
    lines = res.output.strip().splitlines()
    assert lines[0].startswith("note: the emulated devices that run at once need 2.4 cores")
    assert lines[-1] == "error: planning", res.output


# ---------------------------------------------------------------- --nm within what memory allows


def test_run_refuses_an_nm_above_what_memory_allows(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from profiler.errors import ConfigError

    def reached(*_: Any, **__: Any) -> None:
        raise ConfigError("reached training")

    monkeypatch.setattr("runtime.run.run_plan", reached)
    path = _fast_plan(tmp_path, 0.1)  # its VW's nm_max is 2
    res = CliRunner().invoke(app, ["run", str(path), "--nm", "3"])
    assert res.exit_code == 2 and len(res.output.strip().splitlines()) == 1, res.output
    assert "--nm 3: the planner's memory model fits at most 2 minibatches in flight on VW 0" in (
        res.output
    )
    res = CliRunner().invoke(app, ["run", str(path), "--nm", "2"])
    assert res.output.strip().splitlines()[-1] == "error: reached training", res.output


def test_plan_refuses_an_nm_above_what_memory_allows(monkeypatch: pytest.MonkeyPatch) -> None:
    """The planner caps Nm at its VWs' ``nm_max``; an explicit larger --nm is said, not capped."""
    from planner.plan import Plan

    planned = Plan.from_dict(_plan_doc(), "planned")  # nm_max 2
    monkeypatch.setattr("planner.planner.make_plan", lambda *_, **__: planned)
    res = CliRunner().invoke(app, ["plan", CLUSTER, "--nm", "3"])
    assert res.exit_code == 2, res.output
    assert res.output.strip().startswith("error: --nm 3: the planner's memory model fits at most 2")
    res = CliRunner().invoke(app, ["plan", CLUSTER, "--nm", "2"])
    assert res.exit_code == 0, res.output


@pytest.mark.usefixtures("nothing_read")
@pytest.mark.parametrize(
    ("args", "fragment"),
    [
        (["--vw", "0", "--checkpoint-every", "3"], "--checkpoint-every: one VW trained alone"),
        (["--vw", "1", "--on-failure", "restart"], "--on-failure restart: one VW trained alone"),
        (["--sync", "backup", "--time-limit", "5"], "--time-limit with --sync backup"),
        (["--vws", "2", "--vw", "2"], "--vw 2: --vws 2 makes VWs 0..1"),
    ],
)
def test_run_refuses_what_the_options_decide_before_planning(
    args: list[str], fragment: str
) -> None:
    """Refusals that need no plan do not wait for a cluster file to be planned."""
    res = CliRunner().invoke(app, ["run", CLUSTER, *args])
    assert res.exit_code == 2, res.output
    assert len(res.output.strip().splitlines()) == 1 and fragment in res.output, res.output


@given(
    value=st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.integers()),
    low=st.integers(-3, 3),
    open_low=st.booleans(),
    high=st.sampled_from([math.inf, 1.0, 10.0]),
    open_high=st.booleans(),
)
def test_check_number_refuses_exactly_the_values_outside_the_range(
    value: float, low: int, open_low: bool, high: float, open_high: bool
) -> None:
    """Any value: refused (one line naming the flag and the value) iff not finite or outside."""
    from profiler.errors import ConfigError
    from runtime.options import Range, check_number

    allowed = Range(low, high, open_low, open_high)
    inside = (
        math.isfinite(value)
        and (value > low if open_low else value >= low)
        and (value < high if open_high else value <= high)
    )
    try:
        check_number("--x", value, allowed, 1)
    except ConfigError as exc:
        assert not inside
        assert str(exc).startswith(f"--x {value}: must be a ") and "\n" not in str(exc)
    else:
        assert inside


def test_simulate_refuses_a_plan_without_stage_times(tmp_path: Path) -> None:
    """A hand-made plan without stage times (run measures them) is one line, not a traceback."""
    import json

    doc = _plan_doc()
    for stage in doc["virtual_workers"][0]["stages"]:
        stage.update(fwd_ms=0.0, bwd_ms=0.0, time_ms=0.0)
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(doc))
    res = CliRunner().invoke(app, ["simulate", str(path)])
    assert res.exit_code == 2, res.output
    assert res.output.strip() == (
        f"error: {path}: virtual_workers[0].stages: every stage takes 0 ms (a plan made without "
        "stage times); simulate a plan made by 'hetpipe plan'"
    )
