"""Exact local staleness without processes: any valid task order gives the delayed-update result."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest
import torch
from torch import nn
from torch.testing import assert_close

from profiler.errors import ConfigError, HetPipeRuntimeError
from runtime.config import OptimizerConfig
from runtime.persist.run_dir import check_settings, job_settings
from runtime.stage.weights import VersionedWeights, lr_at


def _grad(w: torch.Tensor, mb: int) -> torch.Tensor:
    return torch.sin(w * mb) + 0.1 * mb  # depends on the version used: catches a wrong one


def _reference(w0: torch.Tensor, nm: int, steps: int, cfg: OptimizerConfig) -> torch.Tensor:
    p = nn.Parameter(w0.clone())
    opt = torch.optim.SGD([p], lr=cfg.lr, momentum=cfg.momentum)
    history = [p.detach().clone()]
    for mb in range(1, steps + 1):
        p.grad = _grad(history[max(0, mb - nm)], mb)
        opt.step()
        history.append(p.detach().clone())
    return p.detach()


@pytest.mark.parametrize("nm", [1, 2, 3, 5])
@pytest.mark.parametrize("order_seed", [0, 1, 2])
def test_any_valid_order_equals_delayed_updates(nm: int, order_seed: int) -> None:
    """Forwards in order, backwards in order, F(p) after B(p-Nm) (admission), B(p) after F(p)."""
    cfg = OptimizerConfig(lr=0.1, momentum=0.9)
    w0 = torch.linspace(-1, 1, 5)
    p = nn.Parameter(w0.clone())
    vw = VersionedWeights({"w": p}, nm, cfg)
    rng = random.Random(order_seed)
    steps, next_f, next_b = 12, 1, 1
    used: dict[int, torch.Tensor] = {}
    while next_b <= steps:
        can_f = next_f <= steps and next_f - nm < next_b  # B(next_f - nm) done
        can_b = next_b < next_f
        if can_f and (not can_b or rng.random() < 0.5):
            used[next_f] = vw.acquire(next_f)["w"]
            next_f += 1
        else:
            vw.update(next_b, {"w": _grad(used.pop(next_b).detach(), next_b)})
            next_b += 1
        assert vw.stashed_versions <= nm - 1
    assert_close(p.detach(), _reference(w0, nm, steps, cfg), rtol=1e-6, atol=1e-6)


def _drive(vw: VersionedWeights, first: int, last: int, nm: int, rng: random.Random) -> None:
    """Run minibatches ``first..last`` (this object's numbering) in a random valid order, and
    stop right after the update of ``last`` (forwards of later ones may have run: up to
    ``nm - 1`` beyond ``last``, as in a pipeline at a wave end)."""
    next_f = next_b = first
    used: dict[int, torch.Tensor] = {}
    while next_b <= last:
        can_f = next_f - nm < next_b  # B(next_f - nm) done
        if can_f and (next_b == next_f or rng.random() < 0.5):
            used[next_f] = vw.acquire(next_f)["w"]
            next_f += 1
        else:
            vw.update(next_b, {"w": _grad(used.pop(next_b).detach(), next_b + vw.first_update)})
            next_b += 1


@pytest.mark.parametrize("nm", [1, 2, 3, 5])
@pytest.mark.parametrize("order_seed", [0, 1])
@pytest.mark.parametrize("remedy", ["none", "predict", "pipemare"])
def test_resumed_versions_go_on_exactly(nm: int, order_seed: int, remedy: str) -> None:
    """A stage stopped at a wave end and rebuilt from its master, its versions in flight and
    its optimizer state ends bit-equal to one that never stopped, whatever the task order
    (and whatever the staleness remedy, :mod:`planner.staleness`)."""
    cfg = OptimizerConfig(lr=0.1, momentum=0.9, remedy=remedy, remedy_warmup=3 * nm)
    w0 = torch.linspace(-1, 1, 5)
    whole = VersionedWeights({"w": nn.Parameter(w0.clone())}, nm, cfg)
    _drive(whole, 1, 4 * nm, nm, random.Random(order_seed))
    cut = VersionedWeights({"w": nn.Parameter(w0.clone())}, nm, cfg)
    _drive(cut, 1, 2 * nm, nm, random.Random(order_seed + 10))
    versions, master = cut.in_flight_versions(), cut.master["w"].detach().clone()
    assert sorted(versions) == list(range(1 - nm, 0))
    state = cut.optimizer.state_dict() if cut.optimizer is not None else {}
    p = nn.Parameter(master)
    resumed = VersionedWeights({"w": p}, nm, cfg, first_update=2 * nm)
    resumed.restore_versions(versions)
    if resumed.optimizer is not None:
        resumed.optimizer.load_state_dict(state)
    _drive(resumed, 1, 2 * nm, nm, random.Random(order_seed + 20))
    assert torch.equal(p.detach(), whole.master["w"].detach())
    if nm > 1:  # the versions matter: starting every minibatch on the master differs
        plain = VersionedWeights({"w": nn.Parameter(master.clone())}, nm, cfg, first_update=2 * nm)
        if plain.optimizer is not None:
            plain.optimizer.load_state_dict(state)
        _drive(plain, 1, 2 * nm, nm, random.Random(0))
        assert not torch.equal(plain.master["w"].detach(), whole.master["w"].detach())


def test_forward_leaves_are_stashed_for_backward() -> None:
    """The leaves a forward used keep their values after later updates (weight stashing)."""
    p = nn.Parameter(torch.ones(3))
    vw = VersionedWeights({"w": p}, 2, OptimizerConfig(lr=1.0))
    first = vw.acquire(1)["w"]
    vw.acquire(2)
    vw.update(1, {"w": torch.ones(3)})
    third = vw.acquire(3)["w"]  # version 1 = w0 - 1
    assert_close(first, torch.ones(3))
    assert_close(third, torch.zeros(3))
    assert_close(vw.leaves(2)["w"], torch.ones(3))


def test_out_of_order_forward_is_rejected() -> None:
    vw = VersionedWeights({"w": nn.Parameter(torch.ones(1))}, 2, OptimizerConfig())
    with pytest.raises(HetPipeRuntimeError, match="out of order"):
        vw.acquire(2)


def test_lr_schedules() -> None:
    assert lr_at(OptimizerConfig(lr=1.0), 50) == 1.0
    assert lr_at(OptimizerConfig(lr=1.0, lr_schedule="step", step_size=10, gamma=0.5), 25) == 0.25
    assert lr_at(OptimizerConfig(lr=1.0, lr_schedule="warmup", warmup=4), 1) == 0.5
    assert lr_at(OptimizerConfig(lr=1.0, lr_schedule="cosine"), 10, 10) == pytest.approx(
        0.0, abs=1e-12
    )
    assert lr_at(OptimizerConfig(lr=1.0, lr_schedule="cosine"), 5, 10) == pytest.approx(0.5)


def test_a_snapshot_from_before_the_lr_schedule_rename_resumes() -> None:
    """Older snapshots record ``optimizer.schedule``: the same setting as ``lr_schedule``."""
    opt = OptimizerConfig(lr_schedule="cosine")
    now = job_settings("mlp", "{}", 1, 0, 0, 0.2, "d", opt, 10)
    old = {k.replace("lr_schedule", "schedule"): v for k, v in now}
    assert "optimizer.schedule" in old
    check_settings("resume", old, now)
    with pytest.raises(ConfigError, match=r"optimizer.lr_schedule is 'step' .*\(--lr-schedule\)"):
        step = replace(opt, lr_schedule="step")
        check_settings("resume", old, job_settings("mlp", "{}", 1, 0, 0, 0.2, "d", step, 10))


def test_a_skipped_update_keeps_weights_and_optimizer_state_and_moves_on() -> None:
    torch.manual_seed(0)
    lin = nn.Linear(3, 2)
    params = dict(lin.named_parameters())
    w = VersionedWeights(params, 2, OptimizerConfig(lr=0.1, momentum=0.9))
    grads = {n: torch.ones_like(p) for n, p in params.items()}
    for mb in (1, 2):
        w.acquire(mb)
    w.update(1, grads)
    before = {n: p.detach().clone() for n, p in params.items()}
    assert w.optimizer is not None
    momentum = {n: w.optimizer.state[p]["momentum_buffer"].clone() for n, p in params.items()}
    w.acquire(3)
    nan = {n: torch.full_like(p, float("nan")) for n, p in params.items()}
    w.update(2, nan, apply=False)
    assert w.version == 2
    for n, p in params.items():
        assert_close(p.detach(), before[n], rtol=0, atol=0)
        assert_close(w.optimizer.state[p]["momentum_buffer"], momentum[n], rtol=0, atol=0)
    w.update(3, grads)  # the next update goes on from there
    assert w.version == 3 and all(torch.isfinite(p).all() for p in params.values())
