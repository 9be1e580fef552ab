"""The processes of a run: parameter-server shards and pipeline stages, one frozen job each.

:mod:`runtime.launch.wsp` starts them on one host; ``python -m runtime`` under torchrun
runs the same entry points, one per rank. Each one joins the process group, reports its
result (or its error) on the ``events`` queue, and exits.
"""

from __future__ import annotations

import io
import logging
import multiprocessing as mp
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from runtime.config import ModelSource
from runtime.defaults import neighbour_wait_s
from runtime.faults import ShardFault
from runtime.launch.backend import stage_backend
from runtime.launch.child import run_rank, setup_child
from runtime.launch.startup import ABSENT, JOINED
from runtime.persist.checkpoint import shard_from_payload
from runtime.persist.snapshot import load_part, read_manifest, snapshot_dir
from runtime.ps.core import ShardCore
from runtime.ps.layout import ShardSpec
from runtime.ps.quorum import quorum_peers
from runtime.ps.rejoin import Rejoin
from runtime.ps.server import ShardServer
from runtime.stage.device import cuda_index
from runtime.stage.job import StageJob
from runtime.stage.model import initial_weights, ship_shard
from runtime.stage.worker import StageWorker
from runtime.sync.registry import shard_backups, shard_fold
from runtime.sync.rule import SyncSpec

__all__ = [
    "PRELOAD",
    "ShardJob",
    "absent_main",
    "dumps_result",
    "loads_result",
    "process_context",
    "shard_main",
    "stage_main",
]

log = logging.getLogger(__name__)

PRELOAD = (  # imported once by the fork server (the slow, lazily imported parts of a stage's start)
    "runtime.launch.dies_with_launcher",  # first: the fork server dies with the launcher
    "torch",
    "torch.distributed",
    "torch.func",
    "torch._dynamo",
    "torch._refs",
    "torch._decomp",
    "torch._subclasses.fake_tensor",
    "torch.fx.passes.shape_prop",
    "torch.fx.passes.split_module",
    "sympy",
    "sklearn.datasets",
    "runtime.stage.worker",
    "runtime.launch.procs",
    "runtime.launch.launcher",
)


@dataclass(frozen=True)
class ShardJob:
    """Everything one parameter-server shard process needs.

    Attributes:
        rank: global rank.
        spec: the shard's layout and clients.
        node: the node the plan puts it on.
        source: the model (its seeded initial weights start the shard).
        batch_size: the plan's minibatch (to build the model).
        seed: the run's seed.
        sync: the synchronisation rule's part (snapshots, the resumed wave, how to fold).
        resume: start from the shard's part of the snapshot at ``sync.first_wave``.
        init_method: the process group's rendezvous.
        world_size: processes in the group.
        fault: test hook: the shard kills itself after a while.
        peers: eviction mode (``--on-failure continue``): (shard id, rank) of the other
            shards, which gate each wave; ``None``: a lost client ends the shard.
        rejoin: with ``peers``, restart mode (``--on-failure restart``): a lost VW waits at
            its cut for its restarted processes (:mod:`runtime.ps.readmit`).
    """

    rank: int
    spec: ShardSpec
    node: str
    source: ModelSource
    batch_size: int
    seed: int
    sync: SyncSpec
    resume: bool = False
    init_method: str = "env://"
    world_size: int = 1
    fault: ShardFault | None = None
    peers: tuple[tuple[int, int], ...] | None = None
    rejoin: Rejoin | None = None

    def __getstate__(self) -> dict[str, Any]:
        """Pickled for the shard's process: of a user's module, only the shard's weights."""
        state = dict(self.__dict__)
        state["source"] = ship_shard(self.source, [p.name for p in self.spec.params])
        return state

    @property
    def where(self) -> str:
        """Log prefix ``shard 0 | rank 0 | node A``."""
        return f"shard {self.spec.id} | rank {self.rank} | node {self.node}"


def dumps_result(obj: Any) -> bytes:
    """A child's result as bytes for the launcher's event queue (``torch.save``)."""
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def loads_result(data: bytes) -> Any:
    """The launcher's side of :func:`dumps_result`: the bytes come from its own children, so
    pickled objects (result dataclasses) are allowed, unlike checkpoints."""
    return torch.load(io.BytesIO(data), weights_only=False)


