"""``--calibrate-efficiency``: the noise-scale estimator and the short calibration runs."""

from __future__ import annotations

import math
from collections.abc import Callable

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch import Tensor, nn
from torch.nn import functional as F
from torch.utils.data import Dataset, TensorDataset
from typer.testing import CliRunner

from hetpipe.calibrate import (
    EVAL_EVERY,
    LR_FACTORS,
    STEPS,
    Recipe,
    best_lr,
    calibrate,
    feed,
    fit_steps,
    seeded_model,
    steps_to,
)
from hetpipe.cli import app
from hetpipe.commands.objective import Calibration, efficiency_inputs
from planner.efficiency import simple_noise_scale
from profiler.errors import ConfigError
from profiler.models import ModelSpec, keyword_spec
from runtime.config import OptimizerConfig
from tests.conftest import EXAMPLES


def _momentum(lr: float, momentum: float = 0.9, **kwargs: object) -> Recipe:
    """A recipe of SGD at ``lr`` with ``momentum``."""
    return Recipe(OptimizerConfig("sgd", lr=lr, momentum=momentum), **kwargs)  # type: ignore[arg-type]


@given(st.floats(1e-3, 1e3), st.floats(0.0, 1e4), st.integers(1, 512), st.integers(2, 8))
def test_noise_scale_estimator_recovers_trace_over_norm(
    g2: float, tr: float, b: int, k: int
) -> None:
    """``E|g_B|^2 = |G|^2 + tr(Sigma) / B`` at two sizes gives back ``tr(Sigma) / |G|^2``."""
    big = b * k
    est = simple_noise_scale(b, big, g2 + tr / b, g2 + tr / big)
    assert est == pytest.approx(tr / g2, rel=1e-6, abs=1e-6)


def test_noise_scale_estimator_without_signal_is_infinite() -> None:
    assert math.isinf(simple_noise_scale(8, 32, 5.0, 5.0 / 4 - 1.0))


def test_delay_cost_is_zero_when_delay_changes_nothing() -> None:
    curve = [4.0, 3.0, 2.0, 1.0]
    steps = steps_to(curve, 2.0)
    assert steps == 3
    assert fit_steps(steps, {1: steps, 2: steps}, len(curve)) == (0.0, False)


def _classifier() -> tuple[Tensor, Tensor, nn.Module]:
    torch.manual_seed(0)
    x = torch.randn(512, 8)
    y = (x[:, 0] + 0.5 * torch.randn(512) > 0).long()  # noisy labels: a finite noise scale
    return x, y, nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))


def test_calibration_of_a_small_classifier_is_fast_and_complete() -> None:
    x, y, model = _classifier()
    spec = ModelSpec("m", model, (x[:16],), y[:16], batch_size=16)
    before = torch.get_num_threads()
    said: list[str] = []
    got = calibrate(TensorDataset(x, y), spec, 16, _momentum(0.05), said.append)
    assert torch.get_num_threads() == before
    assert said[0] == "noise scale" and said[1] == "sequential lr 0.05"
    assert 0 < got.noise_scale < math.inf
    assert set(got.delay_cost) == {"none", "predict", "pipemare"}
    assert all(0 <= c <= STEPS for c in got.delay_cost.values())
    assert got.source.startswith(
        "calibrated on the given data (512 samples, SGD momentum 0.9, seed 0, lr"
    )
    record = got.calibration
    assert record["lr_mode"] == "tuned" and record["lr_grid"] == [0.05 * f for f in LR_FACTORS]
    assert (record["optimizer"], record["momentum"], record["seed"]) == ("momentum", 0.9, 0)
    settings = {"sequential", *(f"{r} {t}" for r in got.delay_cost for t in (1, 2))}
    assert set(record["lr_of"]) == settings  # type: ignore[call-overload]
    assert got.to_dict()["calibration"] == record


