"""The AllReduce baseline: plain data parallelism with ``DistributedDataParallel`` (BSP).

The paper's Horovod comparison (Sec. 8), measured rather than simulated. It executes a plan
whose ``sync`` is ``allreduce`` (:func:`planner.baseline.allreduce_plan`: one single-stage
virtual worker per device that holds the whole model): one process per device, every process
the whole model wrapped in :class:`torch.nn.parallel.DistributedDataParallel` (gloo on CPU,
NCCL on CUDA devices), and an AllReduce of the gradients after every minibatch. It takes the
same run options as the pipelines (:class:`runtime.config.RunConfig`,
:class:`runtime.config.OptimizerConfig`: steps or epochs, a time limit, seed, schedule, out
dir, timeout, emulation, progress).

Data: minibatch ``p`` of the run is the global minibatch ``p`` of
:class:`runtime.data.MinibatchSource` with ``world * batch_size`` samples; rank ``r`` trains on
its slice ``[r*B, (r+1)*B)``, so the ranks' shards are disjoint within every epoch (like
``DistributedSampler``) and the run equals single-process SGD on the combined minibatch.

Emulated devices are paced like the pipeline's stages (:mod:`runtime.stage.emulation`): a step's
forward and backward (the AllReduce and the optimizer step included) last at least the plan's
stage time of that device (the planner's profile of the whole model), so the slowest device
sets the BSP step time. A time limit stops every rank after the same step: each step's loss
AllReduce also carries a "time is up" flag.

Throughput uses the runtime's and simulator's definition
(:func:`planner.sim.engine.measured_throughput`), each rank counted as a virtual worker with
``Nm = 1``.
"""

from __future__ import annotations

import io
import logging
import os
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.utils.data import Dataset

from planner.plan import Plan
from planner.straggle import NO_STRAGGLE, Straggle
from profiler.errors import ConfigError
from runtime.config import ModelSource, OptimizerConfig, RunConfig
from runtime.data import MinibatchSource, default_dataset
from runtime.launch.failures import run_rank, setup_child, stop_all
from runtime.launch.single import PRELOAD, process_context, stage_contexts, total_steps
from runtime.results.evaluation import accuracy, split_dataset
from runtime.results.metrics import ProgressBar
from runtime.stage.emulation import MemoryMeter, SavedBytes, pace_until
from runtime.stage.model import reference_module, resolve_source
from runtime.stage.weights import build_optimizer, lr_at
from runtime.sync.allreduce_watch import watch_ranks

__all__ = ["DDPResult", "StepHook", "run_allreduce"]

log = logging.getLogger(__name__)

StepHook = Callable[[int, int], None]
"""A test hook called by every rank as ``hook(rank, step)`` before each step (e.g. to kill
the rank); it must be picklable (a module-level function or a ``functools.partial``)."""


@dataclass(frozen=True)
class DDPResult:
    """A finished AllReduce run.

    Attributes:
        devices: labels of the devices used, one rank each (``R:0``).
        batch_size: samples per minibatch per rank (global minibatch = ranks x this).
        steps: minibatches trained (per rank).
        losses: loss of the combined minibatch at every step (mean over ranks).
        completions_ms: per rank, end time of every step (ms since the common start).
        throughput: samples/s over all ranks (``measured_throughput`` with ``Nm = 1``).
        predicted: the plan's predicted samples/s.
        test_accuracy: top-1 accuracy of the final model on the test set (fraction).
        memory_bytes: the planner's estimate of the whole model on one device.
        wall_s: wall time of the run including process start-up (s).
        stopped_by: ``steps`` or ``time limit``.
        state: final parameters by their original names.
    """

    devices: tuple[str, ...]
    batch_size: int
    steps: int
    losses: tuple[float, ...]
    completions_ms: tuple[tuple[float, ...], ...]
    throughput: float
    predicted: float
    test_accuracy: float
    memory_bytes: int
    wall_s: float
    stopped_by: str = "steps"
    state: dict[str, Tensor] = field(default_factory=dict, repr=False)

    def table(self) -> Any:
        """The run's summary as a rich table (what ``hetpipe run --sync allreduce`` prints)."""
        from rich.table import Table

        t = Table(title=f"AllReduce (DDP, BSP) on {len(self.devices)} devices")
        for col in ("devices", "steps", "samples/s", "predicted", "test accuracy", "last loss"):
            t.add_column(col, justify="left" if col == "devices" else "right")
        t.add_row(
            " ".join(self.devices),
            f"{self.steps} ({self.stopped_by})",
            f"{self.throughput:.1f}",
            f"{self.predicted:.1f}" if self.predicted > 0 else "-",
            f"{self.test_accuracy:.2%}",
            f"{self.losses[-1]:.4f}" if self.losses else "-",
        )
        t.caption = (
            f"global minibatch {len(self.devices)} x {self.batch_size}; whole model "
            f"{self.memory_bytes / 2**20:.2f} MiB per device; wall {self.wall_s:.1f} s"
        )
        return t


