"""The one launcher: every plan, every synchronisation rule, one host.

:func:`launch` trains a plan with the rule it names (:func:`planner.sync.effective_rule`:
``wsp`` through parameter-server shards, ``allreduce`` -- the DDP baseline --, or ``local``
for one VW alone), with the same options, progress, failure handling and summary:

1. the run directory is claimed (every rule but ``local`` writes snapshots there: the
   shards, or AllReduce's stages), a resume checked against it (:mod:`runtime.persist`);
2. one attempt: the jobs of every process (:mod:`runtime.launch.jobs`,
   :mod:`runtime.launch.wsp`), started and watched by
   :func:`runtime.launch.supervise.spawn_and_watch`, the results assembled;
3. ``--on-failure restart`` (:class:`runtime.spec.FailurePolicy`): a failed stage's VW restarts alone
   inside the attempt (:mod:`runtime.launch.restart_vw`, one host, ``wsp``); after any other
   process failure (a shard; every failure under the other rules) the whole job starts
   again, from its last committed snapshot when there is one.

Under torchrun, ``python -m runtime`` runs the same jobs one rank at a time.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any

from torch.utils.data import Dataset

from planner.plan import Plan
from planner.rules import ALONE_RULE, layout
from planner.sync import effective_rule
from profiler.errors import ConfigError, HetPipeRuntimeError
from runtime.config import ModelSource, RunConfig
from runtime.data_source import RunData, run_data
from runtime.launch.allreduce import prepare_allreduce
from runtime.launch.failures import Interrupted
from runtime.launch.jobs import Attempt, Prepared, check_alone, prepare_local, with_cards
from runtime.launch.liveness import rendezvous_dir
from runtime.launch.restart_vw import AttemptFailed
from runtime.launch.startup import StartUpLoss
from runtime.launch.supervise import spawn_and_watch
from runtime.launch.wsp import prepare_wsp
from runtime.link_pacing import links_statement
from runtime.persist.run_dir import RunDirectory
from runtime.persist.snapshot import committed_clocks
from runtime.results.metrics import VWResult, warn_overruns
from runtime.results.metrics_log import reset_history
from runtime.results.restarts import restart_notes, whole_vws
from runtime.results.run_result import LostVW, RunResult, evaluate, model_keys
from runtime.results.timeline import describe_run
from runtime.spec import RunSpec
from runtime.stage.model import model_graph, resolve_source
from runtime.stage.nonfinite import REMEDY, Diverged, skip_hint

__all__ = ["build_result", "complete", "launch", "one_vw_result", "prepare"]

log = logging.getLogger(__name__)


def launch(
    plan: Plan,
    source: ModelSource,
    spec: RunSpec | None = None,
    dataset: Dataset[Any] | RunData | None = None,
) -> RunResult:
    """Train ``plan`` on this host with its synchronisation rule.

    Args:
        plan: the plan.
        source: the model.
        spec: how to run it (:class:`runtime.spec.RunSpec`; ``run.steps``/``run.epochs``
            count minibatches per VW, under WSP rounded up to whole waves, and with a time
            limit every VW runs the same waves); ``None``: the defaults.
        dataset: the user's data set, or its training and test sets
            (:class:`runtime.data_source.RunData`); ``None`` = the model's built-in one.

    Returns:
        The :class:`RunResult` (every rule; one VW alone: one entry in ``vws``).

    Raises:
        ConfigError: the plan cannot run as asked (says why and what to change).
        HetPipeRuntimeError: a process failed or died (names it), a disk error.
    """
    spec = spec or RunSpec()
    rule = effective_rule(plan.sync, len(plan.shards), len(plan.virtual_workers), spec.vw)
    _check_rule(rule, spec)
    out = spec.run.out_dir
    if layout(rule) != "alone" and spec.checkpoints.dir is None and out is not None:
        spec = spec.with_checkpoints(dir=out / "checkpoints")
    try:
        return _launch(_Job(plan, source, dataset, rule), spec)
    except Diverged as exc:  # never restarted: name the snapshot to go on from instead
        raise _diverged(exc, spec, rule) from None


@dataclass(frozen=True)
class _Job:
    """What every attempt of one launch trains (``rule``: the effective one; ``owner``: the
    claimed run directory, ``None``: none)."""

    plan: Plan
    source: ModelSource
    dataset: Dataset[Any] | RunData | None
    rule: str
    owner: RunDirectory | None = None


def _launch(job: _Job, spec: RunSpec) -> RunResult:
    """:func:`launch` once its arguments are settled."""
    ck, n_vws = spec.checkpoints, len(job.plan.virtual_workers)
    if layout(job.rule) == "alone":  # no snapshots; the run directory is still this run's
        out = spec.run.out_dir
        claim = RunDirectory(out, resume=False, overwrite=ck.overwrite) if out else nullcontext()
        with claim:
            reset_history(out)
            return _attempt(job, spec)
    run_dir = spec.run.out_dir or ck.dir
    if run_dir is None:
        if ck.resume:
            raise ConfigError("--resume needs the run's directory (--out or a checkpoint folder)")
        if layout(job.rule) != "shards":  # AllReduce: a restart starts again from the beginning
            return _restarting(lambda s, a: _attempt(job, s, a), spec, n_vws)
        return _attempt(job, spec)
    with RunDirectory(run_dir, resume=ck.resume, overwrite=ck.overwrite) as owner:
        if not ck.resume:  # metrics.csv keeps the history of restarts and resumes only
            reset_history(spec.run.out_dir)
        owned = dataclasses.replace(job, owner=owner)
        try:
            return _restarting(lambda s, a: _attempt(owned, s, a), spec, n_vws)
        except KeyboardInterrupt:  # after training (evaluation, outputs): the snapshot stays
            raise HetPipeRuntimeError(
                f"interrupted (Ctrl-C); write the outputs from the last snapshot with: "
                f"{ck.resume_hint} --resume {run_dir}"
            ) from None


def _check_rule(rule: str, spec: RunSpec) -> None:
    """Refuse what ``rule`` cannot do: AllReduce one VW alone; one VW alone what needs
    snapshots (:func:`runtime.launch.jobs.check_alone`).

    Raises:
        ConfigError: says why and what to change.
    """
    if layout(rule) == "ddp" and spec.vw >= 0:
        raise ConfigError("an AllReduce plan trains every device together; drop --vw")
    if layout(rule) == "alone":
        check_alone(spec)


def _restarting(
    attempt: Callable[[RunSpec, dict[int, str]], Any], spec: RunSpec, n_vws: int
) -> RunResult:
    """``--on-failure restart``: after a process failure the attempt did not absorb (a shard;
    a VW restarted alone does not end the attempt), start the whole job again from its last
    committed snapshot (none: from the beginning), up to the policy's budget in all
    (each attempt may restart single VWs with what is left; test faults fire in the first
    attempt only); the result lists the failures survived. A stage lost before the group
    formed (:class:`StartUpLoss`) restarts the job the same way while the budget lasts; under
    ``continue``, or with the budget spent, the job starts again at once without its VW
    (evicted at wave 0, ``attempt``'s second argument: VW -> cause)."""
    restarts: list[str] = []
    absent: dict[int, str] = {}
    policy = spec.failure  # an attempt may restart single VWs with what is left of its budget
    while True:
        try:
            result: RunResult = attempt(spec, absent)
            break
        except HetPipeRuntimeError as exc:
            if isinstance(exc, AttemptFailed):  # VWs it restarted alone before it failed
                restarts.extend(exc.survived)
            if isinstance(exc, StartUpLoss) and _leave_out(exc, spec, absent, n_vws, restarts):
                spec = spec.without_faults()
                continue
            if len(restarts) >= policy.budget or isinstance(exc, Interrupted | Diverged):
                raise
            ckpt = spec.checkpoints.dir
            committed = committed_clocks(ckpt) if ckpt is not None else []
            why = str(exc).split("; resume with:")[0]
            restarts.append(f"{why} (restarted from clock {max(committed, default=0)})")
            log.warning("restart %d of %d from the last snapshot after: %s",
                        len(restarts), policy.budget, restarts[-1])  # fmt: skip
            spec = dataclasses.replace(
                spec.without_faults().with_checkpoints(resume=bool(committed), resume_clock=None),
                failure=policy.spent(len(restarts)),
            )
    if restarts:
        result = dataclasses.replace(result, restarts=(*restarts, *result.restarts))
        if spec.run.out_dir is not None:
            result.save(spec.run.out_dir)  # the summary says what was survived
    return result


def _leave_out(
    exc: StartUpLoss, spec: RunSpec, absent: dict[int, str], n_vws: int, restarts: list[str]
) -> bool:
    """Whether a VW lost at start-up is left out of the next attempt (entered in ``absent``):
    under ``continue``, or ``restart`` with its budget spent (a restart is made instead while
    it lasts), unless no VW would be left."""
    policy = spec.failure
    spent = len(restarts) >= policy.budget
    if not (policy.evict or (policy.restart_vw and spent)) or len(absent | {exc.vw: ""}) >= n_vws:
        return False
    absent[exc.vw] = exc.cause
    log.warning("vw %d lost before the group formed, starting again without it: %s",
                exc.vw, exc.cause)  # fmt: skip
    return True


def _diverged(exc: Diverged, spec: RunSpec, rule: str) -> Diverged:
    """``exc`` (a run that diverged) with the way on: the newest committed snapshot, which
    holds only finite updates (none that diverged was applied), resumed with a smaller lr."""
    what = str(exc).split(REMEDY)[0]
    ckpt = spec.checkpoints.dir
    clocks = committed_clocks(ckpt) if ckpt is not None and layout(rule) != "alone" else []
    if ckpt is None or not clocks:
        how = "no snapshot was committed: start again with a smaller --lr"
    else:
        last = max(clocks)
        how = (
            f"the last good snapshot is clock {last} in {ckpt}; go on from it with a smaller "
            f"--lr: {spec.checkpoints.resume_hint} --resume {ckpt}@{last} --lr LR"
        )
    return Diverged(f"{what}; {how}{skip_hint(spec.run.on_nonfinite)}")


def _attempt(job: _Job, spec: RunSpec, absent: dict[int, str] | None = None) -> RunResult:
    """One attempt: prepare every process's job, run them, assemble the result (the VWs
    ``absent`` lost at start-up by an earlier attempt: VW -> cause)."""
    t_start = time.time()
    plan, run = job.plan, spec.run
    if run.out_dir is not None:
        run.out_dir.mkdir(parents=True, exist_ok=True)
    with rendezvous_dir() as tmp:
        where = Attempt(f"file://{tmp / 'rendezvous'}", job.owner)
        prep = prepare(plan, job.source, spec, job.dataset, where)
        if isinstance(prep, RunResult):  # a resume with nothing left: written from the snapshot
            return prep
        prep = with_cards(prep, tmp)  # one host: sends queue on the simulator's queues
        n_vws = len({j.ctx.vw for j in prep.stages})
        restart_vw = bool(prep.shards) and prep.shards[0].rejoin is not None
        stages, states, lost, restarted = spawn_and_watch(
            prep.shards, prep.stages, run, prep.steps * n_vws, prep.hint,
            evict=spec.failure.evict or restart_vw, restarts=spec.failure.budget, absent=absent,
        )  # fmt: skip
    warn_overruns(stages)
    wall_s = time.time() - t_start
    keys = model_keys(job.source, plan.batch_size)  # the user's state_dict names (tied ones too)
    if layout(job.rule) == "alone":
        return one_vw_result(plan, prep, stages, run, max(spec.vw, 0), wall_s, keys)
    result = build_result(plan, prep, stages, states, job.rule, wall_s, keys)
    if lost:  # --on-failure continue: what was lost, from the shards' ledgers
        last_wave = prep.first_wave + prep.steps // prep.nm
        gone = LostVW.from_shards(lost, [st for st, _ in states], last_wave)
        result = dataclasses.replace(result, lost=gone)
    if restarted:  # --on-failure restart of single VWs: each failure survived, and where
        back = [(r.vw, r.incarnation, r.cause) for r in restarted]
        notes = restart_notes(back, [st for st, _ in states])
        vws = whole_vws(result.vws, back, [st for st, _ in states], prep.first_wave)
        result = dataclasses.replace(result, vws=vws, restarts=(*result.restarts, *notes))
    return complete(result, plan, job.source, prep, stages, run)


def build_result(
    plan: Plan,
    prep: Prepared,
    stages: list[Any],
    states: list[Any],
    rule: str,
    wall_s: float,
    keys: tuple[tuple[str, str], ...],
) -> RunResult:
    """The result of a run of several VWs from its processes' reports (one host, or the
    ``rank<r>.pt`` files of a torchrun run); ``keys``: the user's state_dict names
    (:func:`runtime.results.run_result.model_keys`)."""
    result = RunResult.build(plan, prep.nm, prep.D, stages, states,
                             [s.spec for s in prep.shards], wall_s, sync=rule)  # fmt: skip
    return dataclasses.replace(result, keys=keys, data=prep.data, remedy=_remedy(prep))


def _remedy(prep: Prepared) -> str:
    """The staleness remedy the stages ran with (``--remedy``; every stage takes the same)."""
    return prep.stages[0].optimizer.remedy if prep.stages else "none"


def complete(
    result: RunResult,
    plan: Plan,
    source: ModelSource,
    prep: Prepared,
    stages: list[Any],
    run: RunConfig,
) -> RunResult:
    """What every run's result ends with: the time limit's note, the test accuracy and, with
    ``--out``, the outputs (summary, weights, metrics, timelines)."""
    ran = {st.steps for st in stages}
    if run.time_limit_s > 0 and ran and max(ran) < prep.steps:
        waves = prep.first_wave + max(ran) // prep.nm
        note = f"time limit {run.time_limit_s:g} s: every VW stopped after wave {waves}"
        result = dataclasses.replace(result, stopped_by=note)
    if prep.test is not None:
        acc, loss = evaluate(source, plan.batch_size, run.seed, result.state_dict(), prep.test)
        result = dataclasses.replace(result, test_accuracy=acc, test_loss=loss)
    result = dataclasses.replace(result, links=links_statement(plan.cluster, run.emulate))
    if run.out_dir is not None:
        result.save(run.out_dir, about=describe_run(plan))
    return result


def prepare(
    plan: Plan,
    source: ModelSource,
    spec: RunSpec,
    dataset: Dataset[Any] | RunData | None,
    where: Attempt,
) -> Prepared | RunResult:
    """Every process's job under the plan's rule (one host, or every torchrun rank alike); a
    resume with nothing left to train returns the result written from the snapshot instead."""
    rule = effective_rule(plan.sync, len(plan.shards), len(plan.virtual_workers), spec.vw)
    model = resolve_source(source, plan.batch_size, meta=source.module is None)
    loss = source.loss if source.loss is not None else model.loss
    graph = model_graph(source, model) if source.module is not None else None  # captured once
    data = run_data(dataset, source.name, model, plan.batch_size, loss, graph)
    how = layout(rule)
    if how == "alone":  # no dataset given: each stage builds the built-in one itself
        mine = data.train if dataset is not None else None
        n = len(data.train)  # type: ignore[arg-type]
        prep: Prepared | RunResult = prepare_local(plan, source, spec, mine, n, where.init_method)
    elif how == "ddp":
        prep = prepare_allreduce(plan, source, spec, data, where)
    else:
        prep = prepare_wsp(plan, source, spec, data, where)
    return dataclasses.replace(prep, data=data.label) if isinstance(prep, Prepared) else prep


def one_vw_result(
    plan: Plan,
    prep: Prepared,
    stages: list[Any],
    run: RunConfig,
    vw: int,
    wall_s: float,
    keys: tuple[tuple[str, str], ...],
) -> RunResult:
    """One VW alone: its result (with the paced pipeline's bound) and, with ``--out``, its
    metrics, timeline, weights and summary."""
    bound = 0.0
    cal = prep.stages[0].calibration
    if cal is not None:
        slowest = max(cal.task_s(j.ctx.stage, "FB") / j.ctx.speed for j in prep.stages)
        bound = plan.batch_size / slowest
    predicted = plan.virtual_workers[vw].throughput
    devices = tuple(j.ctx.device for j in prep.stages)
    one = VWResult(tuple(stages), plan.batch_size, prep.nm, predicted, wall_s, bound, devices)
    result = RunResult((one,), prep.nm, 0, (), (), (), wall_s, predicted, sync=ALONE_RULE,
                       sync_params=plan.sync_params, keys=keys, data=prep.data,
                       remedy=_remedy(prep),
                       links=links_statement(plan.cluster, run.emulate))  # fmt: skip
    if run.out_dir is not None:
        result.save(run.out_dir, about=describe_run(plan, vw))
    return result
