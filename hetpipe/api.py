"""The public Python API: ``hetpipe.train``, everything ``hetpipe run`` does, with the user's
own model, data and loss.

Example::

    import torch
    from torch import nn
    from torch.utils.data import TensorDataset
    import hetpipe

    model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4))
    data = TensorDataset(torch.randn(256, 8), torch.randint(0, 4, (256,)))
    result = hetpipe.train(model, data, nn.functional.cross_entropy, stages=2, nm=2, batch_size=16, steps=20)
    print(result.throughput, result.losses[-1])
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from torch import nn
from torch.utils.data import Dataset, default_collate

from hetpipe.planning import plan_on_the_fly
from planner.cluster import Cluster, load_cluster
from planner.on_the_fly import PlanRequest
from planner.plan import Plan
from planner.plan_file import load_plan
from profiler.errors import ConfigError, shown
from profiler.models import keyword_spec
from profiler.precision import check_precision
from runtime.by_value import check_guarded
from runtime.config import LossFn, ModelSource, OptimizerConfig
from runtime.options import OPTIONS, RENAMED, run_spec
from runtime.run import run_plan
from runtime.stage.model import model_graph, resolve_source

if TYPE_CHECKING:
    from runtime.results.run_result import RunResult

__all__ = ["train"]


def _module_source(
    model: nn.Module, dataset: Dataset[Any], loss_fn: LossFn | None, batch_size: int
) -> ModelSource:
    """The user's module with its first minibatch as the sample: ``(inputs, target)`` items,
    or dict items (``{"input_ids", "attention_mask", "labels"}``) mapped onto the forward's
    arguments by name (``labels`` to the loss unless the forward takes it)."""
    batch = default_collate([dataset[i] for i in range(batch_size)])
    if isinstance(batch, Mapping):
        spec = keyword_spec(type(model).__name__, model, batch, loss_fn)
        return ModelSource(
            module=model,
            sample_inputs=spec.inputs,
            sample_targets=spec.targets,
            loss=spec.loss,
            input_names=spec.input_names,
        )
    xs, y = batch
    if isinstance(xs, Mapping):
        spec = keyword_spec(type(model).__name__, model, xs, loss_fn)
        return ModelSource(
            module=model,
            sample_inputs=spec.inputs,
            sample_targets=y,
            loss=loss_fn,
            input_names=spec.input_names,
        )
    inputs = tuple(xs) if isinstance(xs, (tuple, list)) else (xs,)
    return ModelSource(module=model, sample_inputs=inputs, sample_targets=y, loss=loss_fn)


_OPT = OPTIONS  # the defaults below are the options table's, as hetpipe run's and torchrun's

_RENAMED = {
    "time_limit_s": "time_limit",
    "out_dir": "out",
    "timeout_s": "timeout",
    "D": "staleness",
}
"""Keyword names of earlier releases -> the options table's (accepted, with a warning)."""