# ------------------------------------------------------------------------------ one rank


@dataclass(frozen=True)
class _RankJob:
    """Everything one DDP rank needs (a frozen job description; nothing is patched later)."""

    rank: int
    world: int
    device: str
    pace_s: float  # the plan's step time on this emulated device (0 = not paced)
    cap_bytes: int  # 0 = no cap
    source: ModelSource
    batch_size: int
    steps: int
    seed: int
    optimizer: OptimizerConfig
    run: RunConfig
    init_method: str
    hook: StepHook | None = None
    straggle: Straggle = NO_STRAGGLE  # emulated stragglers: step p takes slowdown(rank, p-1) x


def _rank_main(job: _RankJob, train: Dataset[Any], events: Any, parent: int) -> None:
    """Entry point of one DDP rank."""
    setup_child(f"ddp | rank {job.rank} | {job.device}", parent, logging.INFO)
    cuda = torch.cuda.is_available() and job.pace_s == 0 and job.cap_bytes == 0

    def body() -> tuple[str, bytes]:
        buf = io.BytesIO()
        torch.save(_train_rank(job, train, events, cuda), buf)
        return "result", buf.getvalue()

    run_rank(
        job.rank, events, job.init_method, job.world, job.run.timeout_s, body,
        backend="nccl" if cuda else "gloo",
    )  # fmt: skip


def _train_rank(job: _RankJob, train: Dataset[Any], events: Any, cuda: bool) -> dict[str, Any]:
    device = torch.device(f"cuda:{job.rank % torch.cuda.device_count()}" if cuda else "cpu")
    module, _, loss_fn = reference_module(job.source, job.batch_size, job.seed)
    module.to(device)
    ddp = nn.parallel.DistributedDataParallel(module, device_ids=[device] if cuda else None)
    params = [p for p in ddp.parameters() if p.requires_grad]
    opt = build_optimizer(params, job.optimizer)
    param_bytes = sum(p.numel() * p.element_size() for p in params)
    buffer_bytes = sum(b.numel() * b.element_size() for b in module.buffers())
    factor = 2.0 if job.optimizer.name == "adam" else (1.0 if job.optimizer.momentum else 0.0)
    where = f"ddp | rank {job.rank} | device {job.device}"
    meter = MemoryMeter(where, job.cap_bytes, param_bytes, buffer_bytes, factor)
    src = MinibatchSource(train, job.batch_size * job.world, job.seed)
    lo, hi = job.rank * job.batch_size, (job.rank + 1) * job.batch_size
    limit = job.run.time_limit_s
    losses: list[float] = []
    done: list[float] = []
    stopped_by = "steps"
    dist.barrier()
    start = time.time()
    for p in range(1, job.steps + 1):
        if job.hook is not None:
            job.hook(job.rank, p)
        t0 = time.perf_counter()
        xs, y = src.batch(p)
        xs = tuple(x[lo:hi].to(device) for x in xs)  # (B, ...) this rank's shard
        y = y[lo:hi].to(device)
        opt.zero_grad(set_to_none=True)
        with SavedBytes(exclude=params) as saved:
            loss = loss_fn(ddp(*xs), y)
        if job.cap_bytes:
            meter.check(p, saved.nbytes + sum(x.numel() * x.element_size() for x in xs), 0)
        loss.backward()  # type: ignore[no-untyped-call]  # DDP all-reduces (averages) grads
        for g in opt.param_groups:
            g["lr"] = lr_at(job.optimizer, p - 1, job.steps)
        opt.step()  # device work: inside the paced window, as in the pipeline's stages
        if job.pace_s:  # a straggling step (planner.straggle; a DDP "wave" is one step)
            pace_until(t0 + job.pace_s * job.straggle.slowdown(job.rank, p - 1))
        meter.release(p)
        # (2,): loss, "my time is up" -- one AllReduce, so every rank stops after the same step
        up = 1.0 if limit > 0 and time.time() - start >= limit else 0.0
        stats = torch.tensor([float(loss.detach()), up], dtype=torch.float64)
        dist.all_reduce(stats)
        losses.append(float(stats[0]) / job.world)
        done.append(time.time())
        if job.rank == 0:
            events.put(("loss", job.rank, p, losses[-1]))
            events.put(("done", job.rank, p, done[-1]))
        if stats[1] > 0:
            stopped_by = "time limit"
            break
    state = {n: t.detach().cpu().clone() for n, t in module.named_parameters()}
    return {
        "start": start,
        "done": done,
        "losses": losses,
        "state": state if job.rank == 0 else {},
        "peak_bytes": meter.peak_bytes,
        "stopped_by": stopped_by,
    }


