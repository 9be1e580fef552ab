"""A diverging run (NaN or infinite loss or gradients) under every rule: ``--on-nonfinite stop``
ends it within the wave, naming the VW, stage, minibatch and the last snapshot, and is never
restarted; ``skip`` skips that update at every stage, equal to a reference that skips it.

The NaN comes from the test hook :class:`runtime.faults.StageFault` (``nonfinite``), or
from a learning rate so large that the loss overflows.
"""

from __future__ import annotations

import csv
import dataclasses
import json
import re
from pathlib import Path
from typing import Any

import pytest
import torch
from typer.testing import CliRunner

from hetpipe.api import train
from hetpipe.cli import app
from planner.manual import multi_vw_plan
from planner.nonfinite import Verdict
from profiler.errors import ConfigError
from runtime.config import OptimizerConfig, RunConfig
from runtime.faults import StageFault
from runtime.launch.launcher import launch
from runtime.persist.snapshot import committed_clocks
from runtime.results.run_result import RunResult
from runtime.stage.nonfinite import Diverged, StageJudge, all_finite
from tests.runtime._spec import spec
from tests.runtime.test_wsp_run import BATCH, LR, SOURCE, _graph, wsp_reference

pytestmark = pytest.mark.timeout(180)

RULES: dict[str, dict[str, float]] = {
    "wsp": {},
    "backup": {"backups": 1.0},
    "easgd": {"alpha": 0.25, "tau": 1.0},
    "allreduce": {},
}


def _plan(rule: str = "wsp", nm: int = 2) -> Any:
    ar = rule == "allreduce"  # the same stages in every VW, no shards, Nm = 1
    cuts = [(4,), (4,)] if ar else [(4,), (6,)]
    plan = multi_vw_plan(_graph(), cuts, "mlp", BATCH, nm=1 if ar else nm, D=0, n_shards=2)
    params = tuple(sorted(RULES[rule].items()))
    return dataclasses.replace(
        plan, sync=rule, sync_params=params, shards=() if ar else plan.shards
    )


def _launch(plan: Any, steps: int, policy: str, cfg: dict[str, Any], out: Path | None) -> RunResult:
    run = RunConfig(steps=steps, timeout_s=15.0, emulate=False, out_dir=out,
                    on_nonfinite=policy, return_state=True)  # fmt: skip
    return launch(plan, SOURCE, spec(OptimizerConfig(lr=LR), run, **cfg))


@pytest.mark.parametrize("rule", list(RULES))
def test_stop_names_vw_stage_minibatch_and_the_last_snapshot(rule: str, tmp_path: Path) -> None:
    # VW 1's loss at minibatch 5; with backup VWs a late VW may jump past minibatch 5 (its
    # wave dropped) and never compute it, so there every VW's minibatch 5 is non-finite
    vw = -1 if rule == "backup" else 1
    nan = StageFault(stage=1, at_mb=5, vw=vw, nonfinite=True)
    cfg = dict(checkpoint_every=1, stage_fault=nan)
    with pytest.raises(Diverged) as info:
        _launch(_plan(rule), 8, "stop", cfg, tmp_path / "run")
    message = str(info.value)
    who = "vw [01]" if vw < 0 else "vw 1"
    assert re.search(f"non-finite loss \\(nan\\) at {who}, stage 1, minibatch 5", message), message
    clocks = committed_clocks(tmp_path / "run" / "checkpoints")
    assert clocks, message  # a snapshot before the divergence is kept ...
    assert f"--resume {tmp_path / 'run' / 'checkpoints'}@{max(clocks)} --lr" in message
    # ... and none after it: the run stopped within the wave of minibatch 5
    last_good = 4 if rule == "allreduce" else 2  # AllReduce: one step per clock
    assert max(clocks) <= last_good, message


@pytest.mark.parametrize(
    ("rule", "on_failure"), [("wsp", "restart"), ("wsp", "continue"), ("allreduce", "restart")]
)
def test_a_diverged_vw_is_neither_restarted_nor_evicted(
    rule: str, on_failure: str, tmp_path: Path
) -> None:
    # a restart drops the test hook: a restarted run would finish without diverging
    nan = StageFault(stage=1, at_mb=3, vw=0, nonfinite=True)
    cfg = dict(checkpoint_every=1, stage_fault=nan, on_failure=on_failure, max_restarts=2)
    with pytest.raises(Diverged, match=r"at vw 0, stage 1, minibatch 3 \("):
        _launch(_plan(rule), 6, "stop", cfg, tmp_path / "run")