def test_adam_calibrates_with_adam_and_without_predict() -> None:
    """An Adam run's recipe measures Adam's delay costs (no ``predict``: it follows SGD's
    velocity) and says so in the source and the record."""
    x, y, model = _classifier()
    spec = ModelSpec("m", model, (x[:16],), y[:16], batch_size=16)
    adam = Recipe(OptimizerConfig("adam", lr=0.01), tuned=False, seed=4)
    assert adam.remedies == ("none", "pipemare")
    got = calibrate(TensorDataset(x, y), spec, 16, adam)
    assert set(got.delay_cost) == {"none", "pipemare"}
    assert "(512 samples, Adam betas 0.9/0.999 eps 1e-08, seed 4, lr 0.01 fixed" in got.source
    record = got.calibration
    assert (record["optimizer"], record["betas"], record["seed"]) == ("adam", [0.9, 0.999], 4)
    assert "momentum" not in record
    with pytest.raises(ConfigError, match="remedy 'predict' cannot run with adam"):
        Recipe(OptimizerConfig("adam"), remedies=("none", "predict"))


@pytest.mark.parametrize(
    ("optimizer", "nm"), [(OptimizerConfig("adam", lr=0.01, weight_decay=0.01), 2),
                          (OptimizerConfig("sgd", lr=0.05, momentum=0.9), 3)],
)  # fmt: skip
def test_references_step_with_the_runs_optimizer(optimizer: OptimizerConfig, nm: int) -> None:
    """A calibration run is the run's optimizer (``torch.optim``, the stages' settings) applied
    to gradients at the weights ``Nm - 1`` updates old (weight stashing): a plain loop over
    the same minibatches gives the same held-out losses."""
    from hetpipe import calibrate as cal

    x, y, model = _classifier()
    spec = ModelSpec("m", model, (x[:16],), y[:16], batch_size=16)
    loss_at, _ = feed(TensorDataset(x, y), spec, 16)
    w0 = {k: v.detach().clone() for k, v in model.named_parameters()}
    batches = [list(range(16 * i, 16 * i + 16)) for i in range(4 * EVAL_EVERY)]

    def evaluate(w: dict[str, Tensor]) -> float:
        return float(loss_at(w, range(64)).detach())

    job = cal._Job(loss_at, w0, batches, evaluate, Recipe(optimizer), evaluate(w0))
    got = cal._run(job, nm, "none", optimizer.lr, len(batches), lambda _: False)
    params = {k: nn.Parameter(v.clone()) for k, v in w0.items()}
    if optimizer.name == "adam":
        opt: torch.optim.Optimizer = torch.optim.Adam(
            params.values(), lr=optimizer.lr, weight_decay=optimizer.weight_decay
        )
    else:
        opt = torch.optim.SGD(params.values(), lr=optimizer.lr, momentum=optimizer.momentum)
    versions, want = [w0], []
    for p, idx in enumerate(batches, 1):
        at = {k: v.clone().requires_grad_() for k, v in versions[max(0, p - nm)].items()}
        grads = torch.autograd.grad(loss_at(at, idx), list(at.values()))
        for param, g in zip(params.values(), grads, strict=True):
            param.grad = g
        opt.step()
        versions.append({k: v.detach().clone() for k, v in params.items()})
        if p % EVAL_EVERY == 0:
            want.append(evaluate(versions[-1]))
    assert got == pytest.approx(want, rel=1e-5)


def test_two_calibrations_of_one_model_give_the_same_figures() -> None:
    """The model is built from the run's seed (its initial weights are a run's): whatever the
    caller's RNG state, the figures repeat bit for bit, and that state is left as it was."""
    cal = Calibration("tests.calib_toy:data", lr=0.05, lr_mode="fixed", seed=3)
    figures = []
    for caller_seed in (1, 2):
        torch.manual_seed(caller_seed)
        state = torch.random.get_rng_state()
        figures.append(efficiency_inputs(cal, "tests.calib_toy:model", 16, "momentum").to_dict())
        assert torch.equal(torch.random.get_rng_state(), state)
    assert figures[0] == figures[1]
    assert figures[0]["calibration"]["seed"] == 3  # type: ignore[index]
    assert "seed 3" in figures[0]["source"]  # type: ignore[operator]


