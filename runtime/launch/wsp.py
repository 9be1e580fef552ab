"""The ``wsp`` rule's part of a launch: parameter-server shards, data shards, snapshots, resume
(paper Sec. 5 and 8.1).

The shards get ranks ``0 .. n_shards-1`` (placed per the plan's ``shards``), the stages of
every virtual worker the following ranks, VW by VW, all in one gloo process group. Each stage
trains its partition with exact local staleness and synchronises through
:class:`runtime.sync.wave.WaveSync`: a push per wave, a pull when the WSP rule needs one. Each
VW trains on its own disjoint shard of the training data; a held-out test split measures the
exported model at the end. :mod:`runtime.launch.launcher` starts and watches the processes.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from torch.utils.data import Dataset, Subset

from planner.plan import Plan
from planner.rules import get_rule
from planner.sync import check_time_limit
from planner.wsp import whole_waves
from profiler.errors import ConfigError
from profiler.graph import ModelGraph
from runtime.config import ModelSource, RunConfig
from runtime.data_source import RunData
from runtime.launch.jobs import Attempt, Prepared, Work, vw_stage_jobs, with_world
from runtime.launch.procs import ShardJob
from runtime.persist.run_dir import RunOwner, check_settings, job_settings
from runtime.persist.snapshot import Manifest, SnapshotSpec, clean, select
from runtime.ps.layout import ShardSpec, shard_specs_for_layout
from runtime.ps.rejoin import Rejoin
from runtime.results.evaluation import shard_dataset
from runtime.results.export import export_snapshot
from runtime.results.run_result import RunResult
from runtime.spec import RunSpec
from runtime.stage.job import StageJob
from runtime.stage.model import model_graph, resolve_source
from runtime.sync.rule import SyncSpec

__all__ = [
    "prepare_wsp",
    "resume_from",
    "shard_specs",
    "snapshot_parts",
    "split_data",
    "vw_training_data",
    "wsp_steps",
]

log = logging.getLogger(__name__)


def split_data(
    dataset: Dataset[Any] | RunData, n_vws: int, test_fraction: float, seed: int = 0
) -> tuple[list[Subset[Any]], Subset[Any]]:
    """Disjoint training shards (one per VW) and the test set: the user's, or the held-out
    split (:func:`runtime.results.evaluation.split_dataset`, the split every run uses)."""
    train, test = _as_data(dataset).split(test_fraction, seed)
    return shard_dataset(train, n_vws), test


def _as_data(dataset: Dataset[Any] | RunData) -> RunData:
    """``dataset`` as a :class:`RunData` (a plain data set: its test split held out)."""
    return dataset if isinstance(dataset, RunData) else RunData(dataset)


def vw_training_data(
    rule: str, dataset: Dataset[Any] | RunData, n_vws: int, test_fraction: float, seed: int = 0
) -> tuple[list[Subset[Any]], Subset[Any], int]:
    """Each VW's training set under ``rule`` (:attr:`planner.rules.SyncRule.data`: its own
    shard, or the whole split it takes a slice of every minibatch from), the test set, and
    the samples one VW sees per epoch."""
    if get_rule(rule).data == "global":
        train, test = _as_data(dataset).split(test_fraction, seed)
        return [train] * n_vws, test, len(train) // n_vws
    shards, test = split_data(dataset, n_vws, test_fraction, seed)
    return shards, test, min(len(s) for s in shards)


def shard_specs(
    plan: Plan, graph: ModelGraph, param_shapes: dict[str, tuple[int, ...]], D: int
) -> tuple[tuple[ShardSpec, ...], list[list[int]]]:
    """Every shard's spec (shards on ranks ``0..n-1``) and each VW's stage ranks after them."""
    n_shards = len(plan.shards)
    if n_shards == 0:
        raise ConfigError("the plan has no parameter-server shards; re-run 'hetpipe plan'")
    ranks, r = [], n_shards
    for vw in plan.virtual_workers:
        ranks.append(list(range(r, r + len(vw.stages))))
        r += len(vw.stages)
    specs = shard_specs_for_layout(
        [(lay.name, lay.params) for lay in graph.layers],
        param_shapes,
        [sh.layers for sh in plan.shards],
        [[(st.first_index, st.last_index) for st in vw.stages] for vw in plan.virtual_workers],
        list(range(n_shards)),
        ranks,
        D=D,
    )
    return specs, ranks


def prepare_wsp(
    plan: Plan, source: ModelSource, spec: RunSpec, dataset: RunData, where: Attempt
) -> Prepared | RunResult:
    """The ``wsp`` rule's processes: the shards (ranks ``0..n-1``) and every VW's stages, each
    VW on its own shard of the training split; a resumed run starts at its snapshot's wave.
    A resume with nothing left to train writes the outputs from the snapshot and returns that
    result instead (:func:`runtime.results.export.export_snapshot`).

    Raises:
        ConfigError: bad settings, a mismatched resume, nothing to train.
    """
    run, ck = spec.run, spec.checkpoints
    nm = run.nm or plan.nm
    info = get_rule(plan.sync)  # a rule through the shards (runtime.run.rule_for)
    rule = info.name
    D = (plan.D if spec.sync.D is None else spec.sync.D) if info.keeps_D else 0  # others: 0
    if spec.failure.evict and not info.evicts:
        raise ConfigError(
            f"--on-failure continue evicts a VW from the WSP clock; the {rule} rule has no such "
            "clock: use --sync wsp, or --on-failure stop|restart"
        )
    model = resolve_source(source, plan.batch_size, meta=source.module is None)
    test_fraction = spec.data.test_fraction
    shards_data, test, vw_samples = vw_training_data(
        rule, dataset, len(plan.virtual_workers), test_fraction, run.seed
    )
    graph = model_graph(source, model)
    shapes = {n: tuple(p.shape) for n, p in model.module.named_parameters()}
    specs, _ = shard_specs(plan, graph, shapes, D)
    horizon = wsp_steps(run, nm, 0, vw_samples, plan.batch_size)
    settings = job_settings(source.name, plan.to_json(), nm, D, run.seed, test_fraction,
                            dataset.settings, spec.optimizer, horizon, run.precision)  # fmt: skip
    manifest = resume_from(spec, where.owner, settings)
    clock = manifest.clock if manifest is not None else 0
    first_wave = clock * info.waves_per_clock(dict(plan.sync_params))  # easgd: tau per tick
    _tidy(plan, spec, where.owner, clock)
    steps = wsp_steps(run, nm, first_wave, vw_samples, plan.batch_size)
    if steps == 0 and manifest is not None:
        return export_snapshot(manifest, plan, source, run, specs, test, nm, D)
    if steps == 0:
        raise ConfigError("nothing to train: raise --steps or --epochs")
    snaps = _snapshots(plan, spec, where.owner, settings)
    check_time_limit(rule, run.time_limit_s)
    sync = SyncSpec(rule, plan.sync_params, D, specs, snaps, first_wave, spec.sync.overlap_pulls,
                    run.timeout_s, last_wave=first_wave + steps // nm)  # fmt: skip
    work = Work(tuple(shards_data), steps, nm, where.init_method, first_rank=len(specs))
    shards, stages = _jobs(plan, source, spec, sync, work, _alone(plan, graph, spec))
    hint = ""
    if snaps is not None and ck.every > 0:
        hint = f"; resume with: {ck.resume_hint} --resume {ck.dir}"
    return Prepared(shards, stages, steps, first_wave, nm, D, test, hint)


def _tidy(plan: Plan, spec: RunSpec, owner: RunOwner | None, clock: int) -> None:
    """Clean the checkpoint folder past the resume ``clock`` and save the plan beside the
    outputs (one process of the job tidies; ``--resume`` reuses the saved plan)."""
    ck, out = spec.checkpoints, spec.run.out_dir
    tidies = owner is None or owner.tidies
    if ck.dir is not None and tidies:
        clean(ck.dir, clock if ck.resume else None)
    if owner is not None and owner.tidies and out is not None and not ck.resume:
        plan.save(out / "plan.json")


def _snapshots(
    plan: Plan, spec: RunSpec, owner: RunOwner | None, settings: tuple[tuple[str, str], ...]
) -> SnapshotSpec | None:
    """The run's snapshots (``None``: no checkpoint folder or no owner to name the run)."""
    ck = spec.checkpoints
    if ck.dir is None or owner is None:
        return None
    return SnapshotSpec(ck.dir, owner.run_id, owner.attempt, snapshot_parts(plan), settings,
                        ck.every, ck.keep, spec.faults.write_fault)  # fmt: skip


