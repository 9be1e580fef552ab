"""A resumed run ends bit-identical to the run that never stopped, with Nm > 1 minibatches in
flight: the snapshot holds each stage's master weights before the pull's fold, its weight
versions in flight, its optimizer, RNG and buffers (:mod:`runtime.persist.stage_part`)."""

from __future__ import annotations

import csv
import json
from pathlib import Path
from typing import Any

import pytest
import torch

from planner.manual import multi_vw_plan
from profiler.errors import ConfigError, HetPipeRuntimeError
from profiler.graph import ModelGraph
from runtime.config import ModelSource, OptimizerConfig, RunConfig
from runtime.faults import StageFault
from runtime.launch.launcher import launch
from runtime.persist.snapshot import committed_clocks, load_part, read_manifest, snapshot_dir
from runtime.results.run_result import RunResult
from runtime.stage.model import resolve_source
from tests.runtime._spec import spec

pytestmark = pytest.mark.timeout(120)

SOURCE = ModelSource(ref="mlp")
BATCH = 16
NM = 3


def _plan(vw_cuts: list[tuple[int, ...]], n_shards: int):  # type: ignore[no-untyped-def]
    graph = ModelGraph.from_spec(resolve_source(SOURCE, BATCH, meta=True))
    return multi_vw_plan(graph, vw_cuts, "mlp", BATCH, nm=NM, D=0, n_shards=n_shards)


@pytest.mark.parametrize(
    ("vw_cuts", "n_shards"), [([(3,)], 1), ([(2,), (5,)], 2)], ids=["1vw-2stages", "2vws-2shards"]
)
def test_resume_after_a_kill_is_bit_identical_at_nm_3(
    tmp_path: Path, vw_cuts: list[tuple[int, ...]], n_shards: int
) -> None:
    plan = _plan(vw_cuts, n_shards)
    # momentum and a step schedule: optimizer state and the lr position must go on exactly
    opt = OptimizerConfig(lr=0.05, momentum=0.5, lr_schedule="step", step_size=4, gamma=0.5)

    def run(out: Path) -> RunConfig:
        return RunConfig(steps=5 * NM, timeout_s=15.0, emulate=False, out_dir=out)

    whole = launch(plan, SOURCE, spec(opt, run(tmp_path / "whole")))
    assert isinstance(whole, RunResult)
    out = tmp_path / "cut"
    # stage 1 dies before minibatch 10: minibatch 9 waited for clock 2 (the last stage folds
    # a pull at the forward that needs it), so the snapshot at clock 2 (minibatch 6) is the
    # last one
    with pytest.raises(HetPipeRuntimeError):
        launch(plan, SOURCE, spec(opt, run(out), checkpoint_every=2, stage_fault=StageFault(1, 10)))
    assert committed_clocks(out / "checkpoints") == [2]
    part = load_part(read_manifest(snapshot_dir(out / "checkpoints", 2)), "vw0-stage0")
    assert sorted(part["versions"]) == [-2, -1]  # the Nm - 1 versions in flight
    resumed = launch(plan, SOURCE, spec(opt, run(out), checkpoint_every=2, resume=True))
    assert isinstance(resumed, RunResult)
    assert [vw.steps for vw in resumed.vws] == [3 * NM] * len(vw_cuts)
    ref = whole.state_dict()
    got = resumed.state_dict()
    assert sorted(got) == sorted(ref)
    for name, t in got.items():
        assert torch.equal(t, ref[name]), name
    for k, vw in enumerate(resumed.vws):  # the same losses for the same minibatches
        tail = dict(whole.vws[k].stages[-1].losses)
        assert vw.stages[-1].losses and all(
            loss == tail[mb + 2 * NM] for mb, loss in vw.stages[-1].losses
        )
    assert resumed.test_accuracy == whole.test_accuracy
    # metrics.csv: the killed attempt's rows stay, the resume's are appended, numbered on
    for k in range(len(vw_cuts)):
        with (out / f"vw{k}" / "metrics.csv").open(newline="", encoding="utf-8") as f:
            rows = [(int(r["attempt"]), int(r["minibatch"]), r["loss"]) for r in csv.DictReader(f)]
        killed = [mb for a, mb, _ in rows if a == 0]
        assert killed == list(range(1, len(killed) + 1)) and 0 < len(killed) < 10
        assert [(a, mb) for a, mb, _ in rows if a != 0] == [(1, mb) for mb in range(7, 16)]
        whole_loss = {mb: f"{loss:.6f}" for mb, loss in whole.vws[k].stages[-1].losses}
        assert all(loss == whole_loss[mb] for _, mb, loss in rows)
    summary = json.loads((out / "summary.json").read_text())
    assert [v["metrics_minibatches"] for v in summary["vws"]] == [5 * NM] * len(vw_cuts)