# ------------------------------------------------------------------------------ launcher


def _data(
    source: ModelSource,
    batch_size: int,
    dataset: Dataset[Any] | None,
    test_dataset: Dataset[Any] | None,
    test_fraction: float,
    seed: int,
) -> tuple[Dataset[Any], Dataset[Any]]:
    if dataset is None:
        spec = resolve_source(source, batch_size, meta=True)
        dataset = default_dataset(source.name, spec.inputs, spec.targets, batch_size)
    if test_dataset is not None:
        return dataset, test_dataset
    return split_dataset(dataset, test_fraction, seed)


def run_allreduce(
    plan: Plan,
    *,
    source: ModelSource | None = None,
    optimizer: OptimizerConfig | None = None,
    run: RunConfig | None = None,
    dataset: Dataset[Any] | None = None,
    test_dataset: Dataset[Any] | None = None,
    test_fraction: float = 0.2,
    hook: StepHook | None = None,
) -> DDPResult:
    """Train an AllReduce plan (:func:`planner.baseline.allreduce_plan`) with DDP.

    Args:
        plan: a plan with ``sync == "allreduce"``: one single-stage VW per device.
        source: the model (default: the plan's model reference).
        optimizer: optimizer and schedule (default SGD, lr 0.05).
        run: run length, seed, time limit, out dir, timeout, emulation, progress
            (``steps`` counts global minibatches of ``world x batch`` samples).
        dataset: training items; ``None`` = the built-in default.
        test_dataset: held-out items; ``None`` = a seeded ``test_fraction`` split of ``dataset``.
        test_fraction: share held out when ``test_dataset`` is ``None``.
        hook: tests only: called as ``hook(rank, step)`` in every rank before each step.

    Returns:
        The :class:`DDPResult`.

    Raises:
        ConfigError: not an AllReduce plan, or too little data.
        HetPipeRuntimeError: a rank failed or died (the message names it).
    """
    if plan.sync != "allreduce":
        raise ConfigError(
            f"the {plan.model} plan synchronises by {plan.sync!r}, not AllReduce; make one with "
            "planner.baseline.allreduce_plan (hetpipe run --sync allreduce does)"
        )
    t_start = time.time()
    run = run or RunConfig()
    opt = optimizer or OptimizerConfig()
    source = source or ModelSource(ref=plan.model)
    batch, world = plan.batch_size, len(plan.virtual_workers)
    train, test = _data(source, batch, dataset, test_dataset, test_fraction, run.seed)
    per_epoch = len(train) // (batch * world)  # type: ignore[arg-type]
    if per_epoch < 1:
        raise ConfigError(
            f"the training split has {len(train)} samples, fewer than one global minibatch of "  # type: ignore[arg-type]
            f"{world} x {batch}; use a smaller --batch-size or more data"
        )
    steps = total_steps(run, per_epoch)
    with tempfile.TemporaryDirectory(prefix="hetpipe-ddp-") as tmp:
        jobs = _jobs(plan, source, opt, run, steps, f"file://{Path(tmp) / 'rendezvous'}", hook)
        log.info("AllReduce on %d devices (%s)", world, " ".join(j.device for j in jobs))
        results = _spawn_and_watch(jobs, train, run, batch * world)
    need = max(vw.stages[0].memory_bytes for vw in plan.virtual_workers)
    result = _assemble(jobs, results, test, need, plan.predicted.throughput, time.time() - t_start)
    if run.out_dir is not None:
        _write(result, run.out_dir)
    return result