def test_skip_skips_the_update_at_every_stage_as_the_reference(tmp_path: Path) -> None:
    nan = StageFault(stage=1, at_mb=3, vw=0, nonfinite=True)
    result = _launch(_plan(), 8, "skip", dict(stage_fault=nan), tmp_path / "run")
    assert [v.skipped for v in result.vws] == [[3], []] and result.skipped_updates == 1
    assert all(s.skipped == [3] for s in result.vws[0].stages)  # every stage of VW 0
    ref, losses = wsp_reference(2, 2, 4, skipped=frozenset({(0, 3)}))
    state = result.state_dict()
    for n, t in ref.items():
        torch.testing.assert_close(state[n], t, rtol=1e-5, atol=1e-6)
    assert torch.isnan(torch.tensor(result.vws[0].losses[2]))
    kept = [x for i, x in enumerate(result.vws[0].losses) if i != 2]
    torch.testing.assert_close(kept, [x for i, x in enumerate(losses[0]) if i != 2])
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["skipped_updates"] == 1 and summary["vws"][0]["skipped"] == [3]
    with (tmp_path / "run" / "vw0" / "metrics.csv").open(newline="") as f:
        rows = sorted(csv.DictReader(f), key=lambda r: int(r["minibatch"]))
    assert len(rows) == 8 and [r["minibatch"] for r in rows if r["skipped"] == "1"] == ["3"]
    assert "1 update skipped" in str(result.table().caption)


@pytest.mark.parametrize("rule", ["backup", "easgd"])
def test_skip_under_the_other_shard_rules_goes_on(rule: str) -> None:
    nan = StageFault(stage=1, at_mb=3, vw=0, nonfinite=True)
    result = _launch(_plan(rule), 8, "skip", dict(stage_fault=nan), None)
    assert [v.skipped for v in result.vws] == [[3], []] and result.skipped_updates == 1
    assert all(torch.isfinite(t).all() for t in result.state_dict().values())


def test_skip_under_allreduce_skips_the_step_on_every_copy(tmp_path: Path) -> None:
    nan = StageFault(stage=1, at_mb=3, vw=1, nonfinite=True)  # only VW 1's loss is NaN
    result = _launch(_plan("allreduce"), 6, "skip", dict(stage_fault=nan), None)
    assert [v.skipped for v in result.vws] == [[3], [3]]  # VW 0 met VW 1's marked gradients
    one, two = result.vws[0].state_dict(), result.vws[1].state_dict()
    for n, t in one.items():  # the copies stayed equal: every stage of both skipped step 3
        assert torch.isfinite(t).all()
        torch.testing.assert_close(two[n], t, rtol=0, atol=0)


def test_skip_cannot_skip_what_later_stages_applied(tmp_path: Path) -> None:
    nan = StageFault(stage=0, at_mb=3, vw=0, nonfinite=True)  # stage 0's gradients only
    with pytest.raises(Diverged, match=r"cannot be skipped"):
        _launch(_plan(), 8, "skip", dict(stage_fault=nan), None)


def test_cli_huge_lr_one_red_line_exit_2_and_skip_counts(tmp_path: Path) -> None:
    plan = _plan().save(tmp_path / "plan.yaml")
    base = ["run", str(plan), "--steps", "12", "--no-progress", "--no-emulate", "--lr", "1e6"]
    res = CliRunner().invoke(app, [*base, "--out", str(tmp_path / "a"), "--checkpoint-every",
                                   "1"], env={"COLUMNS": "400"})  # fmt: skip
    assert res.exit_code == 2, res.output
    error = res.output.strip().splitlines()[-1]  # after the line saying what it trains
    assert error.startswith("error: non-finite") and "Traceback" not in res.output, res.output
    assert re.search(r"at vw \d, stage \d, minibatch \d+ \(wave \d+\): the run diverged", error)
    clock = max(committed_clocks(tmp_path / "a" / "checkpoints"))
    assert f"--resume {tmp_path / 'a' / 'checkpoints'}@{clock} --lr" in error
    res = CliRunner().invoke(app, [*base, "--out", str(tmp_path / "b"), "--on-nonfinite", "skip"],
                             env={"COLUMNS": "400"})  # fmt: skip
    assert res.exit_code == 0, res.output
    summary = json.loads((tmp_path / "b" / "summary.json").read_text())
    assert summary["skipped_updates"] > 0
    said = " ".join(res.output.split())  # the summary's caption wraps
    assert f"{summary['skipped_updates']} updates skipped" in said, res.output


