"""The AllReduce baseline: plain data parallelism with ``DistributedDataParallel`` (BSP).

The paper's Horovod comparison (Sec. 8), measured rather than simulated: one process per
device that can hold the whole model (the planner's memory model,
:meth:`planner.costmodel.CostModel.model_memory_bytes`, against the device memory or the
emulated cap), every process the whole model wrapped in
:class:`torch.nn.parallel.DistributedDataParallel` (gloo on CPU, NCCL on CUDA devices), and
an AllReduce of the gradients after every minibatch.

Data: minibatch ``p`` of the run is the global minibatch ``p`` of
:class:`runtime.data.MinibatchSource` with ``world * batch_size`` samples; rank ``r`` trains on
its slice ``[r*B, (r+1)*B)``, so the ranks' shards are disjoint within every epoch (like
``DistributedSampler``) and the run equals single-process SGD on the combined minibatch.

Emulated devices are paced like the pipeline's stages (:mod:`runtime.emulation`): a step's
forward and backward (the AllReduce included) last at least the solo time of the whole model
in the planner's CPU profile (:func:`planner.baseline.model_solo_s`, the table the pipeline's
stages are paced by) divided by the device's speed, so the slowest device sets the BSP step
time.

Throughput uses the runtime's and simulator's definition
(:func:`planner.sim_engine.measured_throughput`), each rank counted as a virtual worker with
``Nm = 1``.
"""

from __future__ import annotations

import io
import logging
import os
import signal
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import Tensor, nn
from torch.utils.data import Dataset

from planner.baseline import (
    device_capacity_bytes,
    eligible_devices,
    model_memory_bytes,
    model_solo_s,
)
from planner.cluster import Cluster
from profiler.errors import ConfigError
from runtime.config import ModelSource, OptimizerConfig
from runtime.data import MinibatchSource, default_dataset
from runtime.ddp_watch import watch_ranks
from runtime.emulation import (
    Calibration,
    MemoryMeter,
    SavedBytes,
    pace_until,
)
from runtime.evaluation import accuracy, split_dataset
from runtime.failures import setup_child, stop_all
from runtime.model import reference_module, resolve_source
from runtime.weights import build_optimizer, lr_at

__all__ = [
    "DDPResult",
    "accuracy",
    "device_capacity_bytes",
    "eligible_devices",
    "model_memory_bytes",
    "run_allreduce",
    "split_dataset",
]