def train(  # long by its signature and docstring (every option, documented); the body is ~30 lines
    model: nn.Module | str,
    dataset: Dataset[Any] | None = None,
    loss_fn: LossFn | None = None,
    *,
    plan: Plan | str | os.PathLike[str] | None = None,
    cluster: Cluster | str | os.PathLike[str] | None = None,
    stages: int = 0,
    cuts: tuple[int, ...] | None = None,
    batch_size: int = 32,
    out: str | os.PathLike[str] | None = None,
    progress: bool = False,
    return_state: bool = True,
    optimizer: OptimizerConfig | str = _OPT["optimizer"].default,
    steps: int = _OPT["steps"].default,
    epochs: float = _OPT["epochs"].default,
    time_limit: float = _OPT["time_limit"].default,
    seed: int = _OPT["seed"].default,
    nm: int = _OPT["nm"].default,
    vw: int = _OPT["vw"].default,
    staleness: int | None = _OPT["staleness"].default,
    checkpoint_every: int = _OPT["checkpoint_every"].default,
    keep: int = _OPT["keep"].default,
    on_failure: str = _OPT["on_failure"].default,
    max_restarts: int = _OPT["max_restarts"].default,
    overwrite: bool = _OPT["overwrite"].default,
    lr: float = _OPT["lr"].default,
    momentum: float = _OPT["momentum"].default,
    weight_decay: float = _OPT["weight_decay"].default,
    lr_schedule: str = _OPT["lr_schedule"].default,
    remedy: str = _OPT["remedy"].default,
    remedy_warmup: int = _OPT["remedy_warmup"].default,
    timeout: float = _OPT["timeout"].default,
    emulate: bool = _OPT["emulate"].default,
    precision: str = _OPT["precision"].default,
    on_nonfinite: str = _OPT["on_nonfinite"].default,
    profile_runtime: bool = _OPT["profile_runtime"].default,
    **renamed: Any,
) -> RunResult:
    """Train ``model`` with any plan on this host: what ``hetpipe run`` does, through the same
    entry (:func:`runtime.run.run_plan`) and the same :class:`runtime.spec.RunSpec`, built
    from the same options table (:data:`runtime.options.OPTIONS`: ``time_limit`` is
    ``--time-limit``, ``staleness`` is ``--D``, ...): several VWs through the WSP parameter
    servers, one VW, or the AllReduce baseline, by the plan (default: one VW cut by hand or
    planned, :func:`planner.on_the_fly.plan_for_run`).

    Args:
        model: an ``nn.Module`` (captured with ``torch.fx`` or ``torch.export``, e.g. a Hugging
            Face model) or a model reference (``mlp``).
        dataset: items ``(inputs, target)``, or dicts of tensors mapped onto the forward's
            arguments by name (``{"input_ids", "attention_mask", "labels"}``, ``{"x", "mask",
            "labels"}``; ``labels`` is the loss's target unless the forward takes it);
            ``None`` = built-in data.
        loss_fn: ``loss(outputs, targets)``; ``None`` = the model spec's (cross-entropy), or
            the model's own ``loss`` output for dict samples.
        plan: a plan (object or file); its batch size and Nm are used.
        cluster: cluster (object or cluster.yaml) to plan on when no plan is given.
        stages: number of stages when no plan is given (default: one per cluster device).
        cuts: force these cut points (layer indices) when no plan is given.
        batch_size: samples per minibatch when no plan is given.
        out: run directory (``--out``): metrics, summary, weights, checkpoints.
        progress: show a progress bar.
        return_state: return the final parameters and buffers (``result.state_dict()``).
        optimizer: ``sgd`` or ``adam`` with ``lr``, ``momentum``, ``weight_decay``,
            ``lr_schedule``; or a whole :class:`OptimizerConfig` (then leave those four out).
        steps, epochs, time_limit, seed, nm, vw, staleness, checkpoint_every, keep, on_failure,
            max_restarts, overwrite, lr, momentum, weight_decay, lr_schedule, remedy,
            remedy_warmup, timeout, emulate, precision, on_nonfinite, profile_runtime: the
            run options, as ``hetpipe run --help`` describes them (``precision`` ``""``: the
            plan's, ``fp32`` for a plan made here; ``remedy`` replaces an
            ``OptimizerConfig``'s unless ``none``).
        renamed: the names of earlier releases (``time_limit_s``, ``out_dir``, ``timeout_s``,
            ``D``), accepted with a ``DeprecationWarning`` for one release.

    Returns:
        The run's :class:`runtime.results.run_result.RunResult`, whatever the rule: ``losses``,
        ``throughput``, ``state_dict()``, ``stages`` and one entry per VW in ``vws``.

    Raises:
        HetPipeError: invalid inputs or a failed run (naming the rank, VW and stage); a call
            from a script's top level outside ``if __name__ == "__main__":``.
    """
    check_guarded()
    values = {k: v for k, v in locals().items() if k in OPTIONS} | {"data": ""}
    values["optimizer"] = optimizer if isinstance(optimizer, str) else optimizer.name
    values |= _renamed(renamed)
    out = values.pop("out", out)
    spec = run_spec(values, Path(out) if out is not None else None, progress)
    spec = replace(spec, optimizer=_optimizer(optimizer, spec.optimizer, values),
                   run=replace(spec.run, return_state=return_state))  # fmt: skip
    given = load_plan(plan) if isinstance(plan, (str, os.PathLike)) else plan
    if given is not None:
        batch_size = given.batch_size  # the plan's minibatch, also for the sample inputs
    source = _source(model, dataset, loss_fn, batch_size)
    if given is None:
        cl = load_cluster(cluster) if isinstance(cluster, (str, os.PathLike)) else cluster
        graph = None
        if source.module is not None:  # the user's module: cut by hand
            graph = model_graph(source, resolve_source(source, batch_size, meta=False))
        request = PlanRequest(source.name, batch_size, nm, stages, cuts, vws=1, policy="ed",
                              precision=check_precision(precision or "fp32"))  # fmt: skip
        given = plan_on_the_fly(cl, request, graph)
    return run_plan(given, source, spec, dataset)


def _renamed(renamed: dict[str, Any]) -> dict[str, Any]:
    """The options given under an earlier release's name, by their table name, each with a
    ``DeprecationWarning``.

    Raises:
        ConfigError: a keyword that is no option (names it).
    """
    values: dict[str, Any] = {}
    for old, value in renamed.items():
        if old in RENAMED:  # refused by the options table, naming the new name
            values[old] = value
            continue
        new = _RENAMED.get(old)
        if new is None:
            raise ConfigError(
                f"hetpipe.train: no option {shown(old, 40)}; use one of {', '.join(OPTIONS)}, out"
            )
        warnings.warn(f"hetpipe.train({old}=...) is now {new}=...; {old} goes in the next "
                      "release", DeprecationWarning, stacklevel=3)  # fmt: skip
        values[new] = value
    return values


def _optimizer(
    given: OptimizerConfig | str, table: OptimizerConfig, values: dict[str, Any]
) -> OptimizerConfig:
    """The stages' optimizer: the table's, or a whole ``OptimizerConfig`` given (with
    ``remedy`` applied unless ``none``).

    Raises:
        ConfigError: an ``OptimizerConfig`` and one of ``lr``, ``momentum``,
            ``weight_decay``, ``lr_schedule`` both given.
    """
    if isinstance(given, str):
        return table
    for name in ("lr", "momentum", "weight_decay", "lr_schedule"):
        if values[name] != OPTIONS[name].default:
            raise ConfigError(
                f"hetpipe.train: {name}={shown(values[name], 40)} and optimizer=OptimizerConfig"
                f"(...) both given; put {name} in the OptimizerConfig, or give optimizer='sgd'"
            )
    return given if table.remedy == "none" else replace(given, remedy=table.remedy)


def _source(
    model: nn.Module | str, dataset: Dataset[Any] | None, loss_fn: LossFn | None, batch_size: int
) -> ModelSource:
    """Where the processes get ``model`` from: a reference, or the user's module with one
    minibatch of ``dataset`` to trace it.

    Raises:
        ConfigError: a module without a data set, or a data set smaller than a minibatch.
    """
    if isinstance(model, str):
        return ModelSource(ref=model, loss=loss_fn)
    if dataset is None:
        raise ConfigError("a user nn.Module needs a dataset (items are (inputs, target))")
    size = len(dataset)  # type: ignore[arg-type]
    if size < batch_size:
        raise ConfigError(f"the data set has {size} samples, fewer than batch_size={batch_size}")
    return _module_source(model, dataset, loss_fn, batch_size)