def _shard_core(job: ShardJob) -> ShardCore:
    """The shard's state: from its snapshot part when resuming, else the seeded model."""
    fold, backups = shard_fold(job.sync), shard_backups(job.sync)
    peers = tuple(sid for sid, _ in job.peers or ())
    decides = quorum_peers(job.spec.id, job.sync.shards or (job.spec,))[0]
    snaps = job.sync.snapshots
    if job.resume and snaps is not None:
        manifest = read_manifest(snapshot_dir(snaps.directory, job.sync.first_clock))
        name = f"shard-{job.spec.id}"
        state = shard_from_payload(load_part(manifest, name), manifest.path / f"{name}.pt")
        return ShardCore(job.spec, state=state, fold=fold, backups=backups, peers=peers,
                         decides=decides, rejoin=job.rejoin is not None)  # fmt: skip
    init = initial_weights(job.source, job.batch_size, job.seed)
    return ShardCore(job.spec, job.spec.flatten(init), fold=fold, backups=backups, peers=peers,
                     decides=decides, rejoin=job.rejoin is not None)  # fmt: skip


def shard_main(job: ShardJob, events: Any, parent: int) -> None:
    """Entry point of one parameter-server shard process."""
    setup_child(job.where, parent, quiet_threads=True)
    if job.fault is not None:
        job.fault.arm(job.spec.id)

    def body() -> tuple[str, bytes]:
        core = _shard_core(job)
        timeout_s = job.sync.timeout_s
        server = ShardServer(
            core,
            timeout_s=timeout_s,
            idle_timeout_s=neighbour_wait_s(timeout_s),  # every VW may wait on a restart
            snapshots=job.sync.snapshots,
            peer_ranks=dict(job.peers) if job.peers is not None else None,
            quorum_ranks=quorum_peers(job.spec.id, job.sync.shards)[1]
            if shard_backups(job.sync)
            else None,
            rejoin=job.rejoin,
            lag_s=job.fault.lag(job.spec.id) if job.fault is not None else 0.0,
        )
        dist.barrier()
        events.put((JOINED, job.rank, None))
        state = server.serve()
        return "shard", dumps_result((state, core.trace.kept()))

    run_rank(job.rank, events, job.init_method, job.world_size, job.sync.timeout_s, body)


def stage_main(job: StageJob, events: Any, parent: int) -> None:
    """Entry point of one stage process (any rule: :mod:`runtime.sync.rule`)."""
    setup_child(job.ctx.where, parent, quiet_threads=True)
    hold = job.fault.start_up(job.ctx.vw, job.ctx.stage) if job.fault is not None else None

    def body() -> tuple[str, bytes]:
        worker = StageWorker(job, events)
        dist.barrier()
        events.put((JOINED, job.ctx.rank, None))
        return "result", dumps_result(worker.run())

    backend = stage_backend(job.sync.layout, job.ctx.emulated, torch.cuda.is_available())
    if job.ctx.torch_device(torch.cuda.device_count()) != "cpu":  # one GPU per rank, the plan's
        torch.cuda.set_device(cuda_index(job.ctx.device, torch.cuda.device_count()))
    run_rank(job.ctx.rank, events, job.init_method, job.world_size, job.run.timeout_s, body,
             backend, hold=hold)  # fmt: skip


def absent_main(job: StageJob, events: Any, parent: int) -> None:
    """Entry point of a stage of a VW lost at start-up (:mod:`runtime.launch.startup`): it
    holds its rank while the group forms, then leaves without training; the shards see its
    connections close and evict the VW at wave 0 (its one line: the launcher's)."""
    setup_child(job.ctx.where, parent, quiet_threads=True)

    def body() -> tuple[str, bytes]:
        dist.barrier()
        events.put((JOINED, job.ctx.rank, None))
        return ABSENT, b""

    run_rank(job.ctx.rank, events, job.init_method, job.world_size, job.run.timeout_s, body)


def process_context() -> Any:
    """``forkserver`` with torch and the runtime preloaded: children start in well under a second
    (a fresh interpreter importing torch takes seconds); ``spawn`` where forkserver is missing."""
    try:
        ctx = mp.get_context("forkserver")
    except ValueError:
        return mp.get_context("spawn")
    ctx.set_forkserver_preload(list(PRELOAD))
    return ctx
