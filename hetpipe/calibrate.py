"""``--calibrate-efficiency``: measure the efficiency model's inputs on the user's model and data.

Short single-process references (seconds on a CPU for a small model), the same rules the
stages apply (:mod:`planner.staleness`, :mod:`planner.wsp`) on the samples the runtime trains
on, fed and scored as the runtime does (:func:`runtime.data.model_inputs`: ``(input, target)``
pairs, or dict samples whose keys go to the forward by name; the model spec's loss, e.g. a
Hugging Face model's own ``loss``):

- the gradient noise scale ``phi``: mean squared norms of minibatch gradients at the initial
  weights at batch ``b`` and ``4 b`` (:func:`planner.efficiency.simple_noise_scale`);
- each remedy's delay cost ``c``: the run's optimizer (:attr:`Recipe.optimizer`: SGD, momentum
  SGD or Adam, stepped by the stages' own :class:`runtime.stage.weights.VersionedWeights`) at
  ``Nm = 1`` (sequential, :data:`STEPS` / 2 updates) and at ``Nm = 2, 3`` (delay 1, 2;
  :data:`STEPS` updates at most); the target is :data:`TARGET_SLACK` above the lowest held-out
  loss the sequential runs reach in their :data:`STEPS` / 2 updates; ``c`` is fitted to ``steps(tau) / steps(0) = 1 + c tau`` (:func:`planner.efficiency.fit_delay_cost`;
  a run that never reaches it counts as :data:`STEPS`, so ``c`` is then a lower bound).

Every run starts from the weights a run with the recipe's seed starts from
(:func:`seeded_model`) with the torch RNG seeded by it, leaving the caller's RNG state as it
was: two calibrations of the same inputs give the same figures bit for bit.

Step size (:class:`Recipe`): ``tuned`` (the default) runs every setting at its own best of
``lr x`` :data:`LR_FACTORS` (:func:`best_lr`: fewest updates to the target, ties by the last
held-out loss), as the systems compared are run (each tuned to its best step size: at one fixed
lr the delayed runs of a model tuned for sequential SGD diverge, and ``c`` only says so);
``fixed`` runs every setting at ``lr``. Sequential SGD runs every lr of the grid; a delayed
setting's search walks the grid down from the previous setting's best (a delay lowers the stable step size: delayed SGD's best lr is not above the
less-delayed one's) and stops at the first lr that does no better; a run stops once it reached
the target, can no longer beat the best lr's count, or diverged (:data:`DIVERGED`).
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils.data import Dataset, default_collate

from planner.efficiency import EfficiencyInputs, fit_delay_cost, simple_noise_scale
from planner.staleness import remedies_for, stage_delay
from profiler.errors import ConfigError, shown
from profiler.models import ModelSpec, resolve_model
from runtime.config import OptimizerConfig
from runtime.data import model_inputs
from runtime.stage.weights import VersionedWeights

__all__ = [
    "LR_FACTORS",
    "STEPS",
    "Recipe",
    "best_lr",
    "calibrate",
    "describe",
    "feed",
    "fit_steps",
    "noise_scale",
    "seeded_model",
    "steps_to",
]

STEPS = 160
"""Updates of each delayed calibration run (sequential runs: half)."""

MAX_SAMPLES = 4096
"""Samples drawn from the data set (collated once)."""

HELD_OUT = 64
"""Samples of the held-out loss (of :data:`MAX_SAMPLES`)."""

EVAL_EVERY = 8
"""Updates between two held-out loss measurements."""

LR_FACTORS = (1.0, 0.5, 0.25, 0.125)
"""``tuned``: the lr grid, the given lr times these (an octave either side of a best lr)."""

DIVERGED = 3.0
"""A run whose held-out loss is not finite or above this multiple of the initial one stops."""

TARGET_SLACK = 0.05
"""The target lies this share of the way from the lowest held-out loss sequential SGD reached
back to the initial loss: above a noisy minimum (a noise floor's lucky low is no target), on
the descent every setting crosses."""

Params = dict[str, Tensor]
LossAt = Callable[[Params, Sequence[int]], Tensor]
"""The loss of the samples at these indices with these weights (differentiable)."""
Progress = Callable[[str], None]
"""Told what the calibration does next (one short line)."""


@dataclass(frozen=True)
class Recipe:
    """How the calibration runs train (recorded in the plan).

    Attributes:
        optimizer: the run's optimizer (``sgd`` with its momentum, or ``adam`` with its betas;
            weight decay), the stages' own update rule; its ``lr`` is the run's learning rate
            (``--lr``; ``tuned``: the top of the grid).
        tuned: each setting at its best lr of ``lr x`` :data:`LR_FACTORS`; else all at ``lr``.
        remedies: the remedies whose delay cost is measured (empty, the default: all the
            optimizer allows, :func:`planner.staleness.remedies_for`).
        seed: the run's seed (``--seed``): the torch RNG of the runs (dropout), as the model's
            initial weights were built with it (:func:`seeded_model`).

    Raises:
        ConfigError: a remedy the optimizer cannot apply (``predict`` with Adam).
    """

    optimizer: OptimizerConfig
    tuned: bool = True
    remedies: tuple[str, ...] = field(default=())
    seed: int = 0

    def __post_init__(self) -> None:
        allowed = remedies_for(self.kind)
        if not self.remedies:
            object.__setattr__(self, "remedies", allowed)
        bad = [r for r in self.remedies if r not in allowed]
        if bad:
            raise ConfigError(
                f"calibration remedy {shown(bad[0])} cannot run with {self.optimizer.name}: "
                f"use one of {', '.join(allowed)}"
            )

    @property
    def lr(self) -> float:
        """The run's learning rate (``tuned``: the top of the grid)."""
        return self.optimizer.lr

    @property
    def kind(self) -> str:
        """The optimizer as ``hetpipe plan --optimizer`` names it: ``sgd``, ``momentum``,
        ``adam``."""
        if self.optimizer.name == "adam":
            return "adam"
        return "momentum" if self.optimizer.momentum else "sgd"

    @property
    def grid(self) -> tuple[float, ...]:
        """The learning rates tried, largest first."""
        return tuple(self.lr * f for f in LR_FACTORS) if self.tuned else (self.lr,)

    def config(self, lr: float, remedy: str) -> OptimizerConfig:
        """The stages' optimizer settings of one run: at ``lr`` under ``remedy`` (PipeMare's
        warm-up a quarter of a delayed run, :data:`STEPS` / 4 updates)."""
        return replace(self.optimizer, lr=lr, remedy=remedy, remedy_warmup=STEPS // 4)


@dataclass(frozen=True)
class _Job:
    """What every calibration run shares: the loss, initial weights, minibatches, held-out
    loss, the recipe and the held-out loss at the initial weights."""

    loss_at: LossAt
    w0: Params
    batches: list[list[int]]
    evaluate: Callable[[Params], float]
    recipe: Recipe
    initial: float


@dataclass(frozen=True)
class _Found:
    """A setting's best lr: its grid index, lr and held-out loss curve."""

    index: int
    lr: float
    curve: list[float]


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


def _run(job: _Job, nm: int, remedy: str, lr: float, updates: int,
         stop: Callable[[list[float]], bool]) -> list[float]:  # fmt: skip
    """One VW's delayed training (``Nm`` in flight) under ``remedy`` for at most ``updates``,
    stepped as a stage steps (:class:`runtime.stage.weights.VersionedWeights`: weight
    stashing, the run's optimizer, the remedy's prediction or step size); the held-out loss
    every :data:`EVAL_EVERY` updates, until ``stop(curve)`` or divergence."""
    master = {k: nn.Parameter(v.detach().clone()) for k, v in job.w0.items()}
    weights = VersionedWeights(master, nm, job.recipe.config(lr, remedy), total_updates=updates)
    curve: list[float] = []
    for p, idx in enumerate(job.batches[:updates], 1):
        at = weights.acquire(p)
        grads = torch.autograd.grad(job.loss_at(at, idx), list(at.values()))
        weights.update(p, dict(zip(at, grads, strict=True)))
        if p % EVAL_EVERY == 0:
            curve.append(job.evaluate({k: v.detach() for k, v in master.items()}))
            if not math.isfinite(curve[-1]) or curve[-1] > DIVERGED * job.initial or stop(curve):
                break
    return curve


def steps_to(curve: Sequence[float], target: float) -> int | None:
    """Evaluations until ``curve`` is at or below ``target`` (``None``: never).

    Example:
        >>> steps_to([4.0, 2.5, 2.0], 2.5), steps_to([4.0, float("nan")], 3.0)
        (2, None)
    """
    return next((k + 1 for k, loss in enumerate(curve) if loss <= target), None)


def _score(curve: Sequence[float], target: float) -> tuple[float, float]:
    """Lower is better: evaluations to ``target`` (``inf``: never), then the last held-out
    loss (``inf``: not finite)."""
    steps = steps_to(curve, target)
    last = curve[-1] if curve and math.isfinite(curve[-1]) else math.inf
    return (math.inf if steps is None else float(steps), last)


def best_lr(curves: Mapping[float, Sequence[float]], target: float) -> float:
    """The lr whose held-out loss curve reaches ``target`` in the fewest evaluations; ties (or
    when none reaches it): the lowest last loss (a diverged curve's is ``inf``).

    Example:
        >>> nan = float("nan")
        >>> best_lr({0.2: [3.0, nan], 0.1: [3.0, 2.0, 1.4], 0.05: [3.0, 1.5]}, 1.5)
        0.05
        >>> best_lr({0.2: [3.0, 2.9], 0.1: [3.0, 1.9], 0.05: [3.0, 2.0]}, 1.5)
        0.1
    """
    return min(curves, key=lambda lr: _score(curves[lr], target))


def _sequential(job: _Job, grid: Sequence[float], say: Progress) -> tuple[_Found, float]:
    """Sequential SGD at every lr of ``grid`` for :data:`STEPS` / 2 updates: the target
    (:data:`TARGET_SLACK` above the lowest loss any reached) and the lr reaching it soonest."""
    curves = []
    for lr in grid:
        say(f"sequential lr {lr:g}")
        curves.append(_run(job, 1, "none", lr, STEPS // 2, lambda _: False))
    floor = min((x for c in curves for x in c if math.isfinite(x)), default=job.initial)
    target = floor + TARGET_SLACK * max(0.0, job.initial - floor)
    k = min(range(len(grid)), key=lambda i: _score(curves[i], target))
    return _Found(k, grid[k], curves[k]), target


def _search(job: _Job, nm: int, remedy: str, grid: Sequence[float], start: int,
            target: float, say: Progress) -> _Found:  # fmt: skip
    """The best lr of ``grid[start:]`` for ``Nm``/``remedy`` (:func:`best_lr`), walking down
    the grid while each lr does better than the one before."""

    def attempt(k: int, best: _Found | None) -> _Found:
        say(f"{remedy} delay {nm - 1} lr {grid[k]:g}")
        bar = None if best is None else steps_to(best.curve, target)

        def stop(curve: list[float]) -> bool:
            return curve[-1] <= target or (bar is not None and len(curve) >= bar)

        return _Found(k, grid[k], _run(job, nm, remedy, grid[k], STEPS, stop))

    best = attempt(start, None)
    for k in range(start + 1, len(grid)):
        found = attempt(k, best)
        if _score(found.curve, target) >= _score(best.curve, target):
            break
        best = found
    return best


def fit_steps(seq_steps: int, delayed: Mapping[int, int | None], length: int) -> tuple[float, bool]:
    """``c`` from the evaluations sequential SGD (``seq_steps``) and each delay needed to the
    target (``None``: never within ``length``, counted as ``length``: ``c`` is then a lower
    bound, the second value).

    Example:
        >>> fit_steps(2, {1: 3, 2: None}, 4)
        (0.5, True)
    """
    points = [(float(tau), float(length if s is None else s)) for tau, s in delayed.items()]
    censored = any(s is None for s in delayed.values())
    return fit_delay_cost(float(seq_steps), points), censored


def calibrate(dataset: Dataset[Any], spec: ModelSpec, batch: int, recipe: Recipe,
              progress: Progress | None = None) -> EfficiencyInputs:  # fmt: skip
    """The efficiency inputs measured on ``spec``'s model and loss over ``dataset`` (the
    samples the runtime trains on: ``(input, target)`` pairs or dicts), trained by ``recipe``.

    Raises:
        ConfigError: too few samples, or samples neither pairs nor dicts.
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # small steps: more threads only contend (50x slower under load)
    try:
        with torch.random.fork_rng(devices=[]):  # the caller's RNG state is left as it was
            torch.manual_seed(recipe.seed)
            return _calibrate(dataset, spec, batch, recipe, progress or (lambda _: None))
    finally:
        torch.set_num_threads(threads)


def seeded_model(ref: str, batch: int, seed: int) -> ModelSpec:
    """Model ``ref`` (:func:`profiler.models.resolve_model`) holding the initial weights a run
    with ``--seed seed`` starts from (:func:`runtime.stage.model.initial_weights`), built
    under ``seed`` without touching the caller's RNG state: two calibrations of one model
    start alike, as its runs do.

    Raises:
        ModelError: the model cannot be built.
    """
    from runtime.config import ModelSource
    from runtime.stage.model import initial_weights

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        spec = resolve_model(ref, batch)
        w0 = initial_weights(ModelSource(ref=ref), batch, seed)
    with torch.no_grad():
        for name, p in spec.module.named_parameters():
            p.copy_(w0[name])
    return spec


def _take(batch: Any, at: Tensor) -> Any:
    """The rows ``at`` of every tensor of a collated ``batch`` (a tensor, tuple or dict)."""
    if isinstance(batch, Tensor):
        return batch[at]
    if isinstance(batch, Mapping):
        return {k: _take(v, at) for k, v in batch.items()}
    if isinstance(batch, (tuple, list)):
        return type(batch)(_take(v, at) for v in batch)
    return batch


def feed(dataset: Dataset[Any], spec: ModelSpec, batch: int) -> tuple[LossAt, int]:
    """The loss of ``spec``'s model at given weights on given samples of ``dataset`` (at most
    :data:`MAX_SAMPLES` of them, collated once), fed and scored as the runtime does
    (:func:`runtime.data.model_inputs`; keyword inputs by name), and how many samples.

    Raises:
        ConfigError: samples neither ``(input, target)`` pairs nor dicts.
    """
    n = len(dataset)  # type: ignore[arg-type]
    sample = dataset[0]
    if not isinstance(sample, Mapping) and not (
        isinstance(sample, (tuple, list)) and len(sample) == 2
    ):
        kind = type(sample).__name__
        kind += f" of {len(sample)}" if isinstance(sample, (tuple, list)) else ""
        raise ConfigError(
            "--calibrate-efficiency takes (input, target) or dict samples; this data gives a "
            f"{shown(kind)}: fix the data, or drop --calibrate-efficiency"
        )
    keep = random.Random(2).sample(range(n), min(n, MAX_SAMPLES))
    collated = default_collate([dataset[i] for i in keep])  # (n, ...) once: indexing is cheap
    rows = spec.targets.shape[0] if spec.targets.dim() else 0
    per_sample = rows // batch if rows and rows % batch == 0 else 0

    def loss_at(w: Params, idx: Sequence[int]) -> Tensor:
        at = torch.as_tensor(idx)
        shape = (per_sample * len(idx), *spec.targets.shape[1:]) if per_sample else ()
        inputs, y = model_inputs(_take(collated, at), spec.input_names, len(idx), shape)
        if spec.input_names:  # the user's module: keyword inputs by name
            kwargs = dict(zip(spec.input_names, inputs, strict=True))
            return spec.loss(torch.func.functional_call(spec.module, w, (), kwargs), y)
        return spec.loss(torch.func.functional_call(spec.module, w, inputs), y)

    return loss_at, len(keep)


def _calibrate(dataset: Dataset[Any], spec: ModelSpec, batch: int, recipe: Recipe,
               say: Progress) -> EfficiencyInputs:  # fmt: skip
    """:func:`calibrate`'s measurements (on one thread, the torch RNG seeded)."""
    loss_at, n = feed(dataset, spec, batch)
    params = {k: v.detach().clone().requires_grad_() for k, v in spec.module.named_parameters()}
    say("noise scale")
    phi = noise_scale(loss_at, params, n, batch)
    rng = random.Random(1)
    batches = [rng.sample(range(n), batch) for _ in range(STEPS)]
    held = rng.sample(range(n), min(n, HELD_OUT))

    def evaluate(w: Params) -> float:
        with torch.no_grad():
            return float(loss_at(w, held))

    job = _Job(loss_at, params, batches, evaluate, recipe, evaluate(params))
    costs, bounds, lrs = _delay_costs(job, recipe, say)
    return EfficiencyInputs(phi, costs, _source(n, recipe, lrs, bounds), _record(recipe, lrs))


def _delay_costs(job: _Job, recipe: Recipe, say: Progress) -> tuple[dict[str, float], list[str], dict[str, float]]:  # fmt: skip
    """Each remedy's ``c``, the remedies whose ``c`` is a lower bound, and the lr each setting
    ran at (``sequential``, ``none 1``, ``none 2``, ...)."""
    grid = recipe.grid
    seq, target = _sequential(job, grid, say)
    seq_steps = steps_to(seq.curve, target) or 1
    lrs = {"sequential": seq.lr}
    found: dict[tuple[str, int], _Found] = {}
    costs, bounds = {}, []
    for remedy in recipe.remedies:
        start = seq.index
        for tau in (1, 2):
            same = "none" if remedy == "pipemare" and stage_delay(tau + 1) <= 1 else remedy
            if (same, tau) not in found:  # pipemare at Nm 2 is plain SGD: its runs are none's
                found[same, tau] = _search(job, tau + 1, same, grid, start, target, say)
            found[remedy, tau] = found[same, tau]
            start, lrs[f"{remedy} {tau}"] = found[remedy, tau].index, found[remedy, tau].lr
        steps = {tau: steps_to(found[remedy, tau].curve, target) for tau in (1, 2)}
        cost, censored = fit_steps(seq_steps, steps, STEPS // EVAL_EVERY)
        costs[remedy] = round(cost, 3)
        bounds += [remedy] if censored else []
    return costs, bounds, lrs


def describe(optimizer: OptimizerConfig) -> str:
    """The optimizer and its hyper-parameters, in words (not the lr: each setting has its own).

    Example:
        >>> describe(OptimizerConfig("sgd", momentum=0.9)), describe(OptimizerConfig("sgd"))
        ('SGD momentum 0.9', 'SGD')
        >>> describe(OptimizerConfig("adam", weight_decay=1e-4))
        'Adam betas 0.9/0.999 eps 1e-08, weight decay 0.0001'
    """
    if optimizer.name == "adam":
        b1, b2 = optimizer.betas
        kind = f"Adam betas {b1:g}/{b2:g} eps {optimizer.eps:g}"
    else:
        kind = "SGD" + (f" momentum {optimizer.momentum:g}" if optimizer.momentum else "")
    return kind + (f", weight decay {optimizer.weight_decay:g}" if optimizer.weight_decay else "")


def _source(n: int, recipe: Recipe, lrs: Mapping[str, float], bounds: Sequence[str]) -> str:
    """The source line of calibrated inputs: data, optimizer, seed, step sizes, censoring."""
    kind = f"{describe(recipe.optimizer)}, seed {recipe.seed}"
    if recipe.tuned:
        each = ", ".join(f"{k} {v:g}" for k, v in lrs.items())
        factors = "/".join(f"{f:g}" for f in LR_FACTORS)
        kind += f", lr tuned per setting: best of {recipe.lr:g} x {factors}: {each}"
        if lrs.get("sequential") == recipe.lr:  # the reference may do better above it
            kind += "; sequential's best is the grid's top: a larger --lr may be faster"
        elif lrs.get("sequential") == recipe.grid[-1]:  # or below it (Adam at SGD's 0.05)
            kind += "; sequential's best is the grid's bottom: a smaller --lr may be faster"
    else:
        kind += f", lr {recipe.lr:g} fixed"
    note = f"; lower bounds ({', '.join(bounds)}: a delayed run never got there)" if bounds else ""
    return f"calibrated on the given data ({n} samples, {kind}{note})"


def _record(recipe: Recipe, lrs: Mapping[str, float]) -> dict[str, object]:
    """What the plan records of the calibration: the optimizer, its hyper-parameters, the seed
    and the step sizes."""
    opt = recipe.optimizer
    hyper: dict[str, object] = (
        {"betas": list(opt.betas), "eps": opt.eps}
        if opt.name == "adam"
        else {"momentum": opt.momentum}
    )
    return {
        "optimizer": recipe.kind,
        "lr": recipe.lr,
        **hyper,
        "weight_decay": opt.weight_decay,
        "seed": recipe.seed,
        "lr_mode": "tuned" if recipe.tuned else "fixed",
        "lr_grid": list(recipe.grid),
        "lr_of": dict(lrs),
    }
