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
import queue
import signal
import sys
import tempfile
import threading
import time
import traceback
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data import Dataset, Subset

from planner.plan import Plan
from profiler.errors import ConfigError, HetPipeRuntimeError
from profiler.graph import ModelGraph
from runtime.checkpoint import ShardState, load_shard_state, resumable_clock, shard_checkpoint_path
from runtime.config import ModelSource, OptimizerConfig, RunConfig
from runtime.data import MinibatchSource, default_dataset
from runtime.emulation import Calibration
from runtime.failures import root_cause_rank, stop_all
from runtime.launcher import (
    _PRELOAD,
    _calibration,
    _dumps,
    _inject_fault,
    _loads,
    _watch_parent,
    stage_contexts,
)
from runtime.metrics import ProgressBar, StageResult
from runtime.model import reference_module, resolve_source
from runtime.ps import ShardCore, ShardServer, ShardSpec
from runtime.ps_client import PSClient
from runtime.ps_core import ClockEvent
from runtime.ps_layout import shard_specs_for_layout
from runtime.stage import StageContext, StageWorker
from runtime.stop import StopAgreement, file_store
from runtime.wave_sync import WaveSync
from runtime.wsp_result import WSPResult, evaluate

__all__ = ["WSPConfig", "launch_wsp", "shard_specs", "split_data"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class WSPConfig:
    """Settings of a multi-VW run.

    Attributes:
        D: clock-distance threshold (``None`` = the plan's).
        test_fraction: share of the data held out for the final test accuracy.
        checkpoint_dir: where shards write checkpoints (``None`` = the run's ``out_dir/checkpoints``
            when ``out_dir`` is set, else none).
        checkpoint_every: checkpoint each time the global clock reaches a multiple of this (0 = never).
        resume: continue from the newest complete checkpoint in ``checkpoint_dir``.
        resume_hint: the command line to print when the run fails (``--resume DIR`` is appended).
        overlap_pulls: stages keep running tasks while a pull is in flight (``False``: the
            stage blocks in the pull at the wave end; a benchmark baseline).
    """

    D: int | None = None
    test_fraction: float = 0.2
    checkpoint_dir: Path | None = None
    checkpoint_every: int = 0
    resume: bool = False
    resume_hint: str = "hetpipe run ..."
    overlap_pulls: bool = True


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


@dataclass(frozen=True)
class _Shard:
    rank: int
    spec: ShardSpec
    node: str

    @property
    def where(self) -> str:
        return f"shard {self.spec.id} | rank {self.rank} | node {self.node}"


@dataclass(frozen=True)
class _ShiftedSource(MinibatchSource):
    """Minibatch ``p`` of a resumed run is minibatch ``offset + p`` of the VW's data."""

    offset: int = 0

    def indices(self, mb: int) -> list[int]:
        return super().indices(mb + self.offset)


def _setup_child(where: str, parent: int) -> None:
    torch.set_num_threads(1)
    logging.basicConfig(
        level=logging.DEBUG if os.environ.get("HETPIPE_DEBUG") else logging.WARNING,
        format=f"%(asctime)s [{where}] %(levelname)s %(message)s",
        force=True,
    )
    threading.Thread(target=_watch_parent, args=(parent,), daemon=True).start()
    # helper threads (gloo receivers) fail noisily once the process group is torn down after
    # the real error was reported: keep their tracebacks out of the user's terminal
    threading.excepthook = _quiet_thread_error


def _quiet_thread_error(args: threading.ExceptHookArgs) -> None:
    name = args.thread.name if args.thread is not None else "?"
    log.debug("thread %s ended with %s: %s", name, args.exc_type.__name__, args.exc_value)


def _shard_fault(fault: str, shard_id: int) -> None:
    """``killshard:ID:SECONDS``: shard ID SIGKILLs itself that long after it starts (tests)."""
    if not fault.startswith("killshard:"):
        return
    _, sid, delay = fault.split(":")
    if int(sid) == shard_id:
        timer = threading.Timer(float(delay), os.kill, (os.getpid(), signal.SIGKILL))
        timer.daemon = True
        timer.start()


def _report(events: Any, rank: int, exc: BaseException) -> None:
    where = traceback.extract_tb(exc.__traceback__)[-1] if exc.__traceback__ else None
    loc = f" ({Path(where.filename).name}:{where.lineno})" if where else ""
    events.put(("error", rank, f"{type(exc).__name__}: {exc}{loc}"))


def _shard_main(
    shard: _Shard,
    source: ModelSource,
    batch_size: int,
    seed: int,
    cfg: WSPConfig,
    resume_clock: int | None,
    timeout_s: float,
    init_method: str,
    world_size: int,
    events: Any,
    parent: int,
    fault: str = "",
) -> None:
    """Entry point of one parameter-server shard process."""
    _setup_child(shard.where, parent)
    _shard_fault(fault, shard.spec.id)
    code = 0
    try:
        dist.init_process_group(
            "gloo", init_method=init_method, rank=shard.rank, world_size=world_size,
            timeout=timedelta(seconds=timeout_s),
        )  # fmt: skip
        try:
            if resume_clock is not None and cfg.checkpoint_dir is not None:
                path = shard_checkpoint_path(cfg.checkpoint_dir, shard.spec.id, resume_clock)
                core = ShardCore(shard.spec, state=load_shard_state(path))
            else:
                module, names, _ = reference_module(source, batch_size, seed)
                init = {names[n]: p.detach() for n, p in module.named_parameters()}
                core = ShardCore(shard.spec, shard.spec.flatten(init))
            server = ShardServer(
                core,
                timeout_s=timeout_s,
                idle_timeout_s=4 * timeout_s,
                checkpoint_dir=cfg.checkpoint_dir if cfg.checkpoint_every > 0 else None,
                checkpoint_every=cfg.checkpoint_every,
            )
            dist.barrier()
            state = server.serve()
            events.put(("shard", shard.rank, _dumps((state, list(core.trace)))))
        finally:
            dist.destroy_process_group()
    except BaseException as exc:  # report anything to the launcher
        _report(events, shard.rank, exc)
        code = 1
    events.close()
    events.join_thread()
    sys.exit(code)


def _stage_main(
    ctx: StageContext,
    source: ModelSource,
    optimizer: OptimizerConfig,
    run: RunConfig,
    dataset: Any,
    calibration: Calibration | None,
    specs: tuple[ShardSpec, ...],
    D: int,
    first_wave: int,
    cfg: WSPConfig,
    init_method: str,
    world_size: int,
    events: Any,
    parent: int,
    fault: str,
) -> None:
    """Entry point of one stage process of a multi-VW run."""
    _setup_child(ctx.where, parent)
    code = 0
    try:
        dist.init_process_group(
            "gloo", init_method=init_method, rank=ctx.rank, world_size=world_size,
            timeout=timedelta(seconds=run.timeout_s),
        )  # fmt: skip
        try:
            worker = StageWorker(ctx, source, optimizer, run, dataset, calibration, events)
            worker.fault = _inject_fault(fault, ctx)
            first_mb = first_wave * ctx.nm
            if worker.data is not None and first_mb:
                d = worker.data
                worker.data = _ShiftedSource(
                    d.dataset, d.batch_size, d.seed, d.target_shape, first_mb
                )
            named = list(worker.module.named_parameters())
            client = PSClient(
                ctx.vw,
                ctx.stage,
                [(worker.names[n], tuple(p.shape)) for n, p in named],
                specs,
                timeout_s=run.timeout_s,
                pull_timeout_s=2 * run.timeout_s,
            )
            sync = WaveSync(
                client,
                [p for _, p in named],
                ctx.nm,
                D,
                worker.result,
                first_mb,
                worker.weights.optimizer,
                cfg.checkpoint_dir,
                cfg.checkpoint_every,
                f"vw{ctx.vw}-stage{ctx.stage}",
                worker.weights if cfg.overlap_pulls else None,
            )
            worker.after_update = sync.after_update
            worker.before_forward = sync.before_forward
            if ctx.stage == 0 and run.time_limit_s > 0:
                store = file_store(init_method.removeprefix("file://") + ".stop")
                worker.stop = StopAgreement(store, ctx.nm, D)
            dist.barrier()
            sync.start(first_wave)
            result = worker.run(time.time())
            sync.close()
            events.put(("result", ctx.rank, _dumps(result)))
        finally:
            dist.destroy_process_group()
    except BaseException as exc:  # report anything (also KeyboardInterrupt) to the launcher
        _report(events, ctx.rank, exc)
        code = 1
    events.close()
    events.join_thread()
    sys.exit(code)


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
    per_epoch = min(len(s) for s in shards_data) // plan.batch_size
    if per_epoch < 1:
        raise ConfigError(
            f"each of {n_vws} VWs gets {min(len(s) for s in shards_data)} samples, fewer than one "
            f"minibatch of {plan.batch_size}: lower --batch-size or use fewer VWs"
        )
    steps = run.steps or (max(1, round(run.epochs * per_epoch)) if run.epochs else per_epoch)
    steps = -(-steps // nm) * nm  # whole waves: every VW pushes the same waves
    graph = ModelGraph.from_spec(spec)
    shapes = {n: tuple(p.shape) for n, p in spec.module.named_parameters()}
    specs, _ = shard_specs(plan, graph, shapes, D)
    resume_clock = _resume_clock(cfg, len(specs))
    first_wave = resume_clock or 0
    steps = max(0, steps - first_wave * nm)
    if steps == 0:
        raise ConfigError(f"the checkpoint is already at wave {first_wave}: nothing left to train")
    shards = [_Shard(k, s, plan.shards[k].node) for k, s in enumerate(specs)]
    contexts: list[StageContext] = []
    calibrations: list[Calibration | None] = []
    for k in range(n_vws):
        ctxs = stage_contexts(plan, k, nm, steps, first_rank=len(shards) + len(contexts))
        vw_run = (
            run if run.out_dir is None else dataclasses.replace(run, out_dir=run.out_dir / f"vw{k}")
        )
        cal = _calibration(plan, source, ctxs, vw_run)
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
            resume_clock, first_wave, init_method, fault, steps * n_vws, plan.batch_size,
        )  # fmt: skip
    result = WSPResult.build(plan, nm, D, stage_results, states, specs, time.time() - t_start)
    accuracy = evaluate(source, plan.batch_size, run.seed, result.state_dict(), test)
    result = dataclasses.replace(result, test_accuracy=accuracy[0], test_loss=accuracy[1])
    if run.out_dir is not None:
        result.save(run.out_dir)
    return result


def _spawn_and_watch(
    shards: list[_Shard],
    contexts: list[StageContext],
    calibrations: list[Calibration | None],
    data: list[Subset[Any]],
    source: ModelSource,
    optimizer: OptimizerConfig,
    run: RunConfig,
    cfg: WSPConfig,
    D: int,
    resume_clock: int | None,
    first_wave: int,
    init_method: str,
    fault: str,
    total: int,
    batch_size: int,
) -> tuple[list[StageResult], list[tuple[ShardState, list[ClockEvent]]]]:
    from runtime.launcher import _context

    mpc = _context()
    mpc.set_forkserver_preload([*_PRELOAD, "runtime.wsp_launcher"])
    events = mpc.Queue()
    procs: dict[int, Any] = {}
    labels = {s.rank: s.where for s in shards} | {c.rank: c.where for c in contexts}
    world = len(shards) + len(contexts)
    specs = tuple(s.spec for s in shards)
    progress = ProgressBar(run.progress, total, batch_size)
    try:
        for sh in shards:
            args = (sh, source, batch_size, run.seed, cfg, resume_clock, run.timeout_s,
                    init_method, world, events, os.getpid(), fault)  # fmt: skip
            procs[sh.rank] = mpc.Process(
                target=_shard_main, args=args, name=f"hetpipe-shard{sh.spec.id}"
            )
            procs[sh.rank].start()
        for ctx, cal in zip(contexts, calibrations, strict=True):
            stage_fault = "" if fault.startswith("killshard:") else fault
            args2 = (ctx, source, optimizer, run, data[ctx.vw], cal, specs, D, first_wave, cfg,
                     init_method, world, events, os.getpid(), stage_fault)  # fmt: skip
            procs[ctx.rank] = mpc.Process(
                target=_stage_main, args=args2, name=f"hetpipe-vw{ctx.vw}-stage{ctx.stage}"
            )
            procs[ctx.rank].start()
        return _watch(labels, procs, events, progress, run, cfg)
    finally:
        progress.stop()
        stop_all(procs)


def _watch(
    labels: dict[int, str],
    procs: dict[int, Any],
    events: Any,
    progress: ProgressBar,
    run: RunConfig,
    cfg: WSPConfig,
) -> tuple[list[StageResult], list[tuple[ShardState, list[ClockEvent]]]]:
    results: dict[int, Any] = {}
    stall_s = max(120.0, 4 * run.timeout_s)
    last_event = 0.0
    while len(results) < len(labels):
        try:
            msg = events.get(timeout=0.2)
        except queue.Empty:
            msg = None
        if msg is not None:
            last_event = time.time()
        elif last_event and time.time() - last_event > stall_s:
            raise HetPipeRuntimeError(
                f"no progress from any process for {stall_s:.0f} s; stopping every rank"
            )
        if msg is not None and msg[0] in ("result", "shard"):
            results[msg[1]] = _loads(msg[2])
        elif msg is not None and msg[0] == "error":
            raise _root_cause(labels, procs, events, {msg[1]: str(msg[2])}, results, cfg)
        elif msg is not None:
            progress.event(msg)
        elif any(p.exitcode not in (None, 0) and r not in results for r, p in procs.items()):
            raise _root_cause(labels, procs, events, {}, results, cfg)
    stages = [results[r] for r in sorted(results) if isinstance(results[r], StageResult)]
    states = [results[r] for r in sorted(results) if not isinstance(results[r], StageResult)]
    return stages, states


def _root_cause(
    labels: dict[int, str],
    procs: dict[int, Any],
    events: Any,
    errors: dict[int, str],
    results: dict[int, Any],
    cfg: WSPConfig,
) -> HetPipeRuntimeError:
    """Collect failures for a moment and blame the first cause, not its peers' consequences."""
    rank = root_cause_rank(procs, events, errors, results, grace_s=1.5)
    hint = ""
    if cfg.checkpoint_dir is not None and cfg.checkpoint_every > 0:
        hint = f"; resume with: {cfg.resume_hint} --resume {cfg.checkpoint_dir}"
    return HetPipeRuntimeError(f"rank {rank} ({labels[rank]}) failed: {errors[rank]}{hint}")
