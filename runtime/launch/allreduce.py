"""The ``allreduce`` rule's part of a launch: the DDP baseline's data, steps and snapshots.

Every VW (one per device, :func:`planner.baseline.allreduce_plan`) trains its slice of each
global minibatch of the training split, ``Nm = 1``; a held-out split measures the final
model. There are no shards: the stages hold the model, and with a run directory they write
the snapshots (:mod:`runtime.sync.allreduce_snapshot`) through the same machinery as WSP's
(:class:`runtime.persist.snapshot.SnapshotSpec`, one manifest per clock; a step is a clock),
so ``--resume`` and ``--on-failure restart`` go on from the newest committed snapshot.
"""

from __future__ import annotations

from planner.plan import Plan
from profiler.errors import ConfigError
from runtime.config import ModelSource
from runtime.data_source import RunData
from runtime.launch.jobs import Attempt, Prepared, Work, vw_stage_jobs, with_world
from runtime.launch.roles import total_steps
from runtime.launch.wsp import resume_from, snapshot_parts
from runtime.persist.run_dir import RunOwner, job_settings
from runtime.persist.snapshot import SnapshotSpec, clean, read_manifest, snapshot_dir
from runtime.results.export import export_snapshot
from runtime.results.run_result import RunResult
from runtime.spec import RunSpec
from runtime.sync.rule import SyncSpec

__all__ = ["prepare_allreduce"]


def prepare_allreduce(
    plan: Plan, source: ModelSource, spec: RunSpec, dataset: RunData, where: Attempt
) -> Prepared | RunResult:
    """The ``allreduce`` rule's processes: every VW's stages, each rank on its slice of every
    global minibatch; with a run directory (``where.owner``) they write snapshots, and a
    resumed run starts after its snapshot's step. A resume with nothing left to train writes
    the outputs from the snapshot and returns that result instead
    (:func:`runtime.results.export.export_snapshot`).

    Raises:
        ConfigError: VWs of different depths, less than one global minibatch of data, a
            mismatched resume, or nothing to train.
    """
    vws, run, ck = plan.virtual_workers, spec.run, spec.checkpoints
    depth = {len(w.stages) for w in vws}
    if len(depth) != 1:
        raise ConfigError(
            f"the {plan.model} plan's VWs have {sorted(depth)} stages; AllReduce averages each "
            "stage over the VWs: plan it with planner.baseline.allreduce_plan"
        )
    (n_stages,) = depth
    world, batch = len(vws), plan.batch_size
    train, test = dataset.split(spec.data.test_fraction, run.seed)
    per_epoch = len(train) // (batch * world)
    if per_epoch < 1:
        raise ConfigError(
            f"the training split has {len(train)} samples, fewer than one global minibatch of "
            f"{world} x {batch}; use a smaller --batch-size or more data"
        )
    horizon = total_steps(run, per_epoch)
    settings = job_settings(source.name, plan.to_json(), 1, 0, run.seed, spec.data.test_fraction,
                            dataset.settings, spec.optimizer, horizon, run.precision)  # fmt: skip
    snaps, first = _snapshots(plan, spec, where.owner, settings)
    steps = max(0, horizon - first)
    if steps == 0 and snaps is not None and ck.resume:  # the outputs, from the snapshot
        manifest = read_manifest(snapshot_dir(snaps.directory, first))
        return export_snapshot(manifest, plan, source, run, (), test, 1, 0)
    if steps == 0:
        raise ConfigError("nothing to train: raise --steps or --epochs")
    groups = tuple(tuple(k * n_stages + s for k in range(world)) for s in range(n_stages))
    sync = SyncSpec("allreduce", plan.sync_params, timeout_s=run.timeout_s, groups=groups,
                    snapshots=snaps, first_wave=first)  # fmt: skip
    keep = spec.with_run(return_state=True)  # the final model comes from VW 0
    work = Work((train,) * world, steps, 1, where.init_method)
    jobs = vw_stage_jobs(plan, source, keep, sync, work)
    hint = ""
    if snaps is not None and ck.every > 0:
        hint = f"; resume with: {ck.resume_hint} --resume {ck.dir}"
    return Prepared((), with_world(jobs)[1], steps, first, 1, 0, test, hint)


def _snapshots(
    plan: Plan, spec: RunSpec, owner: RunOwner | None, settings: tuple[tuple[str, str], ...]
) -> tuple[SnapshotSpec | None, int]:
    """The run's snapshots (``None`` without a run directory) and the step it starts at (a
    resumed run's snapshot clock, checked against this run's ``settings``)."""
    ck = spec.checkpoints
    if ck.dir is None or owner is None:
        return None, 0
    manifest = resume_from(spec, owner, settings)
    first = manifest.clock if manifest is not None else 0
    if owner.tidies:  # one process of the job tidies the folder and keeps the plan
        clean(ck.dir, first if ck.resume else None)
        if spec.run.out_dir is not None and not ck.resume:
            plan.save(spec.run.out_dir / "plan.json")  # --resume reuses it
    snaps = SnapshotSpec(ck.dir, owner.run_id, owner.attempt, snapshot_parts(plan), settings,
                         ck.every, ck.keep, spec.faults.write_fault)  # fmt: skip
    return snaps, first
