"""The one launcher: every plan, every synchronisation rule, one host.

:func:`launch` trains a plan with the rule it names (:func:`planner.sync.effective_rule`:
``wsp`` through parameter-server shards, ``allreduce`` -- the DDP baseline --, or ``local``
for one VW alone), with the same options, progress, failure handling and summary:

1. the run directory is claimed (a rule with shards: they write the snapshots), a resume
   checked against it (:mod:`runtime.persist`);
2. one attempt: the jobs of every process (:mod:`runtime.launch.jobs`,
   :mod:`runtime.launch.wsp`), started and watched by
   :func:`runtime.launch.supervise.spawn_and_watch`, the results assembled;
3. ``--on-failure restart`` (``WSPConfig.max_restarts``): after a process failure the whole
   job starts again, from its last committed snapshot when there is one.

Under torchrun, ``python -m runtime`` runs the same jobs one rank at a time.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable
from typing import Any, TypeVar

from torch.utils.data import Dataset

from planner.plan import Plan
from planner.sync import RULES, effective_rule
from profiler.errors import ConfigError, HetPipeRuntimeError
from runtime.config import ModelSource, OptimizerConfig, RunConfig, WSPConfig
from runtime.data import default_dataset
from runtime.launch.failures import Interrupted
from runtime.launch.jobs import Prepared, prepare_allreduce, prepare_local
from runtime.launch.liveness import rendezvous_dir
from runtime.launch.supervise import spawn_and_watch
from runtime.launch.wsp import prepare_wsp
from runtime.persist.checkpoint import atomic_torch_save
from runtime.persist.run_dir import RunDirectory, RunOwner
from runtime.persist.snapshot import committed_clocks
from runtime.results.metrics import RunResult, warn_overruns, write_metrics
from runtime.results.timeline import describe_run, write_timeline
from runtime.results.wsp import LostVW, WSPResult, evaluate
from runtime.stage.model import resolve_source

__all__ = ["launch", "prepare"]

log = logging.getLogger(__name__)

R = TypeVar("R", RunResult, WSPResult)


def launch(
    plan: Plan,
    source: ModelSource,
    optimizer: OptimizerConfig | None = None,
    run: RunConfig | None = None,
    cfg: WSPConfig | None = None,
    dataset: Dataset[Any] | None = None,
    vw: int = -1,
) -> RunResult | WSPResult:
    """Train ``plan`` on this host with its synchronisation rule.

    Args:
        plan: the plan.
        source: the model.
        optimizer: each stage's local optimizer (SGD lr 0.05 by default).
        run: run settings (``steps``/``epochs`` count minibatches per VW; under WSP rounded up
            to whole waves, and with ``time_limit_s`` every VW runs the same waves).
        cfg: settings of a run of several VWs (D, checkpoints, resume, restarts, test hooks).
        dataset: the user's data set (``None`` = the model's built-in one).
        vw: train only this VW, alone (``-1`` = every VW).

    Returns:
        One VW alone: its :class:`RunResult`; several VWs: the :class:`WSPResult`.

    Raises:
        ConfigError: the plan cannot run as asked (says why and what to change).
        HetPipeRuntimeError: a process failed or died (names it), a disk error.
    """
    optimizer, run, cfg = optimizer or OptimizerConfig(), run or RunConfig(), cfg or WSPConfig()
    rule = effective_rule(plan.sync, len(plan.shards), len(plan.virtual_workers), vw)
    if rule == "allreduce" and vw >= 0:
        raise ConfigError("an AllReduce plan trains every device together; drop --vw")
    if rule == "local" and cfg.resume:
        raise ConfigError(
            "--resume needs parameter-server shards (they write the checkpoints); this run "
            "trains one VW without them (plan it with 'hetpipe plan', which places shards)"
        )
    if not RULES[rule].uses_shards:  # no snapshots; the run directory is still this run's
        one_vw = rule == "local"

        def attempt(c: WSPConfig) -> Any:
            return _attempt(plan, source, optimizer, run, c, dataset, None, rule, max(vw, 0))

        if run.out_dir is None:
            return attempt(cfg) if one_vw else _restarting(attempt, run, cfg)
        with RunDirectory(run.out_dir, resume=False, overwrite=cfg.overwrite):
            return attempt(cfg) if one_vw else _restarting(attempt, run, cfg)
    if cfg.checkpoint_dir is None and run.out_dir is not None:
        cfg = dataclasses.replace(cfg, checkpoint_dir=run.out_dir / "checkpoints")
    run_dir = run.out_dir or cfg.checkpoint_dir
    if run_dir is None:
        if cfg.resume:
            raise ConfigError("--resume needs the run's directory (--out or a checkpoint folder)")
        return _attempt(plan, source, optimizer, run, cfg, dataset, None, rule)
    with RunDirectory(run_dir, resume=cfg.resume, overwrite=cfg.overwrite) as owner:
        try:
            return _restarting(
                lambda c: _attempt(plan, source, optimizer, run, c, dataset, owner, rule), run, cfg
            )
        except KeyboardInterrupt:  # after training (evaluation, outputs): the snapshot stays
            raise HetPipeRuntimeError(
                f"interrupted (Ctrl-C); write the outputs from the last snapshot with: "
                f"{cfg.resume_hint} --resume {run_dir}"
            ) from None


def _restarting(attempt: Callable[[WSPConfig], Any], run: RunConfig, cfg: WSPConfig) -> WSPResult:
    """``--on-failure restart``: after a process failure, start the whole job again from its
    last committed snapshot (none: from the beginning), up to ``cfg.max_restarts`` times
    (test faults fire in the first attempt only); the result lists the failures survived."""
    restarts: list[str] = []
    while True:
        try:
            result: WSPResult = attempt(cfg)
            break
        except HetPipeRuntimeError as exc:
            if len(restarts) >= cfg.max_restarts or isinstance(exc, Interrupted):
                raise
            ckpt = cfg.checkpoint_dir
            committed = committed_clocks(ckpt) if ckpt is not None else []
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


def _attempt(
    plan: Plan,
    source: ModelSource,
    optimizer: OptimizerConfig,
    run: RunConfig,
    cfg: WSPConfig,
    dataset: Dataset[Any] | None,
    owner: RunDirectory | None,
    rule: str,
    vw: int = 0,
) -> Any:
    """One attempt: prepare every process's job, run them, assemble the result."""
    t_start = time.time()
    if run.out_dir is not None:
        run.out_dir.mkdir(parents=True, exist_ok=True)
    with rendezvous_dir() as tmp:
        init_method = f"file://{tmp / 'rendezvous'}"
        prep = prepare(plan, source, optimizer, run, cfg, dataset, owner, rule, vw, init_method)
        if isinstance(prep, WSPResult):  # a resume with nothing left: written from the snapshot
            return prep
        n_vws = len({j.ctx.vw for j in prep.stages})
        stages, states, lost = spawn_and_watch(prep.shards, prep.stages, run, prep.steps * n_vws,
                                               prep.hint, evict=cfg.evict)  # fmt: skip
    warn_overruns(stages)
    wall_s = time.time() - t_start
    if rule == "local":
        return _one_vw_result(plan, prep, stages, run, vw, wall_s)
    result = WSPResult.build(plan, prep.nm, prep.D, stages, states,
                             [s.spec for s in prep.shards], wall_s, sync=rule)  # fmt: skip
    if lost:  # --on-failure continue: what was lost, from the shards' ledgers
        last_wave = prep.first_wave + prep.steps // prep.nm
        gone = LostVW.from_shards(lost, [st for st, _ in states], last_wave)
        result = dataclasses.replace(result, lost=gone)
    ran = {st.steps for st in stages}
    if run.time_limit_s > 0 and ran and max(ran) < prep.steps:
        waves = prep.first_wave + max(ran) // prep.nm
        note = f"time limit {run.time_limit_s:g} s: every VW stopped after wave {waves}"
        result = dataclasses.replace(result, stopped_by=note)
    if prep.test is not None:
        acc, loss = evaluate(source, plan.batch_size, run.seed, result.state_dict(), prep.test)
        result = dataclasses.replace(result, test_accuracy=acc, test_loss=loss)
    if run.out_dir is not None:
        result.save(run.out_dir, about=describe_run(plan))
    return result


