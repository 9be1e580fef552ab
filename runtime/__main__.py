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
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from planner.plan import load_plan
from profiler.errors import ConfigError, HetPipeError
from runtime.config import ModelSource, OptimizerConfig, RunConfig
from runtime.emulation import Calibration
from runtime.launcher import stage_contexts, total_steps
from runtime.stage import StageWorker

log = logging.getLogger("runtime")


def _args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m runtime", description=__doc__.split("\n")[0] if __doc__ else ""
    )
    p.add_argument("plan", type=Path)
    p.add_argument("--steps", type=int, default=0)
    p.add_argument("--epochs", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--nm", type=int, default=0)
    p.add_argument("--vw", type=int, default=0)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--optimizer", default="sgd")
    p.add_argument("--timeout", type=float, default=60.0)
    p.add_argument("--calibration", type=Path, default=None)
    p.add_argument("--out", type=Path, default=None)
    return p.parse_args(argv)


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
        run = RunConfig(
            steps=a.steps, epochs=a.epochs, seed=a.seed, nm=a.nm, timeout_s=a.timeout, out_dir=a.out
        )
        from runtime.data import default_dataset
        from runtime.model import resolve_source

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
            cfg = OptimizerConfig(name=a.optimizer, lr=a.lr)
            worker = StageWorker(ctx, source, cfg, run, None, calibration)
            dist.barrier()
            result = worker.run(time.time())
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


if __name__ == "__main__":
    sys.exit(main())
