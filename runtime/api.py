"""Python API: everything ``hetpipe run`` does, with the user's own model, data and loss.

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
from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from torch import nn
from torch.utils.data import Dataset, default_collate

from planner.cluster import Cluster, load_cluster
from planner.manual import hand_cut_plan
from planner.plan import Plan
from planner.plan_file import load_plan
from planner.planner import make_plan
from profiler.cpu_profile import emulation_profiles
from profiler.errors import ConfigError
from profiler.models import keyword_spec
from profiler.precision import check_precision
from runtime.by_value import check_guarded
from runtime.config import LossFn, ModelSource, OptimizerConfig, RunConfig, WSPConfig
from runtime.defaults import TIMEOUT_S
from runtime.run import run_plan
from runtime.stage.model import model_graph, resolve_source

if TYPE_CHECKING:
    from runtime.results.run_result import RunResult

__all__ = ["make_single_vw_plan", "train"]


def make_single_vw_plan(
    source: ModelSource,
    batch_size: int,
    nm: int,
    cluster: Cluster | None = None,
    stages: int = 0,
    cuts: tuple[int, ...] | None = None,
    precision: str = "fp32",
) -> Plan:
    """A one-VW plan, made by the planner: ``planner.planner.make_plan`` (policy ``ed``, one VW;
    an emulated cluster on the profiler's CPU profile) for a named model on a cluster when no
    cuts are forced, else a hand cut
    (:func:`planner.manual.hand_cut_plan`) splitting the parameters evenly over ``stages``."""
    if cluster is not None and cuts is None and not stages and source.ref is not None:
        cpu = emulation_profiles([], source.ref, batch_size, precision) if cluster.emulated else []
        return make_plan(
            cluster, cpu, model=source.ref, batch_size=batch_size, nm=nm or None, num_vws=1,
            policy="ed", precision=precision,
        )  # fmt: skip
    spec = resolve_source(source, batch_size, meta=source.module is None)
    graph = model_graph(source, spec)  # the run's one capture of a user's module
    hand = hand_cut_plan(graph, source.name, batch_size, nm, cluster, stages, cuts)
    return replace(hand, precision=precision)


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
    nm: int = 0,
    optimizer: OptimizerConfig | None = None,
    steps: int = 0,
    epochs: float = 0.0,
    time_limit_s: float = 0.0,
    seed: int = 0,
    out_dir: str | os.PathLike[str] | None = None,
    progress: bool = False,
    return_state: bool = True,
    timeout_s: float = TIMEOUT_S,
    emulate: bool = True,
    D: int | None = None,
    checkpoint_every: int = 0,
    vw: int = -1,
    precision: str = "",
    on_nonfinite: str = "stop",
    remedy: str = "",
) -> RunResult:
    """Train ``model`` with any plan on this host: what ``hetpipe run`` does, through the same
    entry (:func:`runtime.run.run_plan`): several VWs through the WSP parameter servers, one
    VW, or the AllReduce baseline, by the plan (default: one VW cut by hand or planned).

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
        nm: minibatches in flight (0 = the plan's, or 1).
        optimizer: optimizer and schedule (default SGD, lr 0.05).
        steps, epochs, time_limit_s: run length (see :class:`RunConfig`).
        seed: weights (for references) and data order.
        out_dir: run directory for metrics, calibration cache and logs.
        progress: show a progress bar.
        return_state: return the final parameters and buffers (``result.state_dict()``).
        timeout_s: timeout of every process-group operation.
        emulate: pace emulated devices and cap their memory.
        D: WSP clock-distance threshold of a plan with shards (``None`` = the plan's).
        checkpoint_every: with ``out_dir``, snapshot every K global clocks (AllReduce: steps;
            one VW alone writes none).
        vw: train only this VW of the plan, without parameter servers (-1 = every VW).
        precision: ``fp32`` or ``bf16`` (autocast, fp32 master weights, bfloat16 activations
            across cuts); ``""`` = the plan's (``fp32`` for a plan made here).
        on_nonfinite: a NaN or infinite loss or gradient: ``stop`` the run (``Diverged``) or
            ``skip`` that minibatch's update at every stage (``result.skipped_updates``).
        remedy: staleness remedy of every stage's update (``none``, ``predict``, ``pipemare``;
            :mod:`planner.staleness`), replacing ``optimizer.remedy``; ``""`` = the optimizer's.

    Returns:
        The run's :class:`runtime.results.run_result.RunResult`, whatever the rule: ``losses``,
        ``throughput``, ``state_dict()``, ``stages`` and one entry per VW in ``vws``.

    Raises:
        HetPipeError: invalid inputs or a failed run (naming the rank, VW and stage); a call
            from a script's top level outside ``if __name__ == "__main__":``.
    """
    check_guarded()
    if remedy:
        optimizer = replace(optimizer or OptimizerConfig(), remedy=remedy)
    given = load_plan(plan) if isinstance(plan, (str, os.PathLike)) else plan
    if given is not None:
        batch_size = given.batch_size  # the plan's minibatch, also for the sample inputs
    source = _source(model, dataset, loss_fn, batch_size)
    if given is None:
        cl = load_cluster(cluster) if isinstance(cluster, (str, os.PathLike)) else cluster
        given = make_single_vw_plan(
            source, batch_size, nm, cl, stages, cuts, check_precision(precision or "fp32")
        )
    run = RunConfig(
        steps=steps,
        epochs=epochs,
        time_limit_s=time_limit_s,
        seed=seed,
        nm=nm,
        out_dir=Path(out_dir) if out_dir is not None else None,
        timeout_s=timeout_s,
        emulate=emulate,
        return_state=return_state,
        progress=progress,
        precision=precision,
        on_nonfinite=on_nonfinite,
    )
    wsp = WSPConfig(D=D, checkpoint_every=checkpoint_every)
    return run_plan(given, source, optimizer, run, wsp, dataset, vw=vw)


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