def prepare(
    plan: Plan,
    source: ModelSource,
    optimizer: OptimizerConfig,
    run: RunConfig,
    cfg: WSPConfig,
    dataset: Dataset[Any] | None,
    owner: RunOwner | None,
    rule: str,
    vw: int,
    init_method: str,
) -> Prepared | WSPResult:
    """Every process's job under ``rule`` (one host, or every torchrun rank alike); a resume
    with nothing left to train returns the result written from the snapshot instead."""
    spec = resolve_source(source, plan.batch_size, meta=source.module is None)
    ds = dataset if dataset is not None else default_dataset(
        source.name, spec.inputs, spec.targets, plan.batch_size
    )  # fmt: skip
    if rule == "local":  # dataset None: each stage builds the built-in one itself
        n = len(ds)  # type: ignore[arg-type]
        return prepare_local(plan, source, optimizer, run, cfg, dataset, n, vw, init_method)
    if rule == "allreduce":
        return prepare_allreduce(plan, source, optimizer, run, cfg, ds, init_method)
    return prepare_wsp(plan, source, optimizer, run, cfg, ds, owner, init_method)


def _one_vw_result(
    plan: Plan, prep: Prepared, stages: list[Any], run: RunConfig, vw: int, wall_s: float
) -> RunResult:
    """One VW alone: its result (with the paced pipeline's bound) and, with ``--out``, its
    metrics, timeline and weights."""
    bound = 0.0
    cal = prep.stages[0].calibration
    if cal is not None:
        slowest = max(cal.task_s(j.ctx.stage, "FB") / j.ctx.speed for j in prep.stages)
        bound = plan.batch_size / slowest
    predicted = plan.virtual_workers[vw].throughput
    result = RunResult(tuple(stages), plan.batch_size, prep.nm, predicted, wall_s, bound)
    if run.out_dir is not None:
        write_metrics(result, run.out_dir)
        write_timeline(result.stages, run.out_dir, about=describe_run(plan, vw))
        atomic_torch_save(result.state_dict(), run.out_dir / "weights.pt")
    return result
