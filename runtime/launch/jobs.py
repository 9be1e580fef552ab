"""What one attempt of a run starts: every process's job, per synchronisation rule.

:func:`prepare` turns a plan into the frozen jobs of its processes (stages, and shards for a
rule that goes through them) plus what the result needs; the rule decides only the data each
VW trains on, the steps, the :class:`runtime.sync.rule.SyncSpec` and whether shards run. The
WSP part (shards, snapshots, resume) is :mod:`runtime.launch.wsp`, the AllReduce part
:mod:`runtime.launch.allreduce`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torch.utils.data import Dataset

from planner.plan import Plan
from planner.rules import ALONE_RULE
from planner.sync import data_slice
from profiler.errors import ConfigError
from runtime.config import ModelSource
from runtime.data import stage_view
from runtime.launch.procs import ShardJob
from runtime.launch.roles import pacing_table, stage_contexts, total_steps
from runtime.persist.run_dir import RunOwner
from runtime.send_queues import make_card
from runtime.spec import RunSpec
from runtime.stage.emulation import Calibration
from runtime.stage.job import StageJob
from runtime.stage.model import ship_stage
from runtime.stage.weights import predict_syncing
from runtime.sync.rule import SyncSpec

__all__ = [
    "Attempt",
    "Prepared",
    "Work",
    "check_alone",
    "prepare_local",
    "vw_stage_jobs",
    "with_cards",
    "with_world",
]


@dataclass(frozen=True)
class Prepared:
    """One attempt's processes and what its result needs.

    Attributes:
        shards: the shard processes' jobs (none for a rule without shards).
        stages: the stage processes' jobs, in rank order.
        steps: minibatches each VW trains in this attempt.
        first_wave: the wave it starts at (a resumed run's snapshot clock).
        nm, D: minibatches per wave and the WSP threshold the run uses.
        test: the held-out split for the final accuracy (``None``: none).
        hint: what a failure message ends with (``; resume with: ...``).
        data: what the run trains on, for the summary
            (:attr:`runtime.data_source.RunData.label`).
    """

    shards: tuple[ShardJob, ...]
    stages: tuple[StageJob, ...]
    steps: int
    first_wave: int
    nm: int
    D: int
    test: Dataset[Any] | None = None
    hint: str = ""
    data: str = ""


@dataclass(frozen=True)
class Attempt:
    """Where one attempt's processes meet: the process group's ``init_method`` and the claimed
    run directory (``None``: none, or not this process's to tidy)."""

    init_method: str
    owner: RunOwner | None = None


@dataclass(frozen=True)
class Work:
    """What the stages of one attempt train.

    Attributes:
        data: each VW's training set (``None``: the model's built-in one), in ``vws`` order.
        steps: minibatches each VW trains.
        nm: minibatches in flight per VW.
        init_method: the process group's rendezvous.
        first_rank: the first stage's rank (the shards take the ranks before).
        vws: the VWs that train (``()``: every VW of the plan).
    """

    data: tuple[Any, ...]
    steps: int
    nm: int
    init_method: str
    first_rank: int = 0
    vws: tuple[int, ...] = ()


def vw_stage_jobs(
    plan: Plan, source: ModelSource, spec: RunSpec, sync: SyncSpec, work: Work
) -> list[StageJob]:
    """Every stage's job, VW by VW from ``work.first_rank`` (``world_size`` left to the caller);
    each takes only its sections of ``spec`` (run, optimizer, its test fault) and, of a user's
    module, its stage alone (:func:`runtime.stage.model.ship_stage`).

    ``work.data[i]`` is VW ``work.vws[i]``'s training set, of which each stage gets only what
    it reads (:func:`runtime.data.stage_view`: middle stages nothing); a rule whose data is ``global``
    (``allreduce``, ``backup``) gives every VW the same set and its slice of each global
    minibatch (:func:`planner.sync.data_slice`).
    """
    vws = work.vws or tuple(range(len(plan.virtual_workers)))
    run, jobs = spec.run, list[StageJob]()
    syncing = predict_syncing(sync, len(plan.virtual_workers))  # --remedy predict's count
    for i, k in enumerate(vws):
        ctxs = stage_contexts(plan, k, work.nm, work.steps, work.first_rank + len(jobs))
        ctxs = [dataclasses.replace(c, syncing=syncing) for c in ctxs]
        vw_run = run
        if run.out_dir is not None and sync.layout != "alone":
            vw_run = dataclasses.replace(run, out_dir=run.out_dir / f"vw{k}")
        cal: Calibration | None = pacing_table(plan, source, ctxs, vw_run)
        part = data_slice(sync.rule, i, len(vws))
        for ctx in ctxs:
            shipped = ship_stage(source, ctx.batch_size, ctx.cuts, ctx.stage)
            data = stage_view(work.data[i], ctx.stage, ctx.n_stages)
            job = StageJob(ctx, shipped, spec.optimizer, run, sync, data, part, cal,
                           spec.faults.stage_fault, work.init_method)  # fmt: skip
            jobs.append(job)
    return jobs


def with_world(jobs: list[StageJob], n_shards: int = 0) -> tuple[int, tuple[StageJob, ...]]:
    """The process group's size (``n_shards`` shards, then the stages) and the stages' jobs
    with it set (shards take ranks ``0..n_shards-1``)."""
    world = n_shards + len(jobs)
    return world, tuple(dataclasses.replace(j, world_size=world) for j in jobs)


def with_cards(prep: Prepared, folder: Path) -> Prepared:
    """``prep`` with each paced stage given its node card's queue file in ``folder`` (one per
    node, made here; ``folder`` is the launch's, removed with it): the processes of one
    host then charge their sends on the queues the simulator charges
    (:mod:`runtime.send_queues`)."""
    files: dict[str, str] = {}
    stages = []
    for job in prep.stages:
        links = job.ctx.links
        if links.paced:
            node = job.ctx.device.rpartition(":")[0]  # the device label is NODE:INDEX
            if node not in files:
                files[node] = str(folder / f"card-{len(files)}")
                make_card(Path(files[node]))
            links = dataclasses.replace(links, card_file=files[node])
            job = dataclasses.replace(job, ctx=dataclasses.replace(job.ctx, links=links))
        stages.append(job)
    return dataclasses.replace(prep, stages=tuple(stages))


def check_alone(spec: RunSpec, every_given: bool = False) -> None:
    """Refuse what a run of one VW alone (the ``local`` rule: ``--vw K``, or a plan without
    shards) cannot do: such a run measures that VW's pipeline (its throughput against the
    plan's prediction, its losses) and its weights never reach the parameter servers, so it
    writes no snapshots, and so cannot resume or restart from one (``every_given``: the user
    asked for ``--checkpoint-every`` explicitly; its default is ignored silently).

    Raises:
        ConfigError: one line naming the flag and the way out.
    """
    asked = [("--resume", spec.checkpoints.resume), ("--checkpoint-every", every_given),
             ("--on-failure restart", spec.failure.budget > 0),
             ("--on-failure continue", spec.failure.evict)]  # fmt: skip
    for flag, given in asked:
        if given:
            raise ConfigError(
                f"{flag}: one VW trained alone (--vw K, or a plan without shards) measures that "
                "VW and its weights never reach the parameter servers, so it writes no snapshots; "
                f"drop {flag}, or train the whole plan (one VW with shards: hetpipe plan --vws 1)"
            )


def prepare_local(
    plan: Plan,
    source: ModelSource,
    spec: RunSpec,
    dataset: Dataset[Any] | None,
    samples: int,
    init_method: str,
) -> Prepared:
    """The ``local`` rule: VW ``max(spec.vw, 0)`` alone on the whole data set (``dataset``
    ``None``: each stage builds the model's built-in one), no shards, no test split."""
    if samples < plan.batch_size:
        raise ConfigError(
            f"the data set has {samples} samples, fewer than one minibatch of {plan.batch_size}"
        )
    nm = spec.run.nm or plan.nm
    steps = total_steps(spec.run, samples // plan.batch_size)
    sync = SyncSpec(ALONE_RULE, plan.sync_params, timeout_s=spec.run.timeout_s)
    work = Work((dataset,), steps, nm, init_method, vws=(max(spec.vw, 0),))
    jobs = vw_stage_jobs(plan, source, spec, sync, work)
    return Prepared((), with_world(jobs)[1], steps, 0, nm, 0)
