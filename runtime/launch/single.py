"""Start one process per GPU of a virtual worker on this host, watch them, collect results.

Every process learns its role (VW, stage, device, neighbours) from the plan. The launcher
watches its children: the first one that raises or dies ends the whole run: the others are
terminated (then killed), no process is left behind, and a :class:`HetPipeRuntimeError`
names the rank, VW, stage and the error, within seconds. Each child also exits on its own
when the launcher disappears, and every process-group operation has a timeout.
"""

from __future__ import annotations

import logging
import math
import multiprocessing as mp
import os
import time
from pathlib import Path
from typing import Any

import torch

from planner.plan import Plan
from planner.straggle import NO_STRAGGLE, Straggle
from profiler.errors import ConfigError, HetPipeRuntimeError
from runtime.config import ModelSource, OptimizerConfig, RunConfig
from runtime.data import default_dataset
from runtime.launch.failures import (
    Heartbeats,
    Interrupted,
    StageFault,
    rendezvous_dir,
    root_cause_rank,
    stop_all,
    watch,
)
from runtime.launch.procs import loads_result, stage_main
from runtime.persist.checkpoint import atomic_torch_save
from runtime.persist.run_dir import RunDirectory
from runtime.results.metrics import (
    ProgressBar,
    RunResult,
    StageResult,
    warn_overruns,
    write_metrics,
)
from runtime.results.timeline import describe_run, write_timeline
from runtime.stage.emulation import Calibration, calibrate
from runtime.stage.job import StageContext, StageJob
from runtime.stage.model import resolve_source, sample_batch
from runtime.sync.rule import SyncSpec

__all__ = [
    "PRELOAD",
    "launch",
    "pacing_table",
    "process_context",
    "stage_contexts",
    "total_steps",
]

log = logging.getLogger(__name__)

PRELOAD = [  # imported once by the fork server (the slow, lazily imported parts of a stage's start)
    "torch",
    "torch.distributed",
    "torch.func",
    "torch._dynamo",
    "torch._refs",
    "torch._decomp",
    "torch._subclasses.fake_tensor",
    "torch.fx.passes.shape_prop",
    "torch.fx.passes.split_module",
    "sympy",
    "sklearn.datasets",
    "runtime.stage.worker",
    "runtime.launch.single",
]


def stage_contexts(
    plan: Plan, vw: int, nm: int, steps: int, first_rank: int = 0
) -> list[StageContext]:
    """The role of every process of virtual worker ``vw`` (global ranks from ``first_rank``).

    Raises:
        ConfigError: no such virtual worker.
    """
    if not 0 <= vw < len(plan.virtual_workers):
        raise ConfigError(
            f"the plan has {len(plan.virtual_workers)} virtual workers; --vw {vw} does not exist"
        )
    worker = plan.virtual_workers[vw]
    require_devices(plan, vw)
    cuts = tuple(st.first_index for st in worker.stages[1:])
    n = len(worker.stages)
    out = []
    for s, st in enumerate(worker.stages):
        gpu = worker.gpus[st.gpu]
        speed, cap = _emulation(plan, gpu.node, gpu.speed, gpu.memory_bytes)
        out.append(
            StageContext(
                rank=first_rank + s,
                vw=vw,
                stage=s,
                n_stages=n,
                nm=nm,
                cuts=cuts,
                batch_size=plan.batch_size,
                device=f"{gpu.node}:{gpu.index}",
                speed=speed,
                cap_bytes=cap,
                optimizer_state_factor=plan.optimizer_state_factor,
                prev_rank=first_rank + s - 1 if s > 0 else None,
                next_rank=first_rank + s + 1 if s < n - 1 else None,
                total_steps=steps,
                memory=st.memory,
                host_cap_bytes=plan.cluster.host_memory_bytes(gpu.node),
                straggle=_straggle(plan, gpu.node) if speed > 0 else NO_STRAGGLE,
            )
        )
    return out


def require_devices(plan: Plan, vw: int, cuda_devices: int | None = None) -> None:
    """Refuse at once a VW that needs real GPUs on a host that has none.

    A device needs CUDA unless it is emulated (``emulate:`` in the cluster) or of type ``CPU``.

    Raises:
        ConfigError: the VW has real GPUs and this host has no CUDA device (names them).
    """
    have = torch.cuda.device_count() if cuda_devices is None else cuda_devices
    worker = plan.virtual_workers[vw]
    real = [
        g
        for g in worker.gpus
        if _emulation(plan, g.node, g.speed, g.memory_bytes)[0] == 0 and g.type.upper() != "CPU"
    ]
    if real and have == 0:
        names = ", ".join(f"{g.node}:{g.index} ({g.type})" for g in real[:4])
        more = f" and {len(real) - 4} more" if len(real) > 4 else ""
        raise ConfigError(
            f"VW {vw} of the {plan.model} plan runs on real GPUs ({names}{more}) but this host "
            "has no CUDA device; run it on the GPU hosts (torchrun, see docs/wsp_runtime.md), or "
            "plan for an emulated cluster (add 'emulate: {speed: 0.2, memory: 8MiB}' to its nodes)"
        )


