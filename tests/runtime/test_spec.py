"""The one run object: the failure enum keeps the old behaviours, every entry builds the same
spec from the same option values, and no user entry reaches the test hooks."""

from __future__ import annotations

import dataclasses
import warnings
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from planner.manual import cpu_cluster, multi_vw_plan
from profiler.errors import ConfigError
from profiler.graph import ModelGraph
from runtime.config import ModelSource
from runtime.options import OPTIONS, run_spec
from runtime.spec import FailurePolicy, OnFailure, RunSpec, TestHooks
from runtime.stage.model import resolve_source

# what the three loose settings of the options table's --on-failure were before RunSpec
# (max_restarts, evict, restart_vw), for --max-restarts 2
_BEFORE = {"stop": (0, False, False), "restart": (2, False, True), "continue": (0, True, False)}


@pytest.mark.parametrize("choice", list(_BEFORE))
def test_the_failure_enum_maps_to_exactly_the_old_settings(choice: str) -> None:
    policy = FailurePolicy(OnFailure(choice), max_restarts=2)
    assert (policy.budget, policy.evict, policy.restart_vw) == _BEFORE[choice]
    values = {n: o.default for n, o in OPTIONS.items()} | {"on_failure": choice, "max_restarts": 2}
    assert run_spec(values).failure == policy  # the options table's value, parsed
    assert FailurePolicy(choice, 2) == policy  # type: ignore[arg-type]


def test_the_budget_is_spent_and_a_bad_choice_names_the_flag() -> None:
    policy = FailurePolicy(OnFailure.RESTART, max_restarts=3)
    assert policy.spent(2).budget == 1 and policy.spent(5).budget == 0
    with pytest.raises(ConfigError, match=r"^--on-failure 'retry': use one of stop, restart"):
        FailurePolicy("retry")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=r"^--max-restarts -1"):
        FailurePolicy(OnFailure.RESTART, -1)


_VALUES: dict[str, Any] = {
    "steps": 6, "epochs": 0.5, "time_limit": 9.0, "seed": 3, "staleness": 1,
    "checkpoint_every": 2, "on_failure": "restart", "max_restarts": 2, "overwrite": True,
    "optimizer": "sgd", "lr": 0.1, "momentum": 0.5, "weight_decay": 0.01, "remedy": "pipemare",
    "remedy_warmup": 5, "timeout": 30.0, "emulate": False, "on_nonfinite": "skip",
    "precision": "fp32",
}  # fmt: skip
"""Every run option not at its default, as a user would give it."""


def _flags(values: dict[str, Any]) -> list[str]:
    """``values`` as command-line flags (from the options table: names and flags)."""
    flags: list[str] = []
    for name, value in values.items():
        flag = OPTIONS[name].flag
        if isinstance(value, bool):
            flags.append(flag if value else f"--no-{flag[2:]}")
        else:
            flags += [flag, str(value)]
    return flags


def _plan_file(tmp_path: Path) -> Path:
    """A two-VW plan with one shard (WSP: every option applies)."""
    graph = ModelGraph.from_spec(resolve_source(ModelSource(ref="mlp"), 8, meta=True))
    path = tmp_path / "plan.json"
    multi_vw_plan(graph, [[2], [2]], "mlp", 8, 2, cluster=cpu_cluster(4)).save(path)
    return path


def _same_but_the_hint(spec: RunSpec) -> RunSpec:
    """``spec`` without its resume hint (each entry names its own command line)."""
    return dataclasses.replace(
        spec, checkpoints=dataclasses.replace(spec.checkpoints, resume_hint="")
    )


def test_every_entry_builds_the_same_spec_from_the_same_values(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import hetpipe
    from hetpipe.cli import app
    from runtime.__main__ import _args, torchrun_spec

    path, out = _plan_file(tmp_path), tmp_path / "run"
    seen: list[RunSpec] = []

    def reached(plan: Any, source: Any, spec: RunSpec, dataset: Any = None) -> None:
        seen.append(spec)
        raise ConfigError("reached training")

    # hetpipe.api first: importing it binds runtime.run.run_plan, which must be the real one
    monkeypatch.setattr("hetpipe.api.run_plan", reached)
    monkeypatch.setattr("runtime.run.run_plan", reached)
    argv = ["run", str(path), *_flags(_VALUES), "--out", str(out), "--no-progress"]
    res = CliRunner().invoke(app, argv)
    assert res.exit_code == 2 and "reached training" in res.output
    with pytest.raises(ConfigError, match="reached training"):
        hetpipe.train("mlp", plan=path, out=out, return_state=False, **_VALUES)
    cli, api = seen
    torchrun = torchrun_spec(_args([str(path), *_flags(_VALUES), "--out", str(out)]), None)
    assert _same_but_the_hint(cli) == _same_but_the_hint(api) == _same_but_the_hint(torchrun)
    assert cli.failure == FailurePolicy(OnFailure.RESTART, 2) and cli.sync.D == 1
    assert cli.checkpoints.dir == out / "checkpoints" and cli.checkpoints.every == 2


def test_train_takes_every_option_of_the_table_with_its_default() -> None:
    import inspect

    from hetpipe.api import train

    params = inspect.signature(train).parameters
    for name, option in OPTIONS.items():
        if name != "data":  # hetpipe.train takes the data set itself
            assert name in params, f"hetpipe.train has no {name}= ({option.flag})"
            assert params[name].default == option.default, name


def test_user_entries_cannot_set_the_test_hooks(tmp_path: Path) -> None:
    import hetpipe
    from runtime.__main__ import _args

    hooks = [f.name for f in dataclasses.fields(TestHooks)]
    assert not set(hooks) & set(OPTIONS)  # no option of hetpipe run or torchrun is a hook
    flags = {o.flag.lstrip("-").replace("-", "_") for o in OPTIONS.values()}
    assert not set(hooks) & flags
    for hook in hooks:
        with pytest.raises(ConfigError, match=rf"^hetpipe.train: no option '{hook}'"):
            hetpipe.train("mlp", plan=_plan_file(tmp_path), **{hook: True})
        with pytest.raises(SystemExit):
            _args(["plan.json", f"--{hook.replace('_', '-')}", "1"])
    assert run_spec({n: o.default for n, o in OPTIONS.items()}).faults == TestHooks()


def test_train_takes_the_old_names_for_one_release_with_a_warning(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import hetpipe

    seen: list[RunSpec] = []
    monkeypatch.setattr("hetpipe.api.run_plan", lambda plan, src, spec, data: seen.append(spec))
    old: dict[str, Any] = {"time_limit_s": 4.0, "out_dir": tmp_path / "o", "timeout_s": 9.0, "D": 2}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        hetpipe.train("mlp", plan=_plan_file(tmp_path), **old)
    said = sorted(str(w.message).split(")")[0] for w in caught if w.category is DeprecationWarning)
    assert said == [f"hetpipe.train({k}=..." for k in sorted(old)]
    (spec,) = seen
    assert (spec.run.time_limit_s, spec.run.out_dir, spec.run.timeout_s) == (
        4.0,
        old["out_dir"],
        9.0,
    )
    assert spec.sync.D == 2