def _alone(plan: Plan, graph: ModelGraph, spec: RunSpec) -> bool:
    """Whether ``--on-failure restart`` may restart a failed stage's VW alone: not when a VW
    holds tied parameters on several stages (nor when a test asks for whole-job restarts)."""
    if not spec.failure.restart_vw or spec.faults.whole_job_restarts:
        return False
    if any(graph.shared_params(c) for c in _vw_cuts(plan)):
        log.warning("a VW holds tied parameters on several stages (summed point-to-point in "
                    "the first process group): a failure restarts the whole job")  # fmt: skip
        return False
    return True


def _jobs(
    plan: Plan, source: ModelSource, spec: RunSpec, sync: SyncSpec, work: Work, alone: bool
) -> tuple[tuple[ShardJob, ...], tuple[StageJob, ...]]:
    """The shards' jobs (ranks ``0..n-1``) and every VW's stages' (the next ranks); ``alone``:
    a failed VW may restart alone (:func:`_alone`)."""
    specs = sync.shards
    world, stages = with_world(vw_stage_jobs(plan, source, spec, sync, work), len(specs))
    rejoin = _rejoin(sync, work.init_method, world) if alone else None
    evict = spec.failure.evict or rejoin is not None
    shards = tuple(
        ShardJob(
            k,
            s,
            plan.shards[k].node,
            source,
            plan.batch_size,
            spec.run.seed,
            sync,
            spec.checkpoints.resume,
            work.init_method,
            world,
            spec.faults.shard_fault,
            _peers(s, specs) if evict else None,
            rejoin,
        )
        for k, s in enumerate(specs)
    )
    log.info("%d VWs x %s stages, %d shards, Nm %d, D %d, %d minibatches per VW",
             len(plan.virtual_workers), [len(v.stages) for v in plan.virtual_workers],
             len(shards), work.nm, sync.D, work.steps)  # fmt: skip
    return shards, stages


