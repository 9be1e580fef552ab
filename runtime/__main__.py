"""torchrun-compatible entry point: one process of a multi-host run.

Usage, on every host (``K`` = the number of the plan VW's stages on that host)::

    torchrun --nnodes N --node-rank I --nproc-per-node K \\
        --master-addr HOST0 --master-port 29500 -m runtime plan.yaml --steps 100

Global rank ``r`` runs stage ``r`` of the chosen virtual worker (ranks are assigned in
pipeline order, so put the first stages on node 0). ``RANK``, ``WORLD_SIZE``,
``MASTER_ADDR`` and ``MASTER_PORT`` come from torchrun. Emulated devices are paced only when
``--calibration`` names a table written by a single-host run (``calibration.json``), so that
every host uses the same one. The last rank logs the losses; each rank writes its
measurements to ``--out/stage<rank>.pt`` when ``--out`` is given.

Every VW through the WSP parameter servers (``--vw -1``, the default for a plan with several
VWs): the world is the plan's shards and stages, ``n_shards + sum(stages)`` ranks; rank
``k < n_shards`` serves shard ``k``, the next ranks run the stages VW by VW, in pipeline
order (the numbering of ``hetpipe run``). torchrun gives each host a contiguous block of
``--nproc-per-node`` ranks, e.g. for 2 shards and two 2-stage VWs on two hosts::

    torchrun --nnodes 2 --nproc-per-node 3 --rdzv-backend c10d \
        --rdzv-endpoint HOST0:29500 -m runtime plan.yaml --steps 100 --out run/

(on each host). Every rank writes its result to ``--out/rank<r>.pt`` (a stage's
``StageResult`` or a shard's final state and clock trace); :func:`collect_wsp` turns the
files into a :class:`runtime.results.wsp.WSPResult`. ``--checkpoint-every`` and ``--resume``
need ``--out`` on a file system every host shares; ``--time-limit`` stops every VW at one
agreed wave (through the process group's store).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from planner.plan import Plan, load_plan
from profiler.errors import ConfigError, HetPipeError, HetPipeRuntimeError
from profiler.files import atomic_write_bytes
from profiler.graph import ModelGraph
from runtime.config import ModelSource, OptimizerConfig, RunConfig, WSPConfig
from runtime.defaults import CHECKPOINT_EVERY, TIMEOUT_S
from runtime.launch.single import stage_contexts, total_steps
from runtime.results.wsp import WSPResult
from runtime.stage.emulation import Calibration
from runtime.stage.job import StageJob
from runtime.stage.worker import StageWorker
from runtime.sync.rule import SyncSpec

log = logging.getLogger("runtime")


def _args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m runtime", description=__doc__.split("\n")[0] if __doc__ else ""
    )
    p.add_argument("plan", type=Path)
    p.add_argument("--steps", type=int, default=0)
    p.add_argument("--epochs", type=float, default=0.0)
    p.add_argument(
        "--time-limit",
        type=float,
        default=0.0,
        help="stop admitting minibatches after SECONDS (every VW stops at one agreed wave)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--nm", type=int, default=0)
    p.add_argument("--vw", type=int, default=None, help="one VW; -1 = all through WSP")
    p.add_argument("--D", type=int, default=None, help="WSP clock-distance threshold")
    # the defaults are hetpipe run's: OptimizerConfig's and runtime.defaults
    opt = OptimizerConfig()
    p.add_argument("--optimizer", default=opt.name, help="sgd or adam")
    p.add_argument("--lr", type=float, default=opt.lr)
    p.add_argument("--momentum", type=float, default=opt.momentum)
    p.add_argument("--weight-decay", type=float, default=opt.weight_decay)
    p.add_argument("--schedule", default=opt.schedule, help="constant, step, cosine, warmup")
    p.add_argument(
        "--checkpoint-every", type=int, default=CHECKPOINT_EVERY, help="with --out; 0 = never"
    )
    p.add_argument("--resume", action="store_true", help="continue from --out/checkpoints")
    p.add_argument("--timeout", type=float, default=TIMEOUT_S)
    p.add_argument("--precision", default="", help="fp32 or bf16 (default: the plan's)")
    p.add_argument("--calibration", type=Path, default=None)
    p.add_argument("--out", type=Path, default=None)
    return p.parse_args(argv)


def _optimizer(a: argparse.Namespace) -> OptimizerConfig:
    return OptimizerConfig(
        name=a.optimizer, lr=a.lr, momentum=a.momentum, weight_decay=a.weight_decay,
        schedule=a.schedule,
    )  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    """Run this process's stage; returns the exit code."""
    a = _args(argv)
    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    logging.basicConfig(
        level=logging.INFO, format=f"%(asctime)s [rank {rank}] %(levelname)s %(message)s"
    )
    torch.set_num_threads(1)
    try:
        plan = load_plan(a.plan)
        if a.vw == -1 or (a.vw is None and len(plan.virtual_workers) > 1):
            return _main_wsp(a, plan, rank, world)
        a.vw = a.vw or 0
        run = RunConfig(
            steps=a.steps, epochs=a.epochs, time_limit_s=a.time_limit, seed=a.seed, nm=a.nm,
            timeout_s=a.timeout, out_dir=a.out, precision=a.precision or plan.precision,
        )  # fmt: skip
        from runtime.data import default_dataset
        from runtime.stage.model import resolve_source

        source = ModelSource(ref=plan.model)
        spec = resolve_source(source, plan.batch_size, meta=True)
        ds = default_dataset(source.name, spec.inputs, spec.targets, plan.batch_size)
        steps = total_steps(run, len(ds) // plan.batch_size)  # type: ignore[arg-type]
        contexts = stage_contexts(plan, a.vw, a.nm or plan.nm, steps)
        if world != len(contexts):
            raise ConfigError(
                f"WORLD_SIZE={world} but VW {a.vw} of {a.plan} has {len(contexts)} stages: "
                f"start {len(contexts)} processes in total"
            )
        ctx = contexts[rank]
        calibration = Calibration.load(a.calibration) if a.calibration is not None else None
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        dist.init_process_group(
            backend, init_method="env://", timeout=timedelta(seconds=run.timeout_s)
        )
        try:
            sync = SyncSpec("local", timeout_s=run.timeout_s)
            job = StageJob(ctx, source, _optimizer(a), run, sync, calibration=calibration)
            worker = StageWorker(job)
            dist.barrier()
            result = worker.run()
        finally:
            dist.destroy_process_group()
    except HetPipeError as exc:
        log.error("%s", exc)
        return 2
    if result.losses:
        log.info(
            "trained %d minibatches; loss first %.4f last %.4f",
            result.steps,
            result.losses[0][1],
            result.losses[-1][1],
        )
    if a.out is not None:
        a.out.mkdir(parents=True, exist_ok=True)
        torch.save(result, a.out / f"stage{rank}.pt")
    return 0


def _main_wsp(a: argparse.Namespace, plan: Plan, rank: int, world: int) -> int:
    """Run rank ``rank`` of a multi-VW WSP run (a shard or a stage); returns the exit code."""
    import dataclasses

    from runtime.data import default_dataset
    from runtime.launch.procs import ShardJob, shard_main, stage_main
    from runtime.launch.wsp import shard_specs, snapshot_parts, split_data, wsp_steps
    from runtime.persist.run_dir import check_settings, elastic_resume, job_settings
    from runtime.persist.snapshot import SnapshotSpec, clean, committed_clocks, select
    from runtime.stage.model import resolve_source

    source = ModelSource(ref=plan.model)
    run = RunConfig(
        steps=a.steps, epochs=a.epochs, time_limit_s=a.time_limit, seed=a.seed, nm=a.nm,
        timeout_s=a.timeout, out_dir=a.out, emulate=a.calibration is not None,
        precision=a.precision or plan.precision,
    )  # fmt: skip
    ckpt = a.out / "checkpoints" if a.out is not None else None
    cfg = WSPConfig(D=a.D, checkpoint_dir=ckpt, checkpoint_every=a.checkpoint_every,
                    resume=a.resume, resume_hint=f"torchrun ... -m runtime {a.plan}")  # fmt: skip
    D, nm = plan.D if a.D is None else a.D, a.nm or plan.nm
    spec = resolve_source(source, plan.batch_size, meta=True)
    ds = default_dataset(source.name, spec.inputs, spec.targets, plan.batch_size)
    data, _ = split_data(ds, len(plan.virtual_workers), cfg.test_fraction, a.seed)
    shapes = {n: tuple(p.shape) for n, p in spec.module.named_parameters()}
    specs, ranks = shard_specs(plan, ModelGraph.from_spec(spec), shapes, D)
    needed = len(specs) + sum(len(r) for r in ranks)
    if world != needed:
        raise ConfigError(
            f"WORLD_SIZE={world} but {a.plan} has {len(specs)} shards and "
            f"{needed - len(specs)} stages: start {needed} processes in total "
            "(--nnodes x --nproc-per-node)"
        )
    opt = _optimizer(a)
    first_wave, resuming = 0, False
    if ckpt is not None:  # every rank reads the same snapshot; rank 0 tidies before the barrier
        vw_samples = min(len(d) for d in data)
        horizon = wsp_steps(run, nm, 0, vw_samples, plan.batch_size)
        settings = job_settings(source.name, plan.to_json(), nm, D, a.seed, cfg.test_fraction,
                                f"{type(ds).__name__}:{len(ds)}", opt, horizon, run.precision)  # type: ignore[arg-type]  # fmt: skip
        attempt = "-".join(os.environ.get(k, "0") for k in ("TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT"))  # fmt: skip
        run_id = attempt
        restarted = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
        resuming = elastic_resume(a.resume, restarted, committed_clocks(ckpt))
        if resuming:
            manifest, _ = select(ckpt, None)
            check_settings(f"--resume {manifest.path}", manifest.settings, settings)
            first_wave, run_id = manifest.clock, manifest.run_id
        if rank == 0:
            clean(ckpt, first_wave if resuming else None)
        snaps = SnapshotSpec(ckpt, run_id, attempt, snapshot_parts(plan), settings, a.checkpoint_every)  # fmt: skip
        cfg = dataclasses.replace(cfg, snapshots=snaps)
    elif a.resume:
        raise ConfigError("--resume needs --out (the run's directory, shared by every host)")
    steps = wsp_steps(run, nm, first_wave, min(len(d) for d in data), plan.batch_size)
    if steps == 0:
        raise ConfigError(f"the snapshot is already at wave {first_wave}: nothing left to train")
    sink = _RankSink(a.out, rank)
    sync = SyncSpec("wsp", plan.sync_params, D, specs, cfg.snapshots, first_wave,
                    timeout_s=a.timeout)  # fmt: skip
    try:
        if rank < len(specs):
            shard = ShardJob(rank, specs[rank], plan.shards[rank].node, source, plan.batch_size,
                             a.seed, sync, resuming, "env://", world)  # fmt: skip
            shard_main(shard, sink, os.getppid())
        vw = next(k for k, r in enumerate(ranks) if rank in r)
        ctx = stage_contexts(plan, vw, nm, steps, first_rank=ranks[vw][0])[rank - ranks[vw][0]]
        calibration = Calibration.load(a.calibration) if a.calibration is not None else None
        job = StageJob(ctx, source, opt, run, sync, data[vw], calibration=calibration,
                       init_method="env://", world_size=world, agree_stop=True)  # fmt: skip
        stage_main(job, sink, os.getppid())
    except SystemExit as done:  # the entry points exit with their code
        return int(done.code or 0)
    return 0


class _RankSink:
    """The ``events`` queue of a torchrun rank: results go to ``out/rank<r>.pt``, errors to
    the log (torchrun reports the failed rank and stops the others)."""

    def __init__(self, out: Path | None, rank: int) -> None:
        self.out, self.rank = out, rank

    def put(self, msg: tuple[Any, ...]) -> None:
        if msg[0] in ("result", "shard") and self.out is not None:
            atomic_write_bytes(self.out / f"rank{self.rank}.pt", msg[2])
        elif msg[0] == "error":
            log.error("rank %d failed: %s", self.rank, msg[2])

    def close(self) -> None:
        """Nothing to flush."""

    def join_thread(self) -> None:
        """Nothing to wait for."""


def collect_wsp(plan: Plan, out: Path, nm: int = 0, D: int | None = None) -> WSPResult:
    """The :class:`WSPResult` of a torchrun WSP run from its ``out/rank<r>.pt`` files.

    Raises:
        HetPipeRuntimeError: a rank's file is missing (that rank failed).
    """
    from runtime.launch.procs import loads_result
    from runtime.launch.wsp import shard_specs
    from runtime.results.metrics import StageResult
    from runtime.stage.model import resolve_source

    D = plan.D if D is None else D
    spec = resolve_source(ModelSource(ref=plan.model), plan.batch_size, meta=True)
    shapes = {n: tuple(p.shape) for n, p in spec.module.named_parameters()}
    specs, ranks = shard_specs(plan, ModelGraph.from_spec(spec), shapes, D)
    results = []
    for r in range(len(specs) + sum(len(x) for x in ranks)):
        path = out / f"rank{r}.pt"
        if not path.exists():
            raise HetPipeRuntimeError(f"{path}: missing; rank {r} did not finish (see its log)")
        results.append(loads_result(path.read_bytes()))
    stages = [x for x in results if isinstance(x, StageResult)]
    states = [x for x in results if not isinstance(x, StageResult)]
    return WSPResult.build(plan, nm or plan.nm, D, stages, states, specs, 0.0)


if __name__ == "__main__":
    sys.exit(main())