def _jobs(
    plan: Plan,
    source: ModelSource,
    opt: OptimizerConfig,
    run: RunConfig,
    steps: int,
    init_method: str,
    hook: StepHook | None,
) -> list[_RankJob]:
    """One frozen job per device: its role from the plan
    (:func:`runtime.launch.single.stage_contexts`), the rendezvous and the test hook."""
    jobs = []
    for k, vw in enumerate(plan.virtual_workers):
        (ctx,) = stage_contexts(plan, k, 1, steps, first_rank=k)
        st = vw.stages[0]
        paced = run.emulate and ctx.speed > 0
        jobs.append(
            _RankJob(
                rank=k,
                world=len(plan.virtual_workers),
                device=ctx.device,
                pace_s=(st.fwd_ms + st.bwd_ms) / 1e3 if paced else 0.0,
                cap_bytes=ctx.cap_bytes if run.emulate else 0,
                source=source,
                batch_size=plan.batch_size,
                steps=steps,
                seed=run.seed,
                optimizer=opt,
                run=run,
                init_method=init_method,
                hook=hook,
                straggle=ctx.straggle,
            )
        )
    return jobs


def _assemble(
    jobs: Sequence[_RankJob],
    results: list[dict[str, Any]],
    test: Dataset[Any],
    need: int,
    predicted: float,
    wall_s: float,
) -> DDPResult:
    from planner.sim.engine import measured_throughput

    j0 = jobs[0]
    steps = len(results[0]["done"])
    origin = min(float(r["start"]) for r in results)
    completions = tuple(tuple((t - origin) * 1e3 for t in r["done"]) for r in results)
    if steps >= 2:
        throughput = measured_throughput(completions, 1, j0.batch_size)
    else:
        span_s = max(c[-1] for c in completions) / 1e3
        throughput = len(jobs) * steps * j0.batch_size / span_s if span_s > 0 else 0.0
    module, names, _ = reference_module(j0.source, j0.batch_size, j0.seed)
    module.load_state_dict(results[0]["state"], strict=False)
    acc = accuracy(module.eval(), test, j0.batch_size)
    return DDPResult(
        devices=tuple(j.device for j in jobs),
        batch_size=j0.batch_size,
        steps=steps,
        losses=tuple(float(x) for x in results[0]["losses"]),
        completions_ms=completions,
        throughput=throughput,
        predicted=predicted,
        test_accuracy=acc,
        memory_bytes=need,
        wall_s=wall_s,
        stopped_by=str(results[0]["stopped_by"]),
        state={names[n]: t for n, t in results[0]["state"].items()},
    )


def _write(result: DDPResult, out: Path) -> None:
    import json

    from profiler.files import atomic_write_bytes, atomic_write_text

    out.mkdir(parents=True, exist_ok=True)
    figures = {
        "sync": "allreduce",
        "devices": list(result.devices),
        "batch_size": result.batch_size,
        "steps": result.steps,
        "stopped_by": result.stopped_by,
        "throughput": result.throughput,
        "predicted": result.predicted,
        "test_accuracy": result.test_accuracy,
        "memory_bytes": result.memory_bytes,
        "wall_s": result.wall_s,
        "final_loss": result.losses[-1] if result.losses else None,
    }
    atomic_write_text(out / "ddp.json", json.dumps(figures, indent=2))
    buf = io.BytesIO()
    torch.save(result.state, buf)
    atomic_write_bytes(out / "weights.pt", buf.getvalue())


def _spawn_and_watch(
    jobs: Sequence[_RankJob], train: Dataset[Any], run: RunConfig, samples_per_step: int
) -> list[dict[str, Any]]:
    mpc = process_context()
    mpc.set_forkserver_preload([*PRELOAD, "runtime.launch.ddp"])
    events = mpc.Queue()
    procs: dict[int, Any] = {}
    progress = ProgressBar(run.progress, jobs[0].steps, samples_per_step)
    try:
        for job in jobs:
            p = mpc.Process(
                target=_rank_main,
                args=(job, train, events, os.getpid()),
                name=f"hetpipe-ddp-rank{job.rank}",
            )
            p.start()
            procs[job.rank] = p
        stall_s = max(60.0, 4 * run.timeout_s)
        return watch_ranks([j.device for j in jobs], procs, events, stall_s, progress.event)
    finally:
        progress.stop()
        stop_all(procs)