def _peers(spec: ShardSpec, specs: tuple[ShardSpec, ...]) -> tuple[tuple[int, int], ...]:
    """``--on-failure continue`` (or a VW restart): (id, rank) of the other shards, which
    gate each wave."""
    return tuple((s.id, s.rank) for s in specs if s.id != spec.id)


def _vw_cuts(plan: Plan) -> list[list[int]]:
    """Each VW's cut points (the first layer index of every stage after its first)."""
    return [[st.first_index for st in vw.stages[1:]] for vw in plan.virtual_workers]


def _rejoin(sync: SyncSpec, init_method: str, world: int) -> Rejoin | None:
    """``--on-failure restart`` on one host under WSP: where a restarted VW meets the shards
    (beside the rendezvous file); ``None`` otherwise (torchrun restarts the whole group)."""
    if not get_rule(sync.rule).evicts or not init_method.startswith("file://"):
        return None
    folder = Path(init_method.removeprefix("file://")).parent
    return Rejoin(str(folder / "rejoin"), world, 4 * sync.timeout_s)


def snapshot_parts(plan: Plan) -> tuple[str, ...]:
    """The parts of one snapshot of ``plan``'s job: every shard's and every stage's."""
    parts = [f"shard-{k}" for k in range(len(plan.shards))]
    parts += [f"vw{k}-stage{s}" for k, vw in enumerate(plan.virtual_workers) for s in range(len(vw.stages))]  # fmt: skip
    return tuple(parts)


def resume_from(
    spec: RunSpec, owner: RunOwner | None, settings: tuple[tuple[str, str], ...]
) -> Manifest | None:
    """The snapshot a resume starts from (verified, of this run, with the same settings)."""
    ck = spec.checkpoints
    if not ck.resume or ck.dir is None:
        return None
    manifest, skipped = select(ck.dir, ck.resume_clock)
    for s in skipped:
        log.warning("resume: skipped %s; using clock %d", s, manifest.clock)
    where = f"--resume {manifest.path}"
    if owner is not None:
        if owner.run_id and owner.run_id != manifest.run_id:
            raise ConfigError(
                f"{where}: the snapshot belongs to run {manifest.run_id}, the directory to run "
                f"{owner.run_id}; resume from that run's own directory"
            )
        owner.write_run_file(manifest.run_id)
    check_settings(where, manifest.settings, settings)
    return manifest


def wsp_steps(run: RunConfig, nm: int, first_wave: int, vw_samples: int, batch_size: int) -> int:
    """Minibatches each VW trains in this run: whole waves, after the resumed ones (0: the
    snapshot already holds every wave asked for).

    Raises:
        ConfigError: less than one minibatch per VW.
    """
    per_epoch = vw_samples // batch_size
    if per_epoch < 1:
        raise ConfigError(
            f"each VW gets {vw_samples} samples, fewer than one minibatch of {batch_size}: "
            "lower --batch-size or use fewer VWs"
        )
    if run.steps or run.epochs:
        steps = run.steps or max(1, round(run.epochs * per_epoch))
    else:
        steps = 2**62 if run.time_limit_s > 0 else per_epoch
    steps = whole_waves(steps, nm)  # every VW pushes the same waves
    return max(0, steps - first_wave * nm)
