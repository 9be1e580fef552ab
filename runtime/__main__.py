"""torchrun entry point: one rank of a run on several hosts, the same jobs as ``hetpipe run``.

Usage, on every host (``--nproc-per-node`` = the ranks that host runs)::

    torchrun --nnodes 2 --nproc-per-node 3 --rdzv-backend c10d \\
        --rdzv-endpoint HOST0:29500 -m runtime plan.yaml --steps 100 --out run/

The options are ``hetpipe run``'s (:data:`runtime.options.OPTIONS`: the same names, defaults
and configs), and each rank runs the job the one-host launcher would give it
(:func:`runtime.launch.launcher.prepare`): with the plan's rule, ``wsp`` has ranks
``0 .. n_shards-1`` serve the parameter-server shards and the next ranks run the stages VW
by VW, in pipeline order; ``allreduce`` and ``local`` (one VW alone, ``--vw K``) have only
stages. torchrun gives each host a contiguous block of ranks, so put the first stages on
node 0. ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR`` and ``MASTER_PORT`` come from torchrun.

Every rank writes its result to ``--out/rank<r>.pt`` (a stage's ``StageResult`` or a shard's
final state and clock trace); :func:`collect_wsp` turns the files into a
:class:`runtime.results.run_result.RunResult`. Checkpoints and ``--resume DIR`` need ``--out`` on a
file system every host shares; ranks that torchrun restarts (its own ``--max-restarts``)
resume from the last snapshot; ``--time-limit`` stops every VW at
one agreed wave (through the process group's store). ``--data pkg.mod:factory`` (or
``synthetic``) is ``hetpipe run``'s: every rank calls the factory with the run's seed.
``--calibration`` replaces the pacing table of emulated devices by one written by a
single-host run (``calibration.json``).
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import sys
from pathlib import Path
from typing import Any

import torch

from planner.plan import Plan
from planner.plan_check import check_nm
from planner.plan_file import load_plan
from profiler.errors import ConfigError, HetPipeError, HetPipeRuntimeError
from profiler.files import atomic_write_bytes
from runtime.config import ModelSource
from runtime.launch.admit import check_plan_model
from runtime.options import add_arguments, check_values, configs
from runtime.results.run_result import RunResult

log = logging.getLogger("runtime")


def _args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m runtime", description=__doc__.split("\n")[0] if __doc__ else ""
    )
    p.add_argument("plan", type=Path)
    add_arguments(p)  # hetpipe run's options, defaults and help
    p.add_argument("--out", type=Path, default=None, help="run directory, shared by every host")
    p.add_argument("--resume", default=None, help="continue the run in DIR (its --out)")
    p.add_argument("--calibration", type=Path, default=None, help="pacing table to use")
    args = p.parse_args(argv)
    given = sys.argv[1:] if argv is None else argv
    args.every_given = any(x.split("=")[0] == "--checkpoint-every" for x in given)
    return args


def main(argv: list[str] | None = None) -> int:
    """Run this process's rank; returns the exit code."""
    a = _args(argv)
    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    logging.basicConfig(
        level=logging.INFO, format=f"%(asctime)s [rank {rank}] %(levelname)s %(message)s"
    )
    torch.set_num_threads(1)
    try:
        check_values(vars(a))  # every number in range before the plan is read
        plan = load_plan(a.plan)
        check_plan_model(plan, str(a.plan))  # what hetpipe run and simulate refuse
        check_nm(plan, a.nm, a.vw)
        job = _rank_job(a, plan, rank, world)
    except HetPipeError as exc:
        log.error("%s", exc)
        return 2
    if job is None:
        return 0
    from runtime.launch.procs import ShardJob, shard_main, stage_main

    sink = _RankSink(a.out, rank)
    try:
        if isinstance(job, ShardJob):
            shard_main(job, sink, os.getppid())
        stage_main(job, sink, os.getppid())
    except SystemExit as done:  # the entry points exit with their code
        return int(done.code or 0)
    return 0


def _rank_job(a: argparse.Namespace, plan: Plan, rank: int, world: int) -> Any:
    """This rank's job: the one the one-host launcher would give it (``None``: nothing left to
    train, the outputs were written from the snapshot)."""
    from runtime.data_source import named_data
    from runtime.launch.launcher import prepare
    from runtime.persist.run_dir import SharedRun, elastic_resume, resume_target
    from runtime.persist.snapshot import committed_clocks
    from runtime.run import rule_for, settle

    resume = a.resume
    restarted = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    ckpts = committed_clocks(a.out / "checkpoints") if a.out is not None else []
    if resume is None and elastic_resume(False, restarted, ckpts):
        resume = str(a.out)  # torchrun restarted the ranks (--max-restarts): the last snapshot
    target = resume_target(resume) if resume is not None else None
    out = a.out or (target[0] if target is not None else None)
    hint = f"torchrun ... -m runtime {a.plan}"
    opt, run, cfg = configs(vars(a), out, False, target, hint)
    if cfg.checkpoint_dir is None and out is not None:
        cfg = dataclasses.replace(cfg, checkpoint_dir=out / "checkpoints")
    rule = rule_for(plan, a.vw)
    if rule == "local":  # one VW alone writes no snapshots (an explicit --checkpoint-every: no)
        from runtime.launch.jobs import check_alone

        check_alone(cfg, a.every_given)
    run = settle(run, plan, rule)  # the plan's defaults, as hetpipe run fills them
    attempt = "-".join(os.environ.get(k, "0") for k in ("TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT"))  # fmt: skip
    owner = SharedRun("" if cfg.resume else attempt, attempt, rank == 0) if out else None
    data = named_data(a.data, plan.model, plan.batch_size, run.seed)  # as hetpipe run's --data
    prep = prepare(plan, ModelSource(ref=plan.model), opt, run, cfg, data, owner, rule,
                   max(a.vw, 0), "env://")  # fmt: skip
    if isinstance(prep, RunResult):
        return None
    jobs: dict[int, Any] = {s.rank: s for s in prep.shards}
    jobs |= {j.ctx.rank: j for j in prep.stages}
    if world != len(jobs):
        raise ConfigError(
            f"WORLD_SIZE={world} but {a.plan} needs {len(prep.shards)} shards and "
            f"{len(prep.stages)} stages: start {len(jobs)} processes in total "
            "(--nnodes x --nproc-per-node)"
        )
    job = jobs[rank]
    if a.calibration is not None and rank >= len(prep.shards):  # a stage: this pacing table
        from runtime.stage.emulation import Calibration

        job = dataclasses.replace(job, calibration=Calibration.load(a.calibration))
    return job


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


def collect_wsp(plan: Plan, out: Path, nm: int = 0, D: int | None = None) -> RunResult:
    """The :class:`RunResult` of a torchrun WSP run from its ``out/rank<r>.pt`` files.

    Raises:
        HetPipeRuntimeError: a rank's file is missing (that rank failed).
    """
    from profiler.graph import ModelGraph
    from runtime.launch.procs import loads_result
    from runtime.launch.wsp import shard_specs
    from runtime.results.metrics import StageResult
    from runtime.results.whole_state import state_keys
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
    result = RunResult.build(plan, nm or plan.nm, D, stages, states, specs, 0.0)
    return dataclasses.replace(result, keys=state_keys(spec.module))  # every state_dict name


if __name__ == "__main__":
    sys.exit(main())