def _straggle(plan: Plan, node: str) -> Straggle:
    """The straggler model of an emulated node (``emulate: {straggle: ...}``), else none."""
    try:
        emu = plan.cluster.node(node).emulation
    except ConfigError:
        emu = None
    return emu.straggle if emu is not None else NO_STRAGGLE


def _emulation(plan: Plan, node: str, speed: float, memory_bytes: int) -> tuple[float, int]:
    """Speed and memory cap of an emulated device: the cluster's ``emulate:`` entry (the
    source of truth), else the plan's GPU slot; ``(0, 0)`` for a real GPU."""
    try:
        emu = plan.cluster.node(node).emulation
    except ConfigError:
        emu = None
    if emu is not None:
        return emu.speed, emu.memory_bytes
    return (speed, memory_bytes) if speed > 0 else (0.0, 0)


def total_steps(run: RunConfig, steps_per_epoch: int) -> int:
    """Minibatches to train: ``--steps``, else ``--epochs`` worth, else unbounded under a time limit, else one epoch."""
    if run.steps > 0:
        return run.steps
    if run.epochs > 0:
        return max(1, math.ceil(run.epochs * steps_per_epoch))
    if run.time_limit_s > 0:
        return 2**62
    return steps_per_epoch


def pacing_table(
    plan: Plan, source: ModelSource, contexts: list[StageContext], run: RunConfig
) -> Calibration | None:
    """The pacing table of one VW's emulated devices: the plan's stage times (the planner's CPU
    profile over each stage's layers / speed), written to ``calibration.json`` in the run
    directory (``python -m runtime --calibration`` reads it on other hosts)."""
    if not run.emulate or not any(c.speed > 0 for c in contexts):
        return None
    worker = plan.virtual_workers[contexts[0].vw]
    cuts = contexts[0].cuts
    if any(st.fwd_ms + st.bwd_ms > 0 for st in worker.stages):  # a stage may be ~0 ms
        key = f"{source.name}|batch={plan.batch_size}|cuts={list(cuts)}|plan"
        cal = Calibration.from_plan(
            key, [(st.fwd_ms, st.bwd_ms) for st in worker.stages], [c.speed for c in contexts]
        )
    else:  # a hand-made plan without any stage times: measure them here
        from profiler.graph import ModelGraph

        log.info(
            "the plan has no stage times: calibrating %d stages (single thread)", len(contexts)
        )
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(run.seed)
            spec = resolve_source(source, plan.batch_size, meta=False)
        loss = source.loss if source.loss is not None else spec.loss
        inputs, targets = sample_batch(spec)
        key = f"{source.name}|batch={plan.batch_size}|cuts={list(cuts)}|measured"
        stages = ModelGraph.from_spec(spec).build_stages(cuts)
        cal = calibrate(stages, inputs, targets, loss, key)
    if run.out_dir is not None:
        cal.save(run.out_dir / "calibration.json")
    return cal


def launch(
    plan: Plan,
    source: ModelSource,
    optimizer: OptimizerConfig | None = None,
    run: RunConfig | None = None,
    dataset: Any = None,
    vw: int = 0,
    fault: StageFault | None = None,
    overwrite: bool = False,
) -> RunResult:
    """Train virtual worker ``vw`` of ``plan`` with one process per stage on this host.

    Args:
        plan: the plan (its first VW by default).
        source: the model.
        optimizer: optimizer settings (SGD lr 0.05 by default).
        run: run settings.
        dataset: the user's data set (``None`` = built-in default).
        vw: which virtual worker to run.
        fault: test hook: a stage that fails (:class:`StageFault`).
        overwrite: ``run.out_dir`` may hold another run's outputs, replaced (else refused).

    Raises:
        ConfigError: ``run.out_dir`` holds another run (or one still running).
        HetPipeRuntimeError: a rank failed or died (the message names it).
    """
    run = run or RunConfig()
    if run.out_dir is None:
        return _launch(plan, source, optimizer, run, dataset, vw, fault)
    with RunDirectory(run.out_dir, resume=False, overwrite=overwrite):  # one run per directory
        return _launch(plan, source, optimizer, run, dataset, vw, fault)


