"""`hetpipe run --data`: the user's training and test sets from the command line, synthetic data
only when asked for and shaped by the model, bad data as one line, and --steps as trained."""

from __future__ import annotations

import importlib
import json
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from hetpipe.cli import app
from planner.manual import cpu_cluster, multi_vw_plan
from planner.plan import Plan
from profiler.graph import ModelGraph
from runtime.config import ModelSource, RunConfig
from runtime.data_source import RunData, output_classes, synthetic_data
from runtime.launch.jobs import Attempt, Prepared
from runtime.launch.launcher import prepare
from runtime.results.evaluation import evaluate_module
from runtime.run import steps_note
from runtime.spec import RunSpec
from runtime.stage.model import resolve_source

BATCH = 16

FACTORY = """
import torch
from torch import nn
from torch.utils.data import TensorDataset


def model(batch_size=16):
    net = nn.Sequential(nn.Linear(4, 32), nn.ReLU(), nn.Linear(32, 5))  # 5 classes
    return net, (torch.randn(batch_size, 4), torch.randint(0, 5, (batch_size,)))


def blobs(n, seed):
    g = torch.Generator().manual_seed(seed)
    y = torch.randint(0, 5, (n,), generator=g)
    x = torch.eye(5, 4)[y] * 4.0 + 0.3 * torch.randn(n, 4, generator=g)
    return TensorDataset(x, y)


def data():
    return blobs(320, 1), blobs(64, 2)


def ten():  # a label the 5-class model cannot output
    train = blobs(320, 1)
    train.tensors[1][3] = 9
    return train, blobs(64, 2)


def three():
    return blobs(320, 1), blobs(64, 2), None


def listed():
    return [], None


def number():
    return 5, None


def pairless():
    return [torch.zeros(4)] * 40, None
"""


@pytest.fixture
def fivedata(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The factory module in the current directory (found like ``python -m`` finds it), and a
    plan of two one-stage VWs through one shard for its model, Nm 2."""
    (tmp_path / "fivedata.py").write_text(FACTORY)
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    importlib.invalidate_caches()
    return _plan().save(tmp_path / "plan.yaml")


def _plan() -> Plan:
    source = ModelSource(ref="fivedata:model")
    graph = ModelGraph.from_spec(resolve_source(source, BATCH, meta=True))
    return multi_vw_plan(graph, [[], []], "fivedata:model", BATCH, 2, cluster=cpu_cluster(2))


def test_run_trains_and_reports_on_the_factory_data(fivedata: Path) -> None:
    out = fivedata.parent / "run"
    args = ["run", str(fivedata), "--data", "fivedata:data", "--steps", "3", "--out", str(out),
            "--no-progress", "--no-emulate"]  # fmt: skip
    res = CliRunner().invoke(app, args)
    assert res.exit_code == 0, res.output
    # the rounding to whole waves is said before training, and is what trains
    assert "--steps 3 -> 4: whole waves of Nm 2" in res.output
    assert res.output.index("--steps 3 -> 4") < res.output.index("samples/s")
    summary = json.loads((out / "summary.json").read_text())
    assert summary["data"] == "fivedata:data (train 320, test 64)"
    assert [v["steps"] for v in summary["vws"]] == [4, 4]
    assert "data: fivedata:data" in " ".join(res.output.split())
    # the accuracy is the trained weights' on the factory's test set (a single-process reference)
    import fivedata as factory  # written by the fixture

    module = factory.model()[0]
    module.load_state_dict(torch.load(out / "weights.pt"))
    acc, loss = evaluate_module(module, factory.data()[1], BATCH, torch.nn.functional.cross_entropy)
    assert summary["test_accuracy"] == pytest.approx(acc, abs=1e-9)
    assert summary["test_loss"] == pytest.approx(loss, rel=1e-5)


@pytest.mark.parametrize(
    ("data", "words"),
    [
        ("fivedata:three", "--data fivedata:three returned"),
        ("fivedata:listed", "--data fivedata:listed: the train set is empty"),
        ("fivedata:pairless", "--data fivedata:pairless: train[0] is"),
        ("fivedata:number", "--data fivedata:number: the train set is a int, not a Dataset"),
        ("fivedata:nothing", "--data fivedata:nothing: 'fivedata' has no callable 'nothing'"),
        ("nowhere", "--data 'nowhere': use 'package.module:factory'"),
        ("fivedata:ten", "--data fivedata:ten: a train target is 9, but the model outputs 5"),
    ],
)
def test_bad_data_is_one_line_and_exit_2(fivedata: Path, data: str, words: str) -> None:
    res = CliRunner().invoke(app, ["run", str(fivedata), "--data", data, "--steps", "2"])
    assert res.exit_code == 2, res.output
    errors = [line for line in res.output.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and words in errors[0], res.output
    assert "Traceback" not in res.output and "--resume" not in res.output


def test_a_factory_model_without_data_is_refused(fivedata: Path) -> None:
    res = CliRunner().invoke(app, ["run", str(fivedata), "--steps", "2"])
    assert res.exit_code == 2
    assert "has no data of its own: give --data pkg.mod:factory" in res.output


def test_synthetic_targets_follow_the_models_output_width(fivedata: Path) -> None:
    data = synthetic_data("fivedata:model", BATCH)
    assert data.label == "synthetic (random inputs, targets in [0, 5))"
    targets = torch.stack([data.train[i][1] for i in range(len(data.train))])  # type: ignore[arg-type]
    assert int(targets.max()) == 4 and int(targets.min()) == 0
    # built-in models: their own output widths
    for ref, width in (("mlp", 10), ("transformer", 256)):
        spec = resolve_source(ModelSource(ref=ref), 4, meta=True)
        assert output_classes(spec) == width
    assert synthetic_data("mlp", BATCH).label.startswith("synthetic")  # asked for: not digits


def test_the_given_test_set_is_the_one_measured_and_vw_alone_trains_on_train(
    fivedata: Path,
) -> None:
    import fivedata as factory  # written by the fixture

    train, test = factory.data()
    data = RunData(train, test, "mine")
    source, plan = ModelSource(ref="fivedata:model"), _plan()
    where = Attempt("file:///nonexistent")
    prep = prepare(plan, source, RunSpec(RunConfig(steps=2)), data, where)
    assert isinstance(prep, Prepared) and prep.test is not None and prep.data == "mine"
    assert [prep.test[i][1] for i in range(len(test))] == [test[i][1] for i in range(len(test))]  # type: ignore[arg-type]
    shards = [j.dataset for j in prep.stages]
    assert sorted(i for s in shards for i in s.indices) == list(range(len(train)))
    alone = prepare(plan, source, RunSpec(RunConfig(steps=2), vw=0), data, where)
    assert isinstance(alone, Prepared) and alone.stages[0].dataset is train


def test_steps_are_rounded_to_waves_only_through_the_shards(fivedata: Path) -> None:
    plan = _plan()
    assert steps_note(plan, -1, 5, 2).startswith("--steps 5 -> 6: whole waves of Nm 2")
    assert steps_note(plan, -1, 6, 2) == ""  # whole waves: exact
    assert steps_note(plan, 0, 5, 2) == ""  # one VW alone trains any number
    assert steps_note(plan, -1, 0, 2) == ""  # --epochs / --time-limit
