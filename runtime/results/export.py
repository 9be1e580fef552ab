"""A finished run's outputs written from its last snapshot, without training (``--resume`` of
a run with nothing left to train, e.g. after a failure during evaluation): the model, the test
accuracy, and ``weights.pt`` / ``summary.json``. Every rule with snapshots: the shards'
global weights (``wsp``, ``backup``), or VW 0's copy of every stage (``allreduce``: each VW
holds the same model, :mod:`runtime.sync.allreduce_snapshot`), and every rule's buffers
(batch-norm statistics) from every stage part, merged over the VWs as a run that trained
merges them (:func:`runtime.results.whole_state.merge_buffers`)."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence
from typing import Any

from torch import Tensor
from torch.utils.data import Dataset

from planner.plan import Plan
from profiler.errors import HetPipeRuntimeError
from runtime.config import ModelSource, RunConfig
from runtime.persist.checkpoint import shard_from_payload
from runtime.persist.snapshot import Manifest, load_part
from runtime.ps.layout import ShardSpec
from runtime.results.run_result import RunResult, evaluate, model_keys
from runtime.results.whole_state import merge_buffers

__all__ = ["export_snapshot", "snapshot_result"]

log = logging.getLogger(__name__)


def export_snapshot(
    manifest: Manifest,
    plan: Plan,
    source: ModelSource,
    run: RunConfig,
    specs: Sequence[ShardSpec],
    test: Dataset[Any],
    nm: int,
    D: int,
) -> RunResult:
    """The final outputs of a run from its snapshot (``specs``: the shards'; none: the
    stages hold the model, AllReduce), the test accuracy, and with ``run.out_dir``
    ``weights.pt`` and ``summary.json``.

    Raises:
        HetPipeRuntimeError: a part is corrupt or not the model's (names the file).
    """
    result = snapshot_result(manifest, plan, source, specs, nm, D)
    acc, loss = evaluate(source, plan.batch_size, run.seed, result.state_dict(), test)
    result = dataclasses.replace(result, test_accuracy=acc, test_loss=loss)
    if run.out_dir is not None:
        result.save(run.out_dir)
    log.info("outputs written from the snapshot %s (clock %d)", manifest.path, manifest.clock)
    return result


def snapshot_result(
    manifest: Manifest,
    plan: Plan,
    source: ModelSource,
    specs: Sequence[ShardSpec],
    nm: int,
    D: int,
) -> RunResult:
    """A snapshot as a run's result, not yet evaluated: its
    :meth:`~runtime.results.run_result.RunResult.state_dict` is the model at the snapshot's
    clock under the user's module's names (``specs``: the shards'; none: AllReduce).

    Raises:
        HetPipeRuntimeError: a part is corrupt or not the model's (names the file).
    """
    states = tuple(
        shard_from_payload(load_part(manifest, f"shard-{s.id}"), manifest.path / f"shard-{s.id}.pt")
        for s in specs
    )
    replicas = None if specs else _replica_state(manifest, plan)
    return RunResult((), nm, D, states, tuple(() for _ in specs), tuple(specs), 0.0,
                     plan.predicted.throughput, exported_from=str(manifest.path),
                     sync=plan.sync, sync_params=plan.sync_params,
                     exported_state=replicas, keys=model_keys(source, plan.batch_size),
                     exported_buffers=_snapshot_buffers(manifest, plan))  # fmt: skip


def _replica_state(manifest: Manifest, plan: Plan) -> dict[str, Tensor]:
    """The model of an AllReduce snapshot: the weights of VW 0's part of every stage."""
    state: dict[str, Tensor] = {}
    for s in range(len(plan.virtual_workers[0].stages)):
        name = f"vw0-stage{s}"
        part = load_part(manifest, name)
        weights = part.get("weights") if isinstance(part, dict) else None
        if not isinstance(weights, dict):
            raise HetPipeRuntimeError(
                f"{manifest.path / name}.pt: no model weights in this AllReduce stage part; "
                "resume from another snapshot (--resume DIR@CLOCK)"
            )
        state.update(weights)
    return state


def _snapshot_buffers(manifest: Manifest, plan: Plan) -> dict[str, Tensor]:
    """The buffers of every VW's stage parts (by original name; a VW left out of the
    snapshot has none), merged over the VWs."""
    per_vw: list[dict[str, Tensor]] = []
    for k, vw in enumerate(plan.virtual_workers):
        mine: dict[str, Tensor] = {}
        for s in reversed(range(len(vw.stages))):  # a buffer on several stages: the first's
            name = f"vw{k}-stage{s}"
            part = load_part(manifest, name) if name in manifest.parts else None
            buffers = part.get("buffers") if isinstance(part, dict) else None
            if isinstance(buffers, dict):
                mine.update(buffers)
        if mine:
            per_vw.append(mine)
    return merge_buffers(per_vw)
