"""Many virtual workers through the WSP parameter servers on one host (paper Sec. 5 and 8.1).

The launcher starts one process per parameter-server shard (ranks ``0 .. n_shards-1``, placed
per the plan's ``shards``) and one per stage of every virtual worker (the following ranks,
VW by VW), all in one gloo process group. Each stage trains its partition with exact local
staleness and synchronises through :class:`runtime.sync.wave.WaveSync`: a push per wave, a
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
import time
from pathlib import Path
from typing import Any

from torch.utils.data import Dataset, Subset

from planner.plan import Plan
from profiler.errors import ConfigError, HetPipeRuntimeError
from profiler.graph import ModelGraph
from runtime.config import ModelSource, OptimizerConfig, RunConfig, WSPConfig
from runtime.data import default_dataset
from runtime.launch.evict import VWEvictor
from runtime.launch.failures import (
    Heartbeats,
    Interrupted,
    rendezvous_dir,
    root_cause_rank,
    stop_all,
    watch,
)
from runtime.launch.procs import ShardJob, loads_result, shard_main, stage_main
from runtime.launch.single import PRELOAD, pacing_table, process_context, stage_contexts
from runtime.persist.checkpoint import ShardState
from runtime.persist.run_dir import RunDirectory, check_settings, job_settings
from runtime.persist.snapshot import Manifest, SnapshotSpec, clean, committed_clocks, select
from runtime.ps.core import ClockEvent
from runtime.ps.layout import ShardSpec, shard_specs_for_layout
from runtime.results.evaluation import shard_dataset, split_dataset
from runtime.results.metrics import ProgressBar, StageResult, warn_overruns
from runtime.results.timeline import describe_run
from runtime.results.wsp import LostVW, WSPResult, evaluate, export_snapshot
from runtime.stage.job import StageJob
from runtime.stage.model import resolve_source
from runtime.sync.rule import SyncSpec

__all__ = ["launch_wsp", "shard_specs", "snapshot_parts", "split_data", "wsp_steps"]

log = logging.getLogger(__name__)


def split_data(
    dataset: Dataset[Any], n_vws: int, test_fraction: float, seed: int = 0
) -> tuple[list[Subset[Any]], Subset[Any]]:
    """Disjoint training shards (one per VW) and the held-out test split
    (:func:`runtime.results.evaluation.split_dataset`, the split every run uses)."""
    train, test = split_dataset(dataset, test_fraction, seed)
    return shard_dataset(train, n_vws), test


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


def launch_wsp(
    plan: Plan,
    source: ModelSource,
    optimizer: OptimizerConfig | None = None,
    run: RunConfig | None = None,
    cfg: WSPConfig | None = None,
    dataset: Dataset[Any] | None = None,
) -> WSPResult:
    """Train every virtual worker of ``plan`` through its parameter-server shards on this host.

    The run directory (``run.out_dir``, else ``cfg.checkpoint_dir``) is claimed for this run
    (:class:`runtime.persist.run_dir.RunDirectory`); snapshots go to ``cfg.checkpoint_dir`` (default
    ``out_dir/checkpoints``). Resuming a run that already trained every step writes its final
    outputs from the last snapshot instead (:func:`export_snapshot`).

    Args:
        plan: the plan (its VWs, Nm, D and shards).
        source: the model.
        optimizer: each stage's local optimizer (SGD lr 0.05 by default).
        run: run settings (``steps``/``epochs`` count minibatches per VW, rounded up to whole
            waves; with ``time_limit_s`` every VW runs the same number of waves, agreed when
            the first VW's time is up: see :mod:`runtime.launch.stop`).
        cfg: WSP settings.
        dataset: the user's data set (``None`` = the model's built-in one).

    Raises:
        ConfigError: bad settings, a directory that holds another run, a mismatched resume.
        HetPipeRuntimeError: a process failed or died (the message names it), a disk error.
    """
    optimizer = optimizer or OptimizerConfig()
    run = run or RunConfig()
    cfg = cfg or WSPConfig()
    if cfg.checkpoint_dir is None and run.out_dir is not None:
        cfg = dataclasses.replace(cfg, checkpoint_dir=run.out_dir / "checkpoints")
    run_dir = run.out_dir or cfg.checkpoint_dir
    if run_dir is None:
        if cfg.resume:
            raise ConfigError("--resume needs the run's directory (--out or a checkpoint folder)")
        return _launch(plan, source, optimizer, run, cfg, dataset, None)
    with RunDirectory(run_dir, resume=cfg.resume, overwrite=cfg.overwrite) as owner:
        try:
            return _launch_restarting(plan, source, optimizer, run, cfg, dataset, owner)
        except KeyboardInterrupt:  # after training (evaluation, outputs): the snapshot stays
            raise HetPipeRuntimeError(
                f"interrupted (Ctrl-C); write the outputs from the last snapshot with: "
                f"{cfg.resume_hint} --resume {run_dir}"
            ) from None


def _launch_restarting(
    plan: Plan,
    source: ModelSource,
    optimizer: OptimizerConfig,
    run: RunConfig,
    cfg: WSPConfig,
    dataset: Dataset[Any] | None,
    owner: RunDirectory,
) -> WSPResult:
    """``--on-failure restart``: after a process failure, restart the whole job from its last
    committed snapshot, up to ``cfg.max_restarts`` times (test faults fire in the first
    attempt only); the result lists the failures survived."""
    restarts: list[str] = []
    while True:
        try:
            result = _launch(plan, source, optimizer, run, cfg, dataset, owner)
            break
        except HetPipeRuntimeError as exc:
            ckpt = cfg.checkpoint_dir
            if len(restarts) >= cfg.max_restarts or ckpt is None or isinstance(exc, Interrupted):
                raise
            committed = committed_clocks(ckpt)  # none yet: start again from the beginning
            why = str(exc).split("; resume with:")[0]
            restarts.append(f"{why} (restarted from clock {max(committed, default=0)})")
            log.warning("restart %d of %d from the last snapshot after: %s",
                        len(restarts), cfg.max_restarts, restarts[-1])  # fmt: skip
            cfg = dataclasses.replace(cfg, resume=bool(committed), resume_clock=None,
                                      stage_fault=None, write_fault=None, shard_fault=None)  # fmt: skip
    if restarts:
        result = dataclasses.replace(result, restarts=tuple(restarts))
        if run.out_dir is not None:
            result.save(run.out_dir)  # the summary says what was survived
    return result


def _launch(
    plan: Plan,
    source: ModelSource,
    optimizer: OptimizerConfig,
    run: RunConfig,
    cfg: WSPConfig,
    dataset: Dataset[Any] | None,
    owner: RunDirectory | None,
) -> WSPResult:
    t_start = time.time()
    nm = run.nm or plan.nm
    rule = plan.sync if plan.sync in ("backup", "easgd") else "wsp"  # the shard rules
    D = (plan.D if cfg.D is None else cfg.D) if rule == "wsp" else 0  # the others: D = 0
    if cfg.evict and rule != "wsp":
        raise ConfigError(
            f"--on-failure continue evicts a VW from the WSP clock; the {rule} rule has no such "
            "clock: use --sync wsp, or --on-failure stop|restart"
        )
    n_vws = len(plan.virtual_workers)
    spec = resolve_source(source, plan.batch_size, meta=source.module is None)
    ds = dataset if dataset is not None else default_dataset(
        source.name, spec.inputs, spec.targets, plan.batch_size
    )  # fmt: skip
    shards_data, test = split_data(ds, n_vws, cfg.test_fraction, run.seed)
    graph = ModelGraph.from_spec(spec)
    shapes = {n: tuple(p.shape) for n, p in spec.module.named_parameters()}
    specs, _ = shard_specs(plan, graph, shapes, D)
    vw_samples = min(len(s) for s in shards_data)
    horizon = wsp_steps(run, nm, 0, vw_samples, plan.batch_size)
    settings = job_settings(source.name, plan.to_json(), nm, D, run.seed, cfg.test_fraction,
                            f"{type(ds).__name__}:{len(ds)}", optimizer, horizon, run.precision)  # type: ignore[arg-type]  # fmt: skip
    manifest = _resume_from(cfg, owner, settings)
    first_wave = manifest.clock if manifest is not None else 0
    if cfg.checkpoint_dir is not None:
        clean(cfg.checkpoint_dir, first_wave if cfg.resume else None)
    if owner is not None and run.out_dir is not None and not cfg.resume:
        plan.save(run.out_dir / "plan.json")  # --resume reuses it
    steps = wsp_steps(run, nm, first_wave, vw_samples, plan.batch_size)
    if steps == 0 and manifest is not None:
        return export_snapshot(manifest, plan, source, run, specs, test, nm, D)
    if steps == 0:
        raise ConfigError("nothing to train: raise --steps or --epochs")
    if cfg.checkpoint_dir is not None and owner is not None and rule != "easgd":
        snaps = SnapshotSpec(cfg.checkpoint_dir, owner.run_id, owner.attempt, snapshot_parts(plan),
                             settings, cfg.checkpoint_every, cfg.keep, cfg.write_fault)  # fmt: skip
        cfg = dataclasses.replace(cfg, snapshots=snaps)
    sync = SyncSpec(rule, plan.sync_params, D, specs, cfg.snapshots, first_wave,
                    cfg.overlap_pulls, run.timeout_s)  # fmt: skip
    with rendezvous_dir() as tmp:
        init_method = f"file://{tmp / 'rendezvous'}"
        stages = _stage_jobs(
            plan, source, optimizer, run, cfg, sync, shards_data, steps, init_method
        )
        world = len(specs) + len(stages)
        shards = [
            ShardJob(
                k,
                s,
                plan.shards[k].node,
                source,
                plan.batch_size,
                run.seed,
                sync,
                cfg.resume,
                init_method,
                world,
                cfg.shard_fault,
                _peers(s, specs, cfg),
            )
            for k, s in enumerate(specs)
        ]
        stages = [dataclasses.replace(j, world_size=world) for j in stages]
        log.info("%d VWs x %s stages, %d shards, Nm %d, D %d, %d minibatches per VW",
                 n_vws, [len(v.stages) for v in plan.virtual_workers], len(shards), nm, D, steps)  # fmt: skip
        stage_results, states, lost = _spawn_and_watch(shards, stages, run, cfg, plan.batch_size)
    warn_overruns(stage_results)
    result = WSPResult.build(plan, nm, D, stage_results, states, specs, time.time() - t_start)
    if lost:
        gone = LostVW.from_shards(lost, [s for s, _ in states], first_wave + steps // nm)
        result = dataclasses.replace(result, lost=gone)
    ran = {st.steps for st in stage_results}
    if run.time_limit_s > 0 and ran and max(ran) < steps:
        note = f"time limit {run.time_limit_s:g} s: every VW stopped after wave {first_wave + max(ran) // nm}"
        result = dataclasses.replace(result, stopped_by=note)
    accuracy = evaluate(source, plan.batch_size, run.seed, result.state_dict(), test)
    result = dataclasses.replace(result, test_accuracy=accuracy[0], test_loss=accuracy[1])
    if run.out_dir is not None:
        result.save(run.out_dir, about=describe_run(plan))
    return result


def _stage_jobs(
    plan: Plan,
    source: ModelSource,
    optimizer: OptimizerConfig,
    run: RunConfig,
    cfg: WSPConfig,
    sync: SyncSpec,
    data: list[Subset[Any]],
    steps: int,
    init_method: str,
) -> list[StageJob]:
    """Every stage's job, VW by VW after the shards' ranks (``world_size`` set by the caller)."""
    jobs: list[StageJob] = []
    for k in range(len(plan.virtual_workers)):
        ctxs = stage_contexts(plan, k, run.nm or plan.nm, steps, len(plan.shards) + len(jobs))
        vw_run = (
            run if run.out_dir is None else dataclasses.replace(run, out_dir=run.out_dir / f"vw{k}")
        )
        cal = pacing_table(plan, source, ctxs, vw_run)
        jobs += [
            StageJob(
                ctx,
                source,
                optimizer,
                run,
                sync,
                data[k],
                calibration=cal,
                fault=cfg.stage_fault,
                init_method=init_method,
                agree_stop=True,
            )
            for ctx in ctxs
        ]
    return jobs


def _peers(
    spec: ShardSpec, specs: tuple[ShardSpec, ...], cfg: WSPConfig
) -> tuple[tuple[int, int], ...] | None:
    """``--on-failure continue``: (id, rank) of the other shards, which gate each wave."""
    return tuple((s.id, s.rank) for s in specs if s.id != spec.id) if cfg.evict else None


def snapshot_parts(plan: Plan) -> tuple[str, ...]:
    """The parts of one snapshot of ``plan``'s job: every shard's and every stage's."""
    parts = [f"shard-{k}" for k in range(len(plan.shards))]
    parts += [f"vw{k}-stage{s}" for k, vw in enumerate(plan.virtual_workers) for s in range(len(vw.stages))]  # fmt: skip
    return tuple(parts)