def test_the_seeded_model_holds_the_runs_initial_weights() -> None:
    from runtime.config import ModelSource
    from runtime.stage.model import initial_weights

    ref = "tests.calib_toy:model"
    got = dict(seeded_model(ref, 16, seed=5).module.named_parameters())
    run = initial_weights(ModelSource(ref=ref), 16, 5)
    assert set(got) == set(run) and all(torch.equal(got[k], run[k]) for k in run)
    other = dict(seeded_model(ref, 16, seed=6).module.named_parameters())
    assert not all(torch.equal(other[k], run[k]) for k in run)


class _KeywordNet(nn.Module):
    """A Hugging Face-like module: keyword inputs, its own loss given ``labels``."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, features: Tensor, labels: Tensor) -> dict[str, Tensor]:
        logits = self.inner(features)
        return {"logits": logits, "loss": F.cross_entropy(logits, labels)}


class _Dicts(Dataset[dict[str, Tensor]]):
    def __init__(self, x: Tensor, y: Tensor) -> None:
        self.x, self.y = x, y

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> dict[str, Tensor]:
        return {"features": self.x[i], "labels": self.y[i]}


def test_dict_samples_calibrate_like_the_pairs_of_the_same_model() -> None:
    """A keyword model on dict samples (its own loss) measures what the same weights measure
    on ``(input, target)`` pairs with cross-entropy: one feed for both."""
    x, y, model = _classifier()
    pairs = ModelSpec("m", model, (x[:16],), y[:16], batch_size=16)
    wrapped = _KeywordNet(model)
    dicts = keyword_spec("k", wrapped, {"features": x[:16], "labels": y[:16]})
    assert dicts.input_names == ("features", "labels")
    recipe = _momentum(0.05, tuned=False)
    a = calibrate(TensorDataset(x, y), pairs, 16, recipe)
    b = calibrate(_Dicts(x, y), dicts, 16, recipe)
    assert b.noise_scale == pytest.approx(a.noise_scale, rel=1e-4)
    assert b.delay_cost == a.delay_cost
    assert "lr 0.05 fixed" in a.source and "lr 0.05 fixed" in b.source


def test_samples_neither_pairs_nor_dicts_are_one_line() -> None:
    x, y, model = _classifier()
    spec = ModelSpec("m", model, (x[:16],), y[:16], batch_size=16)
    with pytest.raises(ConfigError, match=r"takes \(input, target\) or dict samples.*tuple of 1"):
        calibrate(TensorDataset(x), spec, 16, _momentum(0.05))


def test_tuned_mode_picks_the_lr_that_reaches_the_target_soonest() -> None:
    nan = float("nan")
    curves = {0.4: [5.0, nan], 0.2: [5.0, 3.0, 1.9], 0.1: [5.0, 2.5, 2.0], 0.05: [5.0, 4.0, 3.0]}
    assert best_lr(curves, target=2.5) == 0.1  # 2 evaluations, though 0.2 ends lower
    assert best_lr(curves, target=2.0) == 0.2  # 3 evaluations each: the lower last loss
    assert best_lr(curves, target=1.0) == 0.2  # none reaches it: the lowest last loss
    assert best_lr({0.4: [5.0, nan], 0.2: [5.0, 9.0]}, target=1.0) == 0.2  # diverged loses


def test_fixed_and_tuned_recipes_grid() -> None:
    assert _momentum(0.08, 0.0, tuned=False).grid == (0.08,)
    assert _momentum(0.08, 0.0).grid == (0.08, 0.04, 0.02, 0.01)


@pytest.mark.parametrize(
    ("args", "fragment"),
    [(["--calibrate-efficiency", "builtin"], "feeds --objective time"),
     (["--calibrate-efficiency", "builtin", "--objective", "time"], "needs --model")],
)  # fmt: skip
def test_calibration_options_are_checked_before_planning(args: list[str], fragment: str) -> None:
    res = CliRunner().invoke(app, ["plan", str(EXAMPLES / "emulated_cluster.yaml"), *args])
    assert res.exit_code == 2 and fragment in res.output, res.output
    assert len(res.output.strip().splitlines()) == 1


@pytest.mark.parametrize("module", ["hetpipe.calibrate", "hetpipe.commands.objective"])
def test_doctests(module: str) -> None:
    import doctest
    import importlib

    res = doctest.testmod(importlib.import_module(module))
    assert res.attempted > 0 and res.failed == 0


_RATES = {  # held-out loss drop per evaluation (from 10, floor 2): a hand-built tuning case
    (1, "none"): {0.4: -1.0, 0.2: 0.8, 0.1: 0.4, 0.05: 0.2},  # 0.4 diverges
    (2, "none"): {0.2: 0.5, 0.1: 0.6, 0.05: 0.3},  # delayed: 0.1 beats 0.2
    (3, "none"): {0.1: 0.4, 0.05: 0.2},
    (2, "predict"): {0.2: 0.8, 0.1: 0.4},
    (3, "predict"): {0.2: 0.8, 0.1: 0.4},
    (3, "pipemare"): {0.1: 0.5, 0.05: 0.25},
}


def test_tuned_calibration_fits_c_from_each_settings_soonest_lr(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Each setting at the lr of the grid that reaches the target (5 % above sequential's
    lowest loss: 2.4) soonest; the search walks down from the less-delayed setting's best and
    stops at the first lr that does no better; PipeMare at Nm 2 reuses plain SGD's runs."""
    from hetpipe import calibrate as cal

    calls: list[tuple[int, str, float]] = []

    def fake_run(job: object, nm: int, remedy: str, lr: float, updates: int,
                 stop: Callable[[list[float]], bool]) -> list[float]:  # fmt: skip
        calls.append((nm, remedy, lr))
        curve: list[float] = []
        for k in range(1, updates // cal.EVAL_EVERY + 1):
            curve.append(max(2.0, 10.0 - _RATES[nm, remedy][lr] * k))
            if stop(curve):
                break
        return curve

    monkeypatch.setattr(cal, "_run", fake_run)
    recipe = _momentum(0.4, 0.0)
    job = cal._Job(lambda w, i: torch.zeros(()), {}, [], lambda w: 0.0, recipe, initial=10.0)
    costs, bounds, lrs = cal._delay_costs(job, recipe, lambda _: None)
    assert lrs == {"sequential": 0.2, "none 1": 0.1, "none 2": 0.1, "predict 1": 0.2,
                   "predict 2": 0.2, "pipemare 1": 0.1, "pipemare 2": 0.1}  # fmt: skip
    # sequential 10 evaluations; none 13 and 19; predict 10 and 10; pipemare 13 and 16
    assert costs == {"none": 0.42, "predict": 0.0, "pipemare": 0.3} and bounds == []
    assert (2, "pipemare", 0.1) not in calls and (3, "none", 0.2) not in calls
    assert (2, "predict", 0.05) not in calls  # 0.1 did worse than 0.2: the walk stopped
    assert "grid's top" not in cal._source(1, recipe, lrs, bounds)
    top = cal._source(1, recipe, {**lrs, "sequential": 0.4}, bounds)
    assert "sequential's best is the grid's top: a larger --lr may be faster" in top
    assert "grid's bottom" not in top and "grid's bottom" not in cal._source(1, recipe, lrs, [])
    bottom = cal._source(1, recipe, {**lrs, "sequential": 0.05}, bounds)
    assert "sequential's best is the grid's bottom: a smaller --lr may be faster" in bottom
