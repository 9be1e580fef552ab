"""The planner's memory model counts the weight copies a stage really keeps under each remedy."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from planner.costmodel import optimizer_factor
from planner.staleness import remedy_weight_copies
from runtime.config import OptimizerConfig
from runtime.stage.weights import VersionedWeights


def _peak_copies(nm: int, remedy: str, momentum: float, steps: int = 12) -> int:
    """Most parameter-sized tensors a stage holds at once in its weights (master, versions and
    plain SGD's last gradient; the optimizer's state is counted apart), under 1F1B order."""
    p = {"w": nn.Parameter(torch.randn(64))}
    vw = VersionedWeights(p, nm, OptimizerConfig(lr=0.1, momentum=momentum, remedy=remedy))
    peak, updated = 0, 0
    for mb in range(1, steps + 1):
        vw.acquire(mb)
        storages = {t.data_ptr() for version in vw._versions.values() for t in version.values()}
        storages.add(p["w"].data_ptr())
        peak = max(peak, len(storages) + len(vw._last_grads))
        if mb - updated >= nm:  # Nm in flight: the oldest one's backward and update
            updated += 1
            vw.update(updated, {"w": torch.randn(64)})
    return peak


@pytest.mark.parametrize("nm", [1, 2, 3, 4])
@pytest.mark.parametrize("remedy", ["none", "predict", "pipemare"])
@pytest.mark.parametrize("optimizer", ["sgd", "momentum"])
def test_planner_counts_what_the_stage_keeps(nm: int, remedy: str, optimizer: str) -> None:
    momentum = 0.9 if optimizer == "momentum" else 0.0
    planned = 1 + (nm - 1) + remedy_weight_copies(remedy, nm, optimizer_factor(optimizer))
    assert _peak_copies(nm, remedy, momentum) == planned
