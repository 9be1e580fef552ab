"""The ``allreduce`` rule's part of a launch: the DDP baseline's data, steps and snapshots.

Every VW (one per device, :func:`planner.baseline.allreduce_plan`) trains its slice of each
global minibatch of the training split, ``Nm = 1``; a held-out split measures the final
model. There are no shards: the stages hold the model, and with a run directory they write
the snapshots (:mod:`runtime.sync.allreduce_snapshot`) through the same machinery as WSP's
(:class:`runtime.persist.snapshot.SnapshotSpec`, one manifest per clock; a step is a clock),
so ``--resume`` and ``--on-failure restart`` go on from the newest committed snapshot.
"""

from __future__ import annotations

import dataclasses

from planner.plan import Plan
from profiler.errors import ConfigError
from runtime.config import ModelSource, OptimizerConfig, RunConfig, WSPConfig
from runtime.data_source import RunData
from runtime.launch.jobs import Prepared, vw_stage_jobs, with_world
from runtime.launch.roles import total_steps
from runtime.launch.wsp import resume_from, snapshot_parts
from runtime.persist.run_dir import RunOwner, job_settings
from runtime.persist.snapshot import SnapshotSpec, clean, read_manifest, snapshot_dir
from runtime.results.export import export_snapshot
from runtime.results.run_result import RunResult
from runtime.sync.rule import SyncSpec

__all__ = ["prepare_allreduce"]


def prepare_allreduce(
    plan: Plan,
    source: ModelSource,
    optimizer: OptimizerConfig,
    run: RunConfig,
    cfg: WSPConfig,
    dataset: RunData,
    owner: RunOwner | None,
    init_method: str,
) -> Prepared | RunResult:
    """The ``allreduce`` rule's processes: every VW's stages, each rank on its slice of every
    global minibatch; with a run directory (``owner``) they write snapshots, and a resumed run
    starts after its snapshot's step. A resume with nothing left to train writes the outputs
    from the snapshot and returns that result instead
    (:func:`runtime.results.export.export_snapshot`).

    Raises:
        ConfigError: VWs of different depths, less than one global minibatch of data, a
            mismatched resume, or nothing to train.
    """
    vws = plan.virtual_workers
    depth = {len(w.stages) for w in vws}
    if len(depth) != 1:
        raise ConfigError(
            f"the {plan.model} plan's VWs have {sorted(depth)} stages; AllReduce averages each "
            "stage over the VWs: plan it with planner.baseline.allreduce_plan"
        )
    (n_stages,) = depth
    world, batch = len(vws), plan.batch_size
    train, test = dataset.split(cfg.test_fraction, run.seed)
    per_epoch = len(train) // (batch * world)
    if per_epoch < 1:
        raise ConfigError(
            f"the training split has {len(train)} samples, fewer than one global minibatch of "
            f"{world} x {batch}; use a smaller --batch-size or more data"
        )
    horizon = total_steps(run, per_epoch)
    snaps, first = _snapshots(plan, source, optimizer, run, cfg, dataset, owner, horizon)
    steps = max(0, horizon - first)
    if steps == 0 and snaps is not None and cfg.resume:  # the outputs, from the snapshot
        manifest = read_manifest(snapshot_dir(snaps.directory, first))
        return export_snapshot(manifest, plan, source, run, (), test, 1, 0)
    if steps == 0:
        raise ConfigError("nothing to train: raise --steps or --epochs")
    groups = tuple(tuple(k * n_stages + s for k in range(world)) for s in range(n_stages))
    sync = SyncSpec("allreduce", plan.sync_params, timeout_s=run.timeout_s, groups=groups,
                    snapshots=snaps, first_wave=first)  # fmt: skip
    keep = dataclasses.replace(run, return_state=True)  # the final model comes from VW 0
    jobs = vw_stage_jobs(plan, source, optimizer, keep, cfg, sync, [train] * world, steps,
                         init_method, nm=1)  # fmt: skip
    hint = ""
    if snaps is not None and cfg.checkpoint_every > 0:
        hint = f"; resume with: {cfg.resume_hint} --resume {cfg.checkpoint_dir}"
    return Prepared((), with_world(jobs)[1], steps, first, 1, 0, test, hint)


def _snapshots(
    plan: Plan,
    source: ModelSource,
    optimizer: OptimizerConfig,
    run: RunConfig,
    cfg: WSPConfig,
    dataset: RunData,
    owner: RunOwner | None,
    horizon: int,
) -> tuple[SnapshotSpec | None, int]:
    """The run's snapshots (``None`` without a run directory) and the step it starts at (a
    resumed run's snapshot clock, checked against this run's settings)."""
    if cfg.checkpoint_dir is None or owner is None:
        return None, 0
    settings = job_settings(source.name, plan.to_json(), 1, 0, run.seed, cfg.test_fraction,
                            dataset.settings, optimizer, horizon, run.precision)  # fmt: skip
    manifest = resume_from(cfg, owner, settings)
    first = manifest.clock if manifest is not None else 0
    if owner.tidies:  # one process of the job tidies the folder and keeps the plan
        clean(cfg.checkpoint_dir, first if cfg.resume else None)
        if run.out_dir is not None and not cfg.resume:
            plan.save(run.out_dir / "plan.json")  # --resume reuses it
    snaps = SnapshotSpec(cfg.checkpoint_dir, owner.run_id, owner.attempt, snapshot_parts(plan),
                         settings, cfg.checkpoint_every, cfg.keep, cfg.write_fault)  # fmt: skip
    return snaps, first