def _resume_from(
    cfg: WSPConfig, owner: RunDirectory | None, settings: tuple[tuple[str, str], ...]
) -> Manifest | None:
    """The snapshot a resume starts from (verified, of this run, with the same settings)."""
    if not cfg.resume or cfg.checkpoint_dir is None:
        return None
    manifest, skipped = select(cfg.checkpoint_dir, cfg.resume_clock)
    for s in skipped:
        log.warning("resume: skipped %s; using clock %d", s, manifest.clock)
    where = f"--resume {manifest.path}"
    if owner is not None:
        if owner.run_id and owner.run_id != manifest.run_id:
            raise ConfigError(
                f"{where}: the snapshot belongs to run {manifest.run_id}, the directory to run "
                f"{owner.run_id}; resume from that run's own directory"
            )
        owner.write_run_file(manifest.run_id)
    check_settings(where, manifest.settings, settings)
    return manifest


def wsp_steps(run: RunConfig, nm: int, first_wave: int, vw_samples: int, batch_size: int) -> int:
    """Minibatches each VW trains in this run: whole waves, after the resumed ones (0: the
    snapshot already holds every wave asked for).

    Raises:
        ConfigError: less than one minibatch per VW.
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
    return max(0, steps - first_wave * nm)


def _spawn_and_watch(
    shards: list[ShardJob],
    stages: list[StageJob],
    run: RunConfig,
    cfg: WSPConfig,
    batch_size: int,
) -> tuple[list[StageResult], list[tuple[ShardState, list[ClockEvent]]], dict[int, str]]:
    """Start every process and watch them; returns the stage results, the shard states and
    the VWs lost (``--on-failure continue``: VW -> cause)."""
    mpc = process_context()
    mpc.set_forkserver_preload([*PRELOAD, "runtime.launch.wsp", "runtime.launch.procs"])
    events = mpc.Queue()
    procs: dict[int, Any] = {}
    n_vws = 1 + max(j.ctx.vw for j in stages)
    progress = ProgressBar(run.progress, stages[0].ctx.total_steps * n_vws, batch_size)
    try:
        for sh in shards:
            procs[sh.rank] = mpc.Process(
                target=shard_main, args=(sh, events, os.getpid()), name=f"hetpipe-shard{sh.spec.id}"
            )
            procs[sh.rank].start()
        for job in stages:
            ctx = job.ctx
            procs[ctx.rank] = mpc.Process(target=stage_main, args=(job, events, os.getpid()),
                                          name=f"hetpipe-vw{ctx.vw}-stage{ctx.stage}")  # fmt: skip
            procs[ctx.rank].start()
        labels = {s.rank: s.where for s in shards} | {j.ctx.rank: j.ctx.where for j in stages}
        init_method = stages[0].init_method
        beats = Heartbeats(Path(init_method.removeprefix("file://")).parent,
                           max(5.0, run.timeout_s / 2), labels)  # fmt: skip
        evictor = None
        if cfg.evict:
            vw_ranks: dict[int, tuple[int, ...]] = {}
            for j in stages:
                vw_ranks[j.ctx.vw] = (*vw_ranks.get(j.ctx.vw, ()), j.ctx.rank)
            evictor = VWEvictor(vw_ranks, procs, labels)
        results = _watch(labels, procs, events, progress, run, cfg, beats, evictor)
    except KeyboardInterrupt:
        raise Interrupted(f"interrupted (Ctrl-C): every process stopped{_hint(cfg)}") from None
    finally:
        progress.stop()
        stop_all(procs)
    stage_results = [r for r in results if isinstance(r, StageResult)]
    states = [r for r in results if not isinstance(r, StageResult)]
    return stage_results, states, dict(evictor.lost) if evictor is not None else {}


def _hint(cfg: WSPConfig) -> str:
    """``; resume with: ...`` when the run has snapshots, else nothing."""
    if cfg.snapshots is None or cfg.checkpoint_every <= 0:
        return ""
    return f"; resume with: {cfg.resume_hint} --resume {cfg.checkpoint_dir}"


def _watch(
    labels: dict[int, str],
    procs: dict[int, Any],
    events: Any,
    progress: ProgressBar,
    run: RunConfig,
    cfg: WSPConfig,
    beats: Heartbeats,
    evictor: VWEvictor | None = None,
) -> list[Any]:
    """Every process's result, in rank order."""

    def fail(errors: dict[int, str], done: dict[int, bytes]) -> HetPipeRuntimeError:
        frozen = beats.frozen()  # a frozen rank is the cause of its peers' timeouts
        rank = min(frozen) if frozen else root_cause_rank(procs, events, errors, done, grace_s=1.5)
        why = frozen.get(rank) or errors[rank]
        return HetPipeRuntimeError(f"rank {rank} ({labels[rank]}) failed: {why}{_hint(cfg)}")

    stall_s = max(120.0, 4 * run.timeout_s)
    results = watch(procs, events, len(labels), progress.event, fail, stall_s,
                    frozen=beats.frozen, absorb=evictor)  # fmt: skip
    return [loads_result(results[r]) for r in sorted(results)]