@pytest.mark.parametrize("policy", ["stop", "skip"])
def test_one_vw_alone_through_the_api(policy: str) -> None:
    huge = OptimizerConfig(lr=1e6)
    if policy == "stop":  # one VW alone writes no snapshots: the message says so
        with pytest.raises(Diverged, match=r"at vw 0, stage \d, .*no snapshot was committed"):
            train("mlp", steps=12, optimizer=huge, emulate=False, stages=2)
        return
    result = train("mlp", steps=12, optimizer=huge, emulate=False, stages=2, on_nonfinite=policy)
    assert result.skipped_updates == len(result.vws[0].skipped) > 0
    assert "skipped (non-finite loss or gradients)" in str(result.table().caption)


def test_an_unknown_policy_is_refused_in_our_words() -> None:
    with pytest.raises(ConfigError, match=r"--on-nonfinite 'halt': use stop or skip"):
        RunConfig(on_nonfinite="halt")


def test_the_check_finds_nan_and_inf_in_any_dtype_and_changes_no_bit() -> None:
    ts = [torch.randn(5, 3), torch.randn(4, dtype=torch.bfloat16), None, torch.arange(3)]
    ts.append(torch.tensor([-0.0, 1e-45, 3.4e38]))  # signed zero, subnormal, near the top
    before = [t.clone() if t is not None else None for t in ts]
    assert all_finite(ts) and all_finite([])
    for a, b in zip(ts, before, strict=True):
        assert a is None or (
            b is not None and torch.equal(a.view(torch.uint8), b.view(torch.uint8))
        )
    for bad in (float("nan"), float("inf"), -float("inf")):
        for i in (0, 1):
            worse = [t.clone() if t is not None else None for t in ts]
            worse[i].view(-1)[2] = bad  # type: ignore[union-attr]
            assert not all_finite(worse)


def test_the_judge_marks_a_skip_and_names_what_stopped() -> None:
    nan, ok = torch.tensor([float("nan")]), torch.ones(2)
    last = StageJudge("skip", 1, 2, True, 10, 4)
    grads_w, grads_x = [torch.ones(3)], [torch.ones(2)]
    assert last.local(3, float("inf"), [], grads_w, grads_x) is Verdict.SKIP
    assert torch.isnan(grads_w[0]).all() and torch.isnan(grads_x[0]).all()  # marked
    middle = StageJudge("stop", 1, 0, False, 10, 4)
    with pytest.raises(Diverged, match=r"gradient from the next stage at vw 1, stage 0, "
                       r"minibatch 13 \(wave 3\)"):  # fmt: skip
        middle.local(3, 0.0, [nan], [ok], [ok])


def test_the_judge_checks_a_finite_minibatch_in_one_pass(monkeypatch: pytest.MonkeyPatch) -> None:
    """Per task the check is one fused kernel over everything the stage computed and received,
    not one per group (each costs a kernel launch and a host sync: ~75 us on a loaded CPU)."""
    import runtime.stage.nonfinite as nonfinite

    calls: list[int] = []
    check = nonfinite.all_finite
    monkeypatch.setattr(nonfinite, "all_finite", lambda ts: calls.append(1) or check(ts))
    middle = StageJudge("stop", 0, 1, False, 0, 2)
    grads = [torch.ones(3)], [torch.ones(2)], [torch.ones(2)]
    assert middle.local(1, 0.0, *grads) is Verdict.APPLY
    assert len(calls) == 1