def _launch(
    plan: Plan,
    source: ModelSource,
    optimizer: OptimizerConfig | None,
    run: RunConfig,
    dataset: Any,
    vw: int,
    fault: StageFault | None,
) -> RunResult:
    optimizer = optimizer or OptimizerConfig()
    t_start = time.time()
    nm = run.nm or plan.nm
    spec = resolve_source(source, plan.batch_size, meta=source.module is None)
    # dataset None: each stage builds the built-in default itself
    ds = (
        dataset
        if dataset is not None
        else default_dataset(source.name, spec.inputs, spec.targets, plan.batch_size)
    )
    ds_len = len(ds)  # type: ignore[arg-type]
    if ds_len < plan.batch_size:
        raise ConfigError(
            f"the data set has {ds_len} samples, fewer than one minibatch of {plan.batch_size}"
        )
    steps = total_steps(run, ds_len // plan.batch_size)
    contexts = stage_contexts(plan, vw, nm, steps)
    if run.out_dir is not None:
        run.out_dir.mkdir(parents=True, exist_ok=True)
    calibration = pacing_table(plan, source, contexts, run)
    predicted = plan.virtual_workers[vw].throughput
    with rendezvous_dir() as tmp:
        init_method = f"file://{tmp / 'rendezvous'}"
        jobs = [
            StageJob(
                ctx,
                source,
                optimizer,
                run,
                SyncSpec("local", timeout_s=run.timeout_s),
                dataset,
                calibration=calibration,
                fault=fault,
                init_method=init_method,
                world_size=len(contexts),
            )
            for ctx in contexts
        ]
        results = _spawn_and_watch(jobs, run, steps)
    warn_overruns(results)
    bound = 0.0
    if calibration is not None:
        slowest = max(calibration.task_s(c.stage, "FB") / c.speed for c in contexts)
        bound = plan.batch_size / slowest
    result = RunResult(tuple(results), plan.batch_size, nm, predicted, time.time() - t_start, bound)
    if run.out_dir is not None:
        write_metrics(result, run.out_dir)
        write_timeline(result.stages, run.out_dir, about=describe_run(plan, vw))
        atomic_torch_save(result.state_dict(), run.out_dir / "weights.pt")
    return result


def process_context() -> Any:
    """``forkserver`` with torch and the runtime preloaded: children start in well under a second
    (a fresh interpreter importing torch takes seconds); ``spawn`` where forkserver is missing."""
    try:
        ctx = mp.get_context("forkserver")
    except ValueError:
        return mp.get_context("spawn")
    ctx.set_forkserver_preload(PRELOAD)
    return ctx


def _spawn_and_watch(jobs: list[StageJob], run: RunConfig, steps: int) -> list[StageResult]:
    mpc = process_context()
    events = mpc.Queue()
    procs: dict[int, Any] = {}
    progress = ProgressBar(run.progress, steps, jobs[0].ctx.batch_size)
    contexts = [j.ctx for j in jobs]
    try:
        for job in jobs:
            p = mpc.Process(target=stage_main, args=(job, events, os.getpid()),
                            name=f"hetpipe-vw{job.ctx.vw}-stage{job.ctx.stage}")  # fmt: skip
            p.start()
            procs[job.ctx.rank] = p
        init_method = jobs[0].init_method
        beats = Heartbeats(Path(init_method.removeprefix("file://")).parent,
                           max(5.0, run.timeout_s / 2), {c.rank: c.where for c in contexts})  # fmt: skip
        return _watch(contexts, procs, events, progress, max(120.0, 4 * run.timeout_s), beats)
    except KeyboardInterrupt:
        raise Interrupted("interrupted (Ctrl-C): every process stopped") from None
    finally:
        progress.stop()
        stop_all(procs)


def _watch(
    contexts: list[StageContext],
    procs: dict[int, Any],
    events: Any,
    progress: ProgressBar,
    stall_s: float = 120.0,
    beats: Heartbeats | None = None,
) -> list[StageResult]:
    by_rank = {c.rank: c for c in contexts}

    def fail(errors: dict[int, str], done: dict[int, bytes]) -> HetPipeRuntimeError:
        frozen = beats.frozen() if beats is not None else {}
        if frozen:  # a frozen rank is the cause of its neighbours' timeouts
            return _failure(by_rank[min(frozen)], frozen[min(frozen)])
        return _root_cause(by_rank, procs, events, errors, done)

    frozen = beats.frozen if beats is not None else None
    results = watch(procs, events, len(contexts), progress.event, fail, stall_s, frozen=frozen)
    return [loads_result(results[c.rank]) for c in contexts]


def _root_cause(
    by_rank: dict[int, StageContext],
    procs: dict[int, Any],
    events: Any,
    errors: dict[int, str],
    results: dict[int, bytes],
) -> HetPipeRuntimeError:
    """Collect failures for a moment and blame the first cause, not its neighbours' timeouts."""
    rank = root_cause_rank(procs, events, errors, results, grace_s=1.0)
    return _failure(by_rank[rank], errors[rank])


def _failure(ctx: StageContext, message: str) -> HetPipeRuntimeError:
    return HetPipeRuntimeError(
        f"rank {ctx.rank} (vw {ctx.vw}, stage {ctx.stage}, device {ctx.device}) failed: {message}"
    )
