"""The processes of a multi-VW WSP run: parameter-server shards and pipeline stages.

:mod:`runtime.launch.wsp` starts them on one host; ``python -m runtime`` under torchrun
runs the same entry points, one per rank. Each one joins the gloo process group, reports
its result (or its error) on the ``events`` queue, and exits.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist
from torch._C._distributed_c10d import Store

from runtime.config import ModelSource, OptimizerConfig, RunConfig, WSPConfig
from runtime.data import MinibatchSource
from runtime.launch.failures import run_rank, setup_child
from runtime.launch.single import dumps_result, inject_fault
from runtime.launch.stop import StopAgreement, file_store
from runtime.persist.checkpoint import shard_from_payload
from runtime.persist.snapshot import load_part, read_manifest, snapshot_dir
from runtime.ps.client import PSClient
from runtime.ps.core import ShardCore
from runtime.ps.layout import ShardSpec
from runtime.ps.server import ShardServer
from runtime.stage.emulation import Calibration
from runtime.stage.model import reference_module
from runtime.stage.worker import StageContext, StageWorker
from runtime.sync.wave import WaveSync

__all__ = ["ShardRole", "ShiftedSource", "shard_main", "stage_main"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ShardRole:
    """One parameter-server shard process: its rank, spec and node; ``peers`` (shard id,
    rank) of the other shards in eviction mode (``--on-failure continue``), else ``None``."""

    rank: int
    spec: ShardSpec
    node: str
    peers: tuple[tuple[int, int], ...] | None = None

    @property
    def where(self) -> str:
        return f"shard {self.spec.id} | rank {self.rank} | node {self.node}"


@dataclass(frozen=True)
class ShiftedSource(MinibatchSource):
    """Minibatch ``p`` of a resumed run is minibatch ``offset + p`` of the VW's data."""

    offset: int = 0

    def indices(self, mb: int) -> list[int]:
        return super().indices(mb + self.offset)


def _shard_fault(fault: str, shard_id: int) -> None:
    """``killshard:ID:SECONDS``: shard ID SIGKILLs itself that long after it starts (tests)."""
    if not fault.startswith("killshard:"):
        return
    _, sid, delay = fault.split(":")
    if int(sid) == shard_id:
        timer = threading.Timer(float(delay), os.kill, (os.getpid(), signal.SIGKILL))
        timer.daemon = True
        timer.start()


def shard_main(
    shard: ShardRole,
    source: ModelSource,
    batch_size: int,
    seed: int,
    cfg: WSPConfig,
    resume_clock: int | None,
    timeout_s: float,
    init_method: str,
    world_size: int,
    events: Any,
    parent: int,
    fault: str = "",
) -> None:
    """Entry point of one parameter-server shard process."""
    setup_child(shard.where, parent, quiet_threads=True)
    _shard_fault(fault, shard.spec.id)

    def body() -> tuple[str, bytes]:
        if resume_clock is not None and cfg.snapshots is not None:
            manifest = read_manifest(snapshot_dir(cfg.snapshots.directory, resume_clock))
            name = f"shard-{shard.spec.id}"
            init, state = None, shard_from_payload(load_part(manifest, name), manifest.path / f"{name}.pt")
        else:
            module, names, _ = reference_module(source, batch_size, seed)
            init = shard.spec.flatten({names[n]: p.detach() for n, p in module.named_parameters()})
            state = None
        peers = dict(shard.peers) if shard.peers is not None else None
        core = ShardCore(shard.spec, init, state=state, peers=tuple(peers or ()))
        server = ShardServer(
            core,
            timeout_s=timeout_s,
            idle_timeout_s=4 * timeout_s,
            snapshots=cfg.snapshots,
            peer_ranks=peers,
        )
        dist.barrier()
        state = server.serve()
        return "shard", dumps_result((state, list(core.trace)))

    run_rank(shard.rank, events, init_method, world_size, timeout_s, body)


def _stop_store(init_method: str) -> Store:
    """Where the VWs agree on the stop wave: a file beside a one-host run's rendezvous file,
    else (torchrun, ``env://``) the process group's own store, which every host reaches."""
    if init_method.startswith("file://"):
        return file_store(init_method.removeprefix("file://") + ".stop")
    return dist.distributed_c10d._get_default_store()


def stage_main(
    ctx: StageContext,
    source: ModelSource,
    optimizer: OptimizerConfig,
    run: RunConfig,
    dataset: Any,
    calibration: Calibration | None,
    specs: tuple[ShardSpec, ...],
    D: int,
    first_wave: int,
    cfg: WSPConfig,
    init_method: str,
    world_size: int,
    events: Any,
    parent: int,
    fault: str,
) -> None:
    """Entry point of one stage process of a multi-VW run."""
    setup_child(ctx.where, parent, quiet_threads=True)

    def body() -> tuple[str, bytes]:
        worker = StageWorker(ctx, source, optimizer, run, dataset, calibration, events)
        worker.fault = (
            cfg.stage_fault.hook(ctx.vw, ctx.stage) if cfg.stage_fault else inject_fault(fault, ctx)
        )
        sync = _wave_sync(worker, specs, D, first_wave * ctx.nm, cfg, run.timeout_s)
        if ctx.stage == 0 and run.time_limit_s > 0:
            worker.stop = StopAgreement(_stop_store(init_method), ctx.nm, D)
        dist.barrier()
        sync.start(first_wave)
        result = worker.run(time.time())
        sync.close()
        return "result", dumps_result(result)

    run_rank(ctx.rank, events, init_method, world_size, run.timeout_s, body)


def _wave_sync(
    worker: StageWorker,
    specs: tuple[ShardSpec, ...],
    D: int,
    first_mb: int,
    cfg: WSPConfig,
    timeout_s: float,
) -> WaveSync:
    """Hook a stage into WSP; a resumed run continues the data order and the lr schedule."""
    ctx = worker.ctx
    if worker.data is not None and first_mb:
        d = worker.data
        worker.data = ShiftedSource(
            d.dataset, d.batch_size, d.seed, d.target_shape, first_mb, input_names=d.input_names
        )
    worker.weights.first_update = first_mb  # the lr schedule goes on where it stopped
    worker.weights.total_updates = first_mb + ctx.total_steps  # the cosine horizon
    named = list(worker.module.named_parameters())
    client = PSClient(
        ctx.vw,
        ctx.stage,
        [(worker.names[n], tuple(p.shape)) for n, p in named],
        specs,
        timeout_s=timeout_s,
        pull_timeout_s=2 * timeout_s,
    )
    sync = WaveSync(
        client,
        [p for _, p in named],
        ctx.nm,
        D,
        worker.result,
        first_mb,
        worker.weights.optimizer,
        cfg.snapshots,
        f"vw{ctx.vw}-stage{ctx.stage}",
        worker.weights if cfg.overlap_pulls else None,
    )
    worker.after_update = sync.after_update
    worker.before_forward = sync.before_forward
    worker.before_update = sync.before_update
    return sync
