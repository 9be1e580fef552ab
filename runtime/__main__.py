"""torchrun entry point: one rank of a run on several hosts, the same jobs as ``hetpipe run``.

Usage, on every host (``--nproc-per-node`` = the ranks that host runs)::

    torchrun --nnodes 2 --nproc-per-node 3 --rdzv-backend c10d \\
        --rdzv-endpoint HOST0:29500 -m runtime plan.yaml --steps 100 --out run/

The options are ``hetpipe run``'s (:data:`runtime.options.OPTIONS`: the same names, defaults
and configs), and each rank runs the job the one-host launcher would give it
(:func:`runtime.launch.launcher.prepare`) for a role the plan places on its host (the
cluster file's ``host:`` fields, :mod:`runtime.launch.hosts`; ``--host`` names it where the
rank cannot tell): with the plan's rule, ``wsp`` has roles ``0 .. n_shards-1`` serve the
parameter-server shards and the next ones run the stages VW by VW, in pipeline order;
``allreduce`` and ``local`` (one VW alone, ``--vw K``) have only stages. ``RANK``,
``WORLD_SIZE``, ``MASTER_ADDR`` and ``MASTER_PORT`` come from torchrun. docs/multihost.md
has the lines per host.

Every rank writes its result to ``--out/rank<role>.pt`` (a stage's ``StageResult`` or a
shard's final state and clock trace); global rank 0 waits for every rank (through torchrun's
store) and writes what ``hetpipe run`` writes (:func:`collect`: summary table,
``summary.json``, ``weights.pt``, the test accuracy). Checkpoints and ``--resume DIR`` need
``--out`` on a file system every host shares; ranks that torchrun restarts (its own
``--max-restarts``) resume from the last snapshot; ``--time-limit`` stops every VW at
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
import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch

from planner.plan import Plan
from planner.plan_check import check_nm
from planner.plan_file import load_plan
from planner.rules import layout
from profiler.errors import ConfigError, HetPipeError, HetPipeRuntimeError
from profiler.files import atomic_write_bytes
from runtime.config import ModelSource, RunConfig
from runtime.launch.admit import check_plan_model
from runtime.launch.jobs import Attempt, Prepared
from runtime.options import add_arguments, check_values, run_spec
from runtime.results.run_result import RunResult
from runtime.spec import RunSpec

log = logging.getLogger("runtime")


def _args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m runtime", description=__doc__.split("\n")[0] if __doc__ else ""
    )
    p.add_argument("plan", type=Path)
    add_arguments(p)  # hetpipe run's options, defaults and help
    p.add_argument("--out", type=Path, default=None, help="run directory, shared by every host")
    p.add_argument("--resume", default=None, help="continue the run in DIR (its --out)")
    p.add_argument(
        "--host",
        default=None,
        help="the cluster host (or node) this agent is; default: the one host of the plan that is an address of this machine",
    )
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
    t_start = time.time()
    try:
        check_values(vars(a))  # every number in range before the plan is read
        plan = load_plan(a.plan)
        check_plan_model(plan, str(a.plan))  # what hetpipe run and simulate refuse
        check_nm(plan, a.nm, a.vw)
        store, attempt = _torchrun_store(rank, world, a.timeout)
        setup = _prepared(a, plan, rank, attempt)
        if setup is None:  # nothing left to train: the outputs were written from the snapshot
            return 0
        role = _role(a, plan, setup.prep, rank, world, store)
        job = _job_of(a, setup.prep, role)
    except HetPipeError as exc:
        log.error("%s", exc)
        return 2
    code = _run_job(job, a.out, role)
    if code != 0:
        return code
    try:
        return _finish(plan, setup, store, rank, role, time.time() - t_start)
    except HetPipeError as exc:
        log.error("%s", exc)
        return 2


@dataclass(frozen=True)
class _Setup:
    """What every rank prepares alike: the jobs of every process, and what the result needs.

    Attributes:
        prep: every process's job (roles in the launcher's rank order).
        run: the run settings (the plan's defaults filled in).
        rule: the synchronisation rule.
        vw: the VW trained alone (rule ``local``).
        attempt: torchrun's worker group (0; 1 after its first restart, ...).
    """

    prep: Prepared
    run: RunConfig
    rule: str
    vw: int
    attempt: int


def _run_job(job: Any, out: Path | None, role: int) -> int:
    """Run ``job`` (a shard's or a stage's) in this process; its exit code."""
    from runtime.launch.procs import ShardJob, shard_main, stage_main

    sink = _RankSink(out, role)
    try:
        if isinstance(job, ShardJob):
            shard_main(job, sink, os.getppid())
        stage_main(job, sink, os.getppid())
    except SystemExit as done:  # the entry points exit with their code
        return int(done.code or 0)
    return 0


def _rank_job(a: argparse.Namespace, plan: Plan, rank: int, world: int, store: Any = None) -> Any:
    """This rank's job: the one the one-host launcher would give the role the plan places on
    this rank's host (``None``: nothing left to train, the outputs were written from the
    snapshot)."""
    setup = _prepared(a, plan, rank, 0)
    if setup is None:
        return None
    return _job_of(a, setup.prep, _role(a, plan, setup.prep, rank, world, store))


def _prepared(a: argparse.Namespace, plan: Plan, rank: int, attempt: int) -> _Setup | None:
    """Every process's job, as the one-host launcher prepares them, in torchrun's worker group
    number ``attempt`` (``None``: a resume with nothing left to train; the outputs were
    written from the snapshot)."""
    from runtime.data_source import named_data
    from runtime.launch.launcher import prepare
    from runtime.persist.run_dir import SharedRun, elastic_resume
    from runtime.persist.snapshot import committed_clocks
    from runtime.run import rule_for, settle

    resume = a.resume
    ckpts = committed_clocks(a.out / "checkpoints") if a.out is not None else []
    if resume is None and elastic_resume(False, attempt, ckpts):
        resume = str(a.out)  # torchrun restarted the ranks (--max-restarts): the last snapshot
    spec = torchrun_spec(a, resume)
    rule = rule_for(plan, spec.vw)
    if (
        layout(rule) == "alone"
    ):  # one VW alone writes no snapshots (an explicit --checkpoint-every: no)
        from runtime.launch.jobs import check_alone

        check_alone(spec, a.every_given)
    spec = settle(spec, plan)  # the plan's defaults, as hetpipe run fills them
    out, tag = spec.run.out_dir, f"{os.environ.get('TORCHELASTIC_RUN_ID', '0')}-{attempt}"
    owner = SharedRun("" if spec.checkpoints.resume else tag, tag, rank == 0) if out else None
    data = named_data(a.data, plan.model, plan.batch_size, spec.run.seed)  # as hetpipe run's
    prep = prepare(plan, ModelSource(ref=plan.model), spec, data, Attempt("env://", owner))
    if isinstance(prep, RunResult):
        return None
    return _Setup(prep, spec.run, rule, max(spec.vw, 0), attempt)


def torchrun_spec(a: argparse.Namespace, resume: str | None) -> RunSpec:
    """The :class:`runtime.spec.RunSpec` of torchrun's options (``resume``: the ``--resume``
    to use), as ``hetpipe run`` builds it from the same options table."""
    from runtime.persist.run_dir import resume_target

    target = resume_target(resume) if resume is not None else None
    out = a.out or (target[0] if target is not None else None)
    return run_spec(vars(a), out, False, target, f"torchrun ... -m runtime {a.plan}")


def _job_of(a: argparse.Namespace, prep: Prepared, role: int) -> Any:
    """The job of launcher rank ``role`` (a stage gets ``--calibration``'s pacing table)."""
    job: Any = prep.shards[role] if role < len(prep.shards) else None
    job = job or next(j for j in prep.stages if j.ctx.rank == role)
    if a.calibration is not None and role >= len(prep.shards):  # a stage: this pacing table
        from runtime.stage.emulation import Calibration

        job = dataclasses.replace(job, calibration=Calibration.load(a.calibration))
    return job


def _torchrun_store(rank: int, world: int, timeout_s: float) -> tuple[Any, int]:
    """torchrun's store under a prefix of this worker group, and the group's number, agreed by
    every host (``(None, 0)``: not under torchrun).

    ``TORCHELASTIC_RESTART_COUNT`` cannot number the groups: torchrun counts the restarts of
    each host's agent, and the agent of a host whose workers did not fail restarts them
    without counting (host A stays at 0 when a rank on host B dies). Every rank adds one to
    a counter in the store as it starts, so group ``k`` is the ranks that found it at
    ``k * world .. (k + 1) * world - 1``; the group's number also prefixes its process group's
    rendezvous (``HETPIPE_ATTEMPT``, :func:`runtime.launch.child.run_rank`).
    """
    if "TORCHELASTIC_RESTART_COUNT" not in os.environ or world <= 1:
        return None, 0
    from torch._C._distributed_c10d import PrefixStore
    from torch.distributed.rendezvous import rendezvous

    wait = timedelta(seconds=max(120.0, 4 * timeout_s))  # for the last rank to finish
    store, _, _ = next(rendezvous("env://", rank, world, timeout=wait))
    attempt = (int(store.add("hetpipe/started", 1)) - 1) // world
    os.environ["HETPIPE_ATTEMPT"] = str(attempt)  # for the process group's store prefix
    return PrefixStore(f"hetpipe/ranks-{attempt}/", store), attempt


def _role(
    a: argparse.Namespace, plan: Plan, prep: Prepared, rank: int, world: int, store: Any
) -> int:
    """The role (launcher rank) this rank runs: the plan's placement on this rank's host.

    Raises:
        ConfigError: ``--host`` names no host of the cluster, the processes per host do not
            match the plan's (:func:`runtime.launch.hosts.assign_roles`).
    """
    from runtime.launch.hosts import assign_roles, host_names, local_host, role_hosts

    nodes = [s.node for s in prep.shards] + [j.ctx.device.split(":")[0] for j in prep.stages]
    roles = role_hosts(plan, nodes)
    names = host_names(plan)
    if a.host is not None and a.host not in names:
        raise ConfigError(
            f"--host {a.host}: the cluster of {a.plan} has no such node or host; "
            f"use one of {', '.join(sorted(set(names.values())))}"
        )
    me = names[a.host] if a.host is not None else local_host(sorted(set(roles)))
    if store is None:
        ranks: list[str | None] = [me] * world if world == 1 else [None] * world
    else:
        store.set(f"host/{rank}", me or "")
        ranks = [store.get(f"host/{r}").decode() or None for r in range(world)]
    if len(set(roles)) > 1 and all(h is None for h in ranks):
        log.warning("no rank knows its host (--host): roles follow torchrun's rank order")
    role = assign_roles(roles, ranks)[rank]
    log.info("host %s: rank %d runs role %d", me or "?", rank, role)
    return role


def _finish(plan: Plan, setup: _Setup, store: Any, rank: int, role: int, wall_s: float) -> int:
    """After this rank's job: say so; rank 0 waits for every rank, then writes what
    ``hetpipe run`` writes (summary table, ``summary.json``, ``weights.pt``, the test
    accuracy) from the ``rank<r>.pt`` files."""
    world = len(setup.prep.shards) + len(setup.prep.stages)
    if store is not None:
        store.set(f"done/{role}", "1")
    if rank != 0 or setup.run.out_dir is None or (store is None and world > 1):
        return 0
    if store is not None:
        store.wait([f"done/{r}" for r in range(world)])
    result = collect(plan, setup, wall_s)
    from rich.console import Console

    from runtime.run import outputs

    console = Console()
    console.print(result.table())
    if (breakdown := result.breakdown_table()) is not None:
        console.print(breakdown)
    out = setup.run.out_dir
    console.print(f"outputs: {', '.join(str(out / f) for f in outputs(result))}", markup=False)
    return 0


def collect(plan: Plan, setup: _Setup, wall_s: float) -> RunResult:
    """The :class:`RunResult` of a torchrun run from its ``out/rank<r>.pt`` files, completed
    and saved as the one-host launcher does (:func:`runtime.launch.launcher.complete`).

    Raises:
        HetPipeRuntimeError: a rank's file is missing (that rank failed).
    """
    from runtime.launch.launcher import build_result, complete, one_vw_result
    from runtime.results.run_result import model_keys

    prep, out = setup.prep, setup.run.out_dir
    if out is None:
        raise ConfigError("collecting a torchrun run's results needs its --out")
    stages, states = _rank_parts(out, len(prep.shards) + len(prep.stages))
    keys = model_keys(ModelSource(ref=plan.model), plan.batch_size)  # every state_dict name
    if layout(setup.rule) == "alone":
        return one_vw_result(plan, prep, stages, setup.run, setup.vw, wall_s, keys)
    result = build_result(plan, prep, stages, states, setup.rule, wall_s, keys)
    if setup.attempt:
        note = f"torchrun restarted the workers {setup.attempt} time(s), from the last snapshot"
        result = dataclasses.replace(result, restarts=(*result.restarts, note))
    return complete(result, plan, ModelSource(ref=plan.model), prep, stages, setup.run)


def _rank_parts(out: Path, ranks: int) -> tuple[list[Any], list[Any]]:
    """The stage results and shard states the ``ranks`` ranks wrote to ``out/rank<r>.pt``.

    Raises:
        HetPipeRuntimeError: a rank's file is missing (that rank failed).
    """
    from runtime.launch.procs import loads_result
    from runtime.results.metrics import StageResult

    results = []
    for r in range(ranks):
        path = out / f"rank{r}.pt"
        if not path.exists():
            raise HetPipeRuntimeError(f"{path}: missing; rank {r} did not finish (see its log)")
        results.append(loads_result(path.read_bytes()))
    stages = [x for x in results if isinstance(x, StageResult)]
    return stages, [x for x in results if not isinstance(x, StageResult)]


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
    from runtime.launch.wsp import shard_specs
    from runtime.results.whole_state import state_keys
    from runtime.stage.model import resolve_source

    D = plan.D if D is None else D
    spec = resolve_source(ModelSource(ref=plan.model), plan.batch_size, meta=True)
    shapes = {n: tuple(p.shape) for n, p in spec.module.named_parameters()}
    specs, ranks = shard_specs(plan, ModelGraph.from_spec(spec), shapes, D)
    stages, states = _rank_parts(out, len(specs) + sum(len(x) for x in ranks))
    result = RunResult.build(plan, nm or plan.nm, D, stages, states, specs, 0.0)
    return dataclasses.replace(result, keys=state_keys(spec.module))  # every state_dict name


def _exit(code: int) -> None:
    """End the rank with ``code`` once its outputs and logs are flushed, without interpreter
    teardown (torchrun reads only the exit code; the one-host launcher's forkserver children
    end the same way).

    A daemon thread that frees a gloo work while the interpreter finalizes aborts the process
    (freeing it releases and retakes the GIL; Python ends the thread inside a C++ destructor:
    "terminate called without an active exception", SIGABRT). A stage's receivers no longer
    outlive its run (:func:`runtime.stage.comm.join_receivers`), but a shard's reader threads
    wait in receives that only the group's teardown ends, and a failed rank's may too.
    """
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    _exit(main())