@pytest.mark.parametrize(
    ("cfg", "flag"),
    [
        (dict(resume=True), "--resume"),
        (dict(on_failure="restart", max_restarts=1), "--on-failure restart"),
        (dict(on_failure="continue"), "--on-failure continue"),
    ],
)
def test_one_vw_alone_refuses_what_needs_snapshots(
    tmp_path: Path, cfg: dict[str, Any], flag: str
) -> None:
    """--vw K trains one VW alone, whose weights never reach the shards: no snapshots, so
    nothing to resume or restart from; refused in one line instead of ignored."""
    plan = _plan([(3,), (5,)], 2)
    run = RunConfig(steps=3, timeout_s=15.0, emulate=False, out_dir=tmp_path / "out")
    with pytest.raises(ConfigError, match=f"^{flag}: one VW trained alone"):
        launch(plan, SOURCE, spec(None, run, **cfg, vw=1))
    assert not (tmp_path / "out").exists()


def test_cli_refuses_an_explicit_checkpoint_every_with_vw(tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from hetpipe.cli import app

    path = _plan([(3,), (5,)], 2).save(tmp_path / "plan.yaml")
    args = ["run", str(path), "--vw", "0", "--steps", "3", "--no-progress", "--no-emulate"]
    res = CliRunner().invoke(app, [*args, "--checkpoint-every", "2"], env={"COLUMNS": "300"})
    assert res.exit_code == 2
    assert "--checkpoint-every: one VW trained alone" in res.output


def test_resume_with_dropout_and_batch_norm_is_bit_identical(tmp_path: Path) -> None:
    """The RNG state and the buffers go on from before the next wave's first forward (taken
    at that forward when the pipeline had already started it), not from the snapshot's moment."""
    from torch import nn
    from torch.utils.data import TensorDataset

    from hetpipe.api import _module_source

    torch.manual_seed(0)
    data = TensorDataset(torch.randn(400, 8), torch.randint(0, 3, (400,)))
    model = nn.Sequential(
        nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Dropout(0.3),
        nn.Linear(16, 16), nn.ReLU(), nn.Dropout(0.3), nn.Linear(16, 3),
    )  # fmt: skip
    source = _module_source(model, data, nn.functional.cross_entropy, BATCH)
    graph = ModelGraph.from_spec(resolve_source(source, BATCH, meta=False))
    plan = multi_vw_plan(graph, [(len(graph.layers) // 2,)], "drop", BATCH, nm=NM, n_shards=1)

    def run(out: Path) -> RunConfig:
        return RunConfig(steps=5 * NM, timeout_s=15.0, emulate=False, out_dir=out)

    before = {n: t.clone() for n, t in model.state_dict().items()}
    whole = launch(plan, source, spec(None, run(tmp_path / "whole")), data)
    # the user's module is left as it was (evaluation used to load the final weights into it,
    # so the next run started from them)
    assert all(torch.equal(t, before[n]) for n, t in model.state_dict().items())
    out = tmp_path / "cut"
    with pytest.raises(HetPipeRuntimeError):
        launch(
            plan,
            source,
            spec(None, run(out), checkpoint_every=2, stage_fault=StageFault(1, 8)),
            data,
        )
    resumed = launch(plan, source, spec(None, run(out), checkpoint_every=2, resume=True), data)
    assert isinstance(whole, RunResult) and isinstance(resumed, RunResult)
    ref = whole.state_dict()
    assert list(ref) == list(model.state_dict())  # the batch-norm statistics included
    assert list(resumed.state_dict()) == list(ref)
    for name, t in resumed.state_dict().items():
        assert torch.equal(t, ref[name]), name
    tail = dict(whole.vws[0].stages[-1].losses)
    assert all(loss == tail[mb + 2 * NM] for mb, loss in resumed.vws[0].stages[-1].losses)
    # nothing left to train: the outputs from the last snapshot, buffers included
    again = launch(plan, source, spec(None, run(out), checkpoint_every=2, resume=True), data)
    assert again.exported_from and list(again.state_dict()) == list(ref)
    for name, t in again.state_dict().items():
        assert torch.equal(t, ref[name]), name
    assert again.test_loss == resumed.test_loss == whole.test_loss
