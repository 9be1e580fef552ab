"""Many virtual workers through the WSP parameter servers on one host (paper Sec. 5 and 8.1).

The launcher starts one process per parameter-server shard (ranks ``0 .. n_shards-1``, placed
per the plan's ``shards``) and one per stage of every virtual worker (the following ranks,
VW by VW), all in one gloo process group. Each stage trains its partition with exact local
staleness and synchronises through :class:`runtime.wave_sync.WaveSync`: a push per wave, a
pull when the WSP rule needs one. Each VW trains on its own disjoint shard of the training
data; a held-out test split measures the exported model at the end.

Failures: the first process that raises or dies ends the run within seconds (a dead peer
closes its gloo connections, so every process blocked on it fails at once); the error names
the root cause (not its neighbours' consequences) and, with checkpoints, the command to resume.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import Dataset, Subset

from planner.plan import Plan
from profiler.errors import ConfigError, HetPipeRuntimeError
from profiler.graph import ModelGraph
from runtime.checkpoint import ShardState, resumable_clock, save_shard_state
from runtime.config import ModelSource, OptimizerConfig, RunConfig, WSPConfig
from runtime.data import default_dataset
from runtime.emulation import Calibration
from runtime.failures import root_cause_rank, stop_all, watch
from runtime.launcher import PRELOAD, loads_result, pacing_table, process_context, stage_contexts
from runtime.metrics import ProgressBar, StageResult, warn_overruns
from runtime.model import resolve_source
from runtime.ps import ShardSpec
from runtime.ps_core import ClockEvent
from runtime.ps_layout import shard_specs_for_layout
from runtime.stage import StageContext
from runtime.tied import check_untied_for_ps
from runtime.wsp_procs import ShardRole, shard_main, stage_main
from runtime.wsp_result import WSPResult, evaluate

__all__ = ["WSPConfig", "launch_wsp", "shard_specs", "split_data", "wsp_steps"]

log = logging.getLogger(__name__)


def split_data(
    dataset: Dataset[Any], n_vws: int, test_fraction: float, seed: int = 0
) -> tuple[list[Subset[Any]], Subset[Any]]:
    """Disjoint training shards (one per VW) and a held-out test split, by a seeded permutation."""
    n = len(dataset)  # type: ignore[arg-type]
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(10_007 + seed)).tolist()
    n_test = round(n * test_fraction)
    test, train = perm[:n_test], perm[n_test:]
    return [Subset(dataset, train[k::n_vws]) for k in range(n_vws)], Subset(dataset, test)


def shard_specs(
    plan: Plan, graph: ModelGraph, param_shapes: dict[str, tuple[int, ...]], D: int
) -> tuple[tuple[ShardSpec, ...], list[list[int]]]:
    """Every shard's spec (shards on ranks ``0..n-1``) and each VW's stage ranks after them."""
    n_shards = len(plan.shards)
    if n_shards == 0:
        raise ConfigError("the plan has no parameter-server shards; re-run 'hetpipe plan'")
    ranks, r = [], n_shards
    for vw in plan.virtual_workers:
        ranks.append(list(range(r, r + len(vw.stages))))
        r += len(vw.stages)
    specs = shard_specs_for_layout(
        [(lay.name, lay.params) for lay in graph.layers],
        param_shapes,
        [sh.layers for sh in plan.shards],
        [[(st.first_index, st.last_index) for st in vw.stages] for vw in plan.virtual_workers],
        list(range(n_shards)),
        ranks,
        D=D,
    )
    return specs, ranks


def _resume_clock(cfg: WSPConfig, n_shards: int) -> int | None:
    if not cfg.resume:
        return None
    if cfg.checkpoint_dir is None or not cfg.checkpoint_dir.is_dir():
        raise ConfigError(f"--resume {cfg.checkpoint_dir}: no such checkpoint directory")
    clock = resumable_clock(cfg.checkpoint_dir, n_shards)
    if clock is None:
        raise ConfigError(
            f"--resume {cfg.checkpoint_dir}: no clock has a checkpoint of all {n_shards} shards; "
            "start a fresh run instead"
        )
    return clock


def launch_wsp(
    plan: Plan,
    source: ModelSource,
    optimizer: OptimizerConfig | None = None,
    run: RunConfig | None = None,
    cfg: WSPConfig | None = None,
    dataset: Dataset[Any] | None = None,
    fault: str = "",
) -> WSPResult:
    """Train every virtual worker of ``plan`` through its parameter-server shards on this host.

    Args:
        plan: the plan (its VWs, Nm, D and shards).
        source: the model.
        optimizer: each stage's local optimizer (SGD lr 0.05 by default).
        run: run settings (``steps``/``epochs`` count minibatches per VW, rounded up to whole
            waves; with ``time_limit_s`` every VW runs the same number of waves, agreed when
            the first VW's time is up: see :mod:`runtime.stop`).
        cfg: WSP settings.
        dataset: the user's data set (``None`` = the model's built-in one).
        fault: fault injection for tests (``raise:S:P``/``kill:S:P`` on every VW's stage S,
            ``killshard:ID:SECONDS`` on a shard).

    Raises:
        ConfigError: bad settings.
        HetPipeRuntimeError: a process failed or died (the message names it).
    """
    optimizer = optimizer or OptimizerConfig()
    run = run or RunConfig()
    cfg = cfg or WSPConfig()
    if cfg.checkpoint_dir is None and run.out_dir is not None:
        cfg = dataclasses.replace(cfg, checkpoint_dir=run.out_dir / "checkpoints")
    t_start = time.time()
    nm = run.nm or plan.nm
    D = plan.D if cfg.D is None else cfg.D
    n_vws = len(plan.virtual_workers)
    spec = resolve_source(source, plan.batch_size, meta=source.module is None)
    ds = dataset if dataset is not None else default_dataset(
        source.name, spec.inputs, spec.targets, plan.batch_size
    )  # fmt: skip
    shards_data, test = split_data(ds, n_vws, cfg.test_fraction, run.seed)
    graph = ModelGraph.from_spec(spec)
    check_untied_for_ps(graph, plan)
    shapes = {n: tuple(p.shape) for n, p in spec.module.named_parameters()}
    specs, _ = shard_specs(plan, graph, shapes, D)
    first_wave = _resume_clock(cfg, len(specs)) or 0
    steps = wsp_steps(run, nm, first_wave, min(len(s) for s in shards_data), plan.batch_size)
    shards = [ShardRole(k, s, plan.shards[k].node) for k, s in enumerate(specs)]
    contexts: list[StageContext] = []
    calibrations: list[Calibration | None] = []
    for k in range(n_vws):
        ctxs = stage_contexts(plan, k, nm, steps, first_rank=len(shards) + len(contexts))
        vw_run = (
            run if run.out_dir is None else dataclasses.replace(run, out_dir=run.out_dir / f"vw{k}")
        )
        cal = pacing_table(plan, source, ctxs, vw_run)
        contexts += ctxs
        calibrations += [cal] * len(ctxs)
    if run.out_dir is not None:
        run.out_dir.mkdir(parents=True, exist_ok=True)
    log.info("%d VWs x %s stages, %d shards, Nm %d, D %d, %d minibatches per VW",
             n_vws, [len(v.stages) for v in plan.virtual_workers], len(shards), nm, D, steps)  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="hetpipe-rdzv-") as tmp:
        init_method = f"file://{Path(tmp) / 'rendezvous'}"
        stage_results, states = _spawn_and_watch(
            shards, contexts, calibrations, shards_data, source, optimizer, run, cfg, D,
            first_wave, init_method, fault, plan.batch_size,
        )  # fmt: skip
    warn_overruns(stage_results)
    if cfg.checkpoint_dir is not None and cfg.checkpoint_every > 0:
        for state, _ in states:  # the final clock, whatever the checkpoint period
            save_shard_state(state, cfg.checkpoint_dir)
    result = WSPResult.build(plan, nm, D, stage_results, states, specs, time.time() - t_start)
    ran = {st.steps for st in stage_results}
    if run.time_limit_s > 0 and ran and max(ran) < steps:
        note = f"time limit {run.time_limit_s:g} s: every VW stopped after wave {first_wave + max(ran) // nm}"
        result = dataclasses.replace(result, stopped_by=note)
    accuracy = evaluate(source, plan.batch_size, run.seed, result.state_dict(), test)
    result = dataclasses.replace(result, test_accuracy=accuracy[0], test_loss=accuracy[1])
    if run.out_dir is not None:
        result.save(run.out_dir)
    return result


def wsp_steps(run: RunConfig, nm: int, first_wave: int, vw_samples: int, batch_size: int) -> int:
    """Minibatches each VW trains in this run: whole waves, after the resumed ones.

    Raises:
        ConfigError: less than one minibatch per VW, or nothing left to train.
    """
    per_epoch = vw_samples // batch_size
    if per_epoch < 1:
        raise ConfigError(
            f"each VW gets {vw_samples} samples, fewer than one minibatch of {batch_size}: "
            "lower --batch-size or use fewer VWs"
        )
    if run.steps or run.epochs:
        steps = run.steps or max(1, round(run.epochs * per_epoch))
    else:
        steps = 2**62 if run.time_limit_s > 0 else per_epoch
    steps = -(-steps // nm) * nm  # whole waves: every VW pushes the same waves
    steps = max(0, steps - first_wave * nm)
    if steps == 0:
        raise ConfigError(f"the checkpoint is already at wave {first_wave}: nothing left to train")
    return steps


def _spawn_and_watch(
    shards: list[ShardRole],
    contexts: list[StageContext],
    calibrations: list[Calibration | None],
    data: list[Subset[Any]],
    source: ModelSource,
    optimizer: OptimizerConfig,
    run: RunConfig,
    cfg: WSPConfig,
    D: int,
    first_wave: int,
    init_method: str,
    fault: str,
    batch_size: int,
) -> tuple[list[StageResult], list[tuple[ShardState, list[ClockEvent]]]]:
    """Start every process and watch them; returns the stage results and the shard states."""
    mpc = process_context()
    mpc.set_forkserver_preload([*PRELOAD, "runtime.wsp_launcher", "runtime.wsp_procs"])
    events = mpc.Queue()
    procs: dict[int, Any] = {}
    world = len(shards) + len(contexts)
    specs = tuple(s.spec for s in shards)
    n_vws = 1 + max(c.vw for c in contexts)
    total = contexts[0].total_steps * n_vws
    progress = ProgressBar(run.progress, total, batch_size)
    resume_clock = first_wave if cfg.resume else None
    try:
        for sh in shards:
            args = (sh, source, batch_size, run.seed, cfg, resume_clock, run.timeout_s,
                    init_method, world, events, os.getpid(), fault)  # fmt: skip
            procs[sh.rank] = mpc.Process(
                target=shard_main, args=args, name=f"hetpipe-shard{sh.spec.id}"
            )
            procs[sh.rank].start()
        for ctx, cal in zip(contexts, calibrations, strict=True):
            stage_fault = "" if fault.startswith("killshard:") else fault
            args2 = (ctx, source, optimizer, run, data[ctx.vw], cal, specs, D, first_wave,
                     cfg, init_method, world, events, os.getpid(), stage_fault)  # fmt: skip
            procs[ctx.rank] = mpc.Process(
                target=stage_main, args=args2, name=f"hetpipe-vw{ctx.vw}-stage{ctx.stage}"
            )
            procs[ctx.rank].start()
        labels = {s.rank: s.where for s in shards} | {c.rank: c.where for c in contexts}
        results = _watch(labels, procs, events, progress, run, cfg)
    finally:
        progress.stop()
        stop_all(procs)
    stages = [r for r in results if isinstance(r, StageResult)]
    states = [r for r in results if not isinstance(r, StageResult)]
    return stages, states


def _watch(
    labels: dict[int, str],
    procs: dict[int, Any],
    events: Any,
    progress: ProgressBar,
    run: RunConfig,
    cfg: WSPConfig,
) -> list[Any]:
    """Every process's result, in rank order."""

    def fail(errors: dict[int, str], done: dict[int, bytes]) -> HetPipeRuntimeError:
        rank = root_cause_rank(procs, events, errors, done, grace_s=1.5)
        hint = ""
        if cfg.checkpoint_dir is not None and cfg.checkpoint_every > 0:
            hint = f"; resume with: {cfg.resume_hint} --resume {cfg.checkpoint_dir}"
        return HetPipeRuntimeError(f"rank {rank} ({labels[rank]}) failed: {errors[rank]}{hint}")

    stall_s = max(120.0, 4 * run.timeout_s)
    results = watch(procs, events, len(labels), progress.event, fail, stall_s)
    return [loads_result(results[r]) for r in sorted(results)]
