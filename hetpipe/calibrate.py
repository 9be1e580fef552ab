"""``--calibrate-efficiency``: measure the efficiency model's inputs on the user's model and data.

Short single-process references (seconds on a CPU for a small model), the same rules the
stages apply (:mod:`planner.staleness`, :mod:`planner.wsp`):

- the gradient noise scale ``phi``: mean squared norms of minibatch gradients at the initial
  weights at batch ``b`` and ``4 b`` (:func:`planner.efficiency.simple_noise_scale`);
- each remedy's delay cost ``c``: SGD at ``Nm = 1`` (sequential) and at ``Nm = 2, 3`` (delay
  1, 2) for :data:`STEPS` updates; the target is the held-out loss sequential SGD reaches
  halfway; ``c`` is fitted to ``steps(tau) / steps(0) = 1 + c tau``
  (:func:`planner.efficiency.fit_delay_cost`; a run that never reaches it counts as
  :data:`STEPS`, so ``c`` is then a lower bound).

The learning rate is the runs' default (``runtime.options.OPTIONS['lr']``) with momentum 0.9
for ``--optimizer momentum`` and ``adam``, 0 for ``sgd``: a run at another step size has
another ``c``.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor
from torch.utils.data import Dataset, default_collate

from planner.efficiency import EfficiencyInputs, fit_delay_cost, simple_noise_scale
from planner.staleness import pipemare_lr, predict_scale, stage_delay
from planner.wsp import local_version
from profiler.errors import ConfigError

__all__ = ["STEPS", "calibrate", "delay_cost", "noise_scale"]

STEPS = 160
"""Updates of each calibration run."""

MAX_SAMPLES = 4096
"""Samples drawn from the data set (collated once)."""

EVAL_EVERY = 8
"""Updates between two held-out loss measurements."""

Params = dict[str, Tensor]
LossAt = Callable[[Params, Sequence[int]], Tensor]
"""The loss of the samples at these indices with these weights (differentiable)."""


def noise_scale(loss_at: LossAt, params: Params, n: int, batch: int, draws: int = 8) -> float:
    """``phi`` at ``params`` from ``draws`` minibatches of ``batch`` and ``4 batch`` samples out
    of ``n`` (seeded)."""
    rng = random.Random(0)
    big = min(4 * batch, n)
    if big <= batch:
        raise ConfigError(
            f"--calibrate-efficiency: {n} samples cannot give two batch sizes above "
            f"--batch-size {batch}; give more data or a smaller batch"
        )

    def mean_sq(size: int) -> float:
        total = 0.0
        for _ in range(draws):
            g = torch.autograd.grad(
                loss_at(params, rng.sample(range(n), size)), list(params.values())
            )
            total += float(sum((x.detach() ** 2).sum() for x in g))
        return total / draws

    return simple_noise_scale(batch, big, mean_sq(batch), mean_sq(big))


def _run(loss_at: LossAt, w0: Params, batches: list[list[int]], nm: int, remedy: str,
         lr: float, momentum: float, evaluate: Callable[[Params], float]) -> list[float]:  # fmt: skip
    """One VW's delayed SGD (``Nm`` in flight, :func:`planner.wsp.local_version`) under
    ``remedy``; the held-out loss every :data:`EVAL_EVERY` updates."""
    w = {k: v.detach().clone() for k, v in w0.items()}
    vel = {k: torch.zeros_like(v) for k, v in w.items()}
    history = {0: (w, vel)}
    curve = []
    for p, idx in enumerate(batches, 1):
        w_v, vel_v = history[local_version(p, nm)]
        scale = predict_scale(p, nm, lr) if remedy == "predict" else 0.0
        at = {k: (w_v[k] - scale * vel_v[k]).requires_grad_() for k in w_v}
        grads = torch.autograd.grad(loss_at(at, idx), list(at.values()))
        step = (
            pipemare_lr(lr, p - 1, stage_delay(nm), len(batches) // 4)
            if remedy == "pipemare"
            else lr
        )
        vel = {
            k: momentum * vel[k] + g if momentum and p > 1 else g
            for k, g in zip(w, grads, strict=True)
        }
        w = {k: w[k] - step * vel[k] for k in w}
        history[p] = (w, vel)
        history.pop(p - nm, None)
        if p % EVAL_EVERY == 0:
            curve.append(evaluate(w))
    return curve


def delay_cost(curves: dict[int, list[float]]) -> tuple[float, bool]:
    """``c`` from held-out loss curves by delay (``0``: sequential): updates to the loss
    sequential SGD reaches halfway (the run's length when never reached), and whether a run
    never reached it (``c`` is then a lower bound).

    Example:
        >>> delay_cost({0: [4.0, 3.0, 2.0, 1.0], 1: [4.0, 3.5, 3.0, 2.5], 2: [4.0] * 4})
        (0.5, True)
    """
    seq = curves[0]
    half = max(1, len(seq) // 2)
    target = min(seq[:half])
    first = seq.index(target) + 1

    def reached(curve: list[float]) -> int:
        return next((k + 1 for k, loss in enumerate(curve) if loss <= target), len(curve))

    points = [(float(tau), float(reached(c))) for tau, c in curves.items() if tau > 0]
    censored = any(min(c) > target for tau, c in curves.items() if tau > 0)
    return fit_delay_cost(float(first), points), censored


def calibrate(dataset: Dataset[Any], model: torch.nn.Module, loss: Callable[..., Tensor],
              batch: int, optimizer: str, lr: float) -> EfficiencyInputs:  # fmt: skip
    """The efficiency inputs measured on ``model`` over ``dataset`` (``(input, target)``
    samples) with ``loss``.

    Raises:
        ConfigError: too few samples, or samples that are not ``(input, target)`` pairs.
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # small steps: more threads only contend (50x slower under load)
    try:
        return _calibrate(dataset, model, loss, batch, optimizer, lr)
    finally:
        torch.set_num_threads(threads)


def _calibrate(dataset: Dataset[Any], model: torch.nn.Module, loss: Callable[..., Tensor],
               batch: int, optimizer: str, lr: float) -> EfficiencyInputs:  # fmt: skip
    """:func:`calibrate`'s measurements (on one thread)."""
    torch.manual_seed(0)
    n = len(dataset)  # type: ignore[arg-type]
    sample = dataset[0]
    if not isinstance(sample, (tuple, list)) or len(sample) != 2:
        raise ConfigError(
            "--calibrate-efficiency takes (input, target) samples; this data gives "
            f"{type(sample).__name__}: drop --calibrate-efficiency for the defaults"
        )
    params = {k: v.detach().clone().requires_grad_() for k, v in model.named_parameters()}
    keep = random.Random(2).sample(range(n), min(n, MAX_SAMPLES))
    xs, ys = default_collate([dataset[i] for i in keep])  # (n, ...) once: indexing is cheap
    n = len(keep)

    def loss_at(w: Params, idx: Sequence[int]) -> Tensor:
        at = torch.as_tensor(idx)
        return loss(torch.func.functional_call(model, w, (xs[at],)), ys[at])

    phi = noise_scale(loss_at, params, n, batch)
    rng = random.Random(1)
    batches = [rng.sample(range(n), batch) for _ in range(STEPS)]
    held = rng.sample(range(n), min(n, 256))

    def evaluate(w: Params) -> float:
        with torch.no_grad():
            return float(loss_at(w, held))

    momentum = 0.0 if optimizer == "sgd" else 0.9
    remedies = ("none", "pipemare") if optimizer == "adam" else ("none", "predict", "pipemare")
    seq = _run(loss_at, params, batches, 1, "none", lr, momentum, evaluate)
    costs, bounds = {}, []
    for remedy in remedies:
        curves = {0: seq, **{nm - 1: _run(loss_at, params, batches, nm, remedy, lr, momentum,
                                          evaluate) for nm in (2, 3)}}  # fmt: skip
        cost, censored = delay_cost(curves)
        costs[remedy] = round(cost, 3)
        bounds += [remedy] if censored else []
    kind = f"SGD lr {lr:g}" + (f" momentum {momentum:g}" if momentum else "")
    note = f"; lower bounds ({', '.join(bounds)}: a delayed run never got there)" if bounds else ""
    return EfficiencyInputs(phi, costs, f"calibrated on the given data ({n} samples, {kind}{note})")
