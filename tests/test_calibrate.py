"""``--calibrate-efficiency``: the noise-scale estimator and the short calibration runs."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch import nn
from torch.nn import functional as F
from torch.utils.data import TensorDataset
from typer.testing import CliRunner

from hetpipe.calibrate import STEPS, calibrate, delay_cost
from hetpipe.cli import app
from planner.efficiency import simple_noise_scale
from tests.conftest import EXAMPLES


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
    assert delay_cost({0: curve, 1: curve, 2: curve}) == (0.0, False)


def test_calibration_of_a_small_classifier_is_fast_and_complete() -> None:
    torch.manual_seed(0)
    x = torch.randn(512, 8)
    y = (x[:, 0] + 0.5 * torch.randn(512) > 0).long()  # noisy labels: a finite noise scale
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))
    before = torch.get_num_threads()
    got = calibrate(TensorDataset(x, y), model, F.cross_entropy, 16, "momentum", 0.05)
    assert torch.get_num_threads() == before
    assert 0 < got.noise_scale < math.inf
    assert set(got.delay_cost) == {"none", "predict", "pipemare"}
    assert all(0 <= c <= STEPS for c in got.delay_cost.values())
    assert got.source.startswith("calibrated on the given data (512 samples, SGD lr 0.05")
    adam = calibrate(TensorDataset(x, y), model, F.cross_entropy, 16, "adam", 0.05)
    assert "predict" not in adam.delay_cost


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