log = logging.getLogger(__name__)


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
        test_accuracy: top-1 accuracy of the final model on the test set (fraction).
        memory_bytes: the planner's estimate of the whole model on one device.
        wall_s: wall time of the run including process start-up (s).
        state: final parameters by their original names.
    """

    devices: tuple[str, ...]
    batch_size: int
    steps: int
    losses: tuple[float, ...]
    completions_ms: tuple[tuple[float, ...], ...]
    throughput: float
    test_accuracy: float
    memory_bytes: int
    wall_s: float
    state: dict[str, Tensor] = field(default_factory=dict, repr=False)


# ------------------------------------------------------------------------------ one rank


@dataclass(frozen=True)
class _RankContext:
    rank: int
    world: int
    device: str
    speed: float  # 0 = not paced
    cap_bytes: int  # 0 = no cap
    source: ModelSource
    batch_size: int
    steps: int
    seed: int
    optimizer: OptimizerConfig
    timeout_s: float
    init_method: str
    fault: str  # "kill:RANK:STEP" for tests


def _rank_main(
    ctx: _RankContext,
    train: Dataset[Any],
    calibration: Calibration | None,
    events: Any,
    parent: int,
) -> None:
    """Entry point of one DDP rank."""
    setup_child(f"ddp | rank {ctx.rank} | {ctx.device}", parent, logging.INFO)
    code = 0
    try:
        cuda = torch.cuda.is_available() and ctx.speed == 0
        dist.init_process_group(
            "nccl" if cuda else "gloo",
            init_method=ctx.init_method,
            rank=ctx.rank,
            world_size=ctx.world,
            timeout=timedelta(seconds=ctx.timeout_s),
        )
        try:
            result = _train_rank(ctx, train, calibration, events, cuda)
            buf = io.BytesIO()
            torch.save(result, buf)
            events.put(("result", ctx.rank, buf.getvalue()))
        finally:
            dist.destroy_process_group()
    except BaseException as exc:  # report anything to the launcher, which names the rank
        events.put(("error", ctx.rank, f"{type(exc).__name__}: {exc}"))
        code = 1
    events.close()
    events.join_thread()
    os._exit(code)


def _train_rank(
    ctx: _RankContext,
    train: Dataset[Any],
    calibration: Calibration | None,
    events: Any,
    cuda: bool,
) -> dict[str, Any]:
    device = torch.device(f"cuda:{ctx.rank % torch.cuda.device_count()}" if cuda else "cpu")
    module, _, loss_fn = reference_module(ctx.source, ctx.batch_size, ctx.seed)
    module.to(device)
    ddp = nn.parallel.DistributedDataParallel(module, device_ids=[device] if cuda else None)
    params = [p for p in ddp.parameters() if p.requires_grad]
    opt = build_optimizer(params, ctx.optimizer)
    param_bytes = sum(p.numel() * p.element_size() for p in params)
    buffer_bytes = sum(b.numel() * b.element_size() for b in module.buffers())
    factor = 2.0 if ctx.optimizer.name == "adam" else (1.0 if ctx.optimizer.momentum else 0.0)
    where = f"ddp | rank {ctx.rank} | device {ctx.device}"
    meter = MemoryMeter(where, ctx.cap_bytes, param_bytes, buffer_bytes, factor)
    src = MinibatchSource(train, ctx.batch_size * ctx.world, ctx.seed)
    lo, hi = ctx.rank * ctx.batch_size, (ctx.rank + 1) * ctx.batch_size
    solo_s = calibration.task_s(0, "FB") if calibration is not None and ctx.speed > 0 else 0.0
    losses: list[float] = []
    done: list[float] = []
    dist.barrier()
    start = time.time()
    for p in range(1, ctx.steps + 1):
        if ctx.fault == f"kill:{ctx.rank}:{p}":
            os.kill(os.getpid(), signal.SIGKILL)
        t0 = time.perf_counter()
        xs, y = src.batch(p)
        xs = tuple(x[lo:hi].to(device) for x in xs)  # (B, ...) this rank's shard
        y = y[lo:hi].to(device)
        opt.zero_grad(set_to_none=True)
        with SavedBytes(exclude=params) as saved:
            loss = loss_fn(ddp(*xs), y)
        if ctx.cap_bytes:
            meter.check(p, saved.nbytes + sum(x.numel() * x.element_size() for x in xs), 0)
        loss.backward()  # type: ignore[no-untyped-call]  # DDP all-reduces (averages) grads
        for g in opt.param_groups:
            g["lr"] = lr_at(ctx.optimizer, p - 1, ctx.steps)
        opt.step()  # device work: inside the paced window, as in the pipeline's stages
        if solo_s:
            pace_until(t0 + solo_s / ctx.speed)
        meter.release(p)
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        losses.append(float(mean) / ctx.world)
        done.append(time.time())
        if ctx.rank == 0:
            events.put(("step", ctx.rank, p))
    state = {n: t.detach().cpu().clone() for n, t in module.named_parameters()}
    return {
        "start": start,
        "done": done,
        "losses": losses,
        "state": state if ctx.rank == 0 else {},
        "peak_bytes": meter.peak_bytes,
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
    cluster: Cluster,
    model_ref: str,
    batch_size: int,
    steps: int,
    *,
    optimizer: OptimizerConfig | None = None,
    seed: int = 0,
    dataset: Dataset[Any] | None = None,
    test_dataset: Dataset[Any] | None = None,
    test_fraction: float = 0.2,
    max_devices: int = 0,
    memory_bytes: int | None = None,
    emulate: bool = True,
    timeout_s: float = 30.0,
    out_dir: str | os.PathLike[str] | None = None,
    fault: str = "",
) -> DDPResult:
    """Train ``model_ref`` with DDP (AllReduce, BSP) on every device of ``cluster`` that holds it.

    Args:
        cluster: the cluster (emulated devices are paced and capped like the pipeline runtime).
        model_ref: built-in model name or ``package.module:factory``.
        batch_size: samples per minibatch per rank (the paper's per-GPU batch).
        steps: minibatches per rank (>= 2 for the steady-state throughput definition).
        optimizer: optimizer and schedule (default SGD, lr 0.05).
        seed: initial weights (identical to the pipeline's) and data order.
        dataset: training items ``(inputs, target)``; ``None`` = the built-in default.
        test_dataset: held-out items; ``None`` = a seeded ``test_fraction`` split of ``dataset``.
        test_fraction: share held out when ``test_dataset`` is ``None``.
        max_devices: use at most this many eligible devices (0 = all).
        memory_bytes: the whole model's memory need; ``None`` = the planner's estimate.
        emulate: pace emulated devices and enforce their memory caps.
        timeout_s: timeout of every process-group operation (s); a stuck rank fails.
        out_dir: where to write ``ddp.json`` (figures).
        fault: tests only: ``kill:RANK:STEP`` kills a rank mid-run.

    Returns:
        The :class:`DDPResult`.

    Raises:
        ConfigError: no device can hold the model, or bad arguments.
        HetPipeRuntimeError: a rank failed or died (the message names it).
    """
    if steps < 1 or batch_size < 1:
        raise ConfigError(f"steps and batch size must be >= 1, got {steps} and {batch_size}")
    t_start = time.time()
    need = (
        memory_bytes
        if memory_bytes is not None
        else model_memory_bytes(cluster, model_ref, batch_size, _opt_name(optimizer))
    )
    devices = eligible_devices(cluster, need)
    if not devices:
        biggest = max(device_capacity_bytes(d) for d in cluster.devices)
        raise ConfigError(
            f"{cluster.source}: no device can hold {model_ref} at batch {batch_size} "
            f"({need / 2**20:.2f} MiB > largest device {biggest / 2**20:.2f} MiB); "
            "AllReduce needs the whole model on every device: lower the batch size or use HetPipe"
        )
    if max_devices:
        devices = devices[:max_devices]
    source = ModelSource(ref=model_ref)
    opt = optimizer or OptimizerConfig()
    train, test = _data(source, batch_size, dataset, test_dataset, test_fraction, seed)
    out = Path(out_dir) if out_dir is not None else None
    paced = emulate and any(d.emulation is not None for d in devices)
    cal = None
    if paced:  # the same solo times the planner and the pipeline's stages use
        fwd_s, bwd_s = model_solo_s(cluster, model_ref, batch_size)
        cal = Calibration(
            f"{source.name}|batch={batch_size}|whole model|profile", (fwd_s,), (bwd_s,)
        )
    log.info(
        "AllReduce on %d devices (%s): model needs %.2f MiB",
        len(devices),
        " ".join(d.label for d in devices),
        need / 2**20,
    )
    with tempfile.TemporaryDirectory(prefix="hetpipe-ddp-") as tmp:
        ctxs = [
            _RankContext(
                rank=r,
                world=len(devices),
                device=d.label,
                speed=d.emulation.speed if emulate and d.emulation is not None else 0.0,
                cap_bytes=d.emulation.memory_bytes if emulate and d.emulation is not None else 0,
                source=source,
                batch_size=batch_size,
                steps=steps,
                seed=seed,
                optimizer=opt,
                timeout_s=timeout_s,
                init_method=f"file://{Path(tmp) / 'rendezvous'}",
                fault=fault,
            )
            for r, d in enumerate(devices)
        ]
        results = _spawn_and_watch(ctxs, train, cal, max(60.0, 4 * timeout_s))
    result = _assemble(ctxs, results, test, need, time.time() - t_start)
    if out is not None:
        _write(result, out)
    return result


def _opt_name(cfg: OptimizerConfig | None) -> str:
    if cfg is None or (cfg.name == "sgd" and not cfg.momentum):
        return "sgd"
    return "adam" if cfg.name == "adam" else "momentum"


def _assemble(
    ctxs: Sequence[_RankContext],
    results: list[dict[str, Any]],
    test: Dataset[Any],
    need: int,
    wall_s: float,
) -> DDPResult:
    from planner.sim_engine import measured_throughput

    c0 = ctxs[0]
    origin = min(float(r["start"]) for r in results)
    completions = tuple(tuple((t - origin) * 1e3 for t in r["done"]) for r in results)
    if c0.steps >= 2:
        throughput = measured_throughput(completions, 1, c0.batch_size)
    else:
        span_s = max(c[-1] for c in completions) / 1e3
        throughput = len(ctxs) * c0.steps * c0.batch_size / span_s if span_s > 0 else 0.0
    module, names, _ = reference_module(c0.source, c0.batch_size, c0.seed)
    module.load_state_dict(results[0]["state"], strict=False)
    acc = accuracy(module.eval(), test, c0.batch_size)
    return DDPResult(
        devices=tuple(c.device for c in ctxs),
        batch_size=c0.batch_size,
        steps=c0.steps,
        losses=tuple(float(x) for x in results[0]["losses"]),
        completions_ms=completions,
        throughput=throughput,
        test_accuracy=acc,
        memory_bytes=need,
        wall_s=wall_s,
        state={names[n]: t for n, t in results[0]["state"].items()},
    )


def _write(result: DDPResult, out: Path) -> None:
    import json

    from profiler.files import atomic_write_text

    out.mkdir(parents=True, exist_ok=True)
    figures = {
        "devices": list(result.devices),
        "batch_size": result.batch_size,
        "steps": result.steps,
        "throughput": result.throughput,
        "test_accuracy": result.test_accuracy,
        "memory_bytes": result.memory_bytes,
        "wall_s": result.wall_s,
        "final_loss": result.losses[-1] if result.losses else None,
    }
    atomic_write_text(out / "ddp.json", json.dumps(figures, indent=2))
    torch.save(result.state, out / "weights.pt")


def _spawn_and_watch(
    ctxs: Sequence[_RankContext],
    train: Dataset[Any],
    cal: Calibration | None,
    stall_s: float,
) -> list[dict[str, Any]]:
    mpc = mp.get_context("spawn")
    events = mpc.Queue()
    procs: dict[int, Any] = {}
    try:
        for c in ctxs:
            p = mpc.Process(
                target=_rank_main,
                args=(c, train, cal, events, os.getpid()),
                name=f"hetpipe-ddp-rank{c.rank}",
            )
            p.start()
            procs[c.rank] = p
        return watch_ranks([c.device for c in ctxs], procs, events, stall_s)
    finally:
        stop_all(procs)
