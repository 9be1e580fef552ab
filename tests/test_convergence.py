"""The convergence reference (benchmarks/convergence.py): exactness checks, fast."""

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch

from planner.wsp import s_global
from runtime.data import DigitsDataset
from runtime.results.evaluation import split_dataset

PATH = Path(__file__).resolve().parents[1] / "benchmarks" / "convergence.py"


@pytest.fixture(scope="module")
def conv() -> ModuleType:
    spec = importlib.util.spec_from_file_location("convergence_ref", PATH)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules["convergence_ref"] = mod  # dataclasses resolve their module by name
    spec.loader.exec_module(mod)
    return mod


def test_one_vw_nm1_equals_sequential_sgd(conv: ModuleType) -> None:
    train, test = split_dataset(DigitsDataset(), 0.2, seed=0)
    conv.self_check(train, test, 32, 0.1)  # raises AssertionError if they differ


def test_one_vw_nm2_differs_from_sequential_sgd(conv: ModuleType) -> None:
    """Local staleness (Nm = 2) changes the trajectory: the self-check can fail."""
    train, test = split_dataset(DigitsDataset(), 0.2, seed=0)
    tr = conv.Trainer(32, 0, test)
    w_seq, _ = conv.sequential(tr, train, 6, 0.1, 0, 10**9)
    w_wsp, _, _ = conv.wsp(tr, [train], 6, 2, 0, 0.1, 0, 10**9)
    assert not torch.allclose(w_wsp, w_seq, rtol=1e-6, atol=1e-7)


def test_two_vws_reach_exactly_s_global(conv: ModuleType) -> None:
    train, test = split_dataset(DigitsDataset(), 0.2, seed=0)
    tr = conv.Trainer(32, 0, test)
    _, _, worst = conv.wsp(tr, conv.shards_of(train, 2), 8, 2, 1, 0.1, 0, 10**9)
    assert worst == s_global(2, 1)
