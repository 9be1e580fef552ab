"""Where a restarted VW meets the shards again (``--on-failure restart``, one host).

All ranks of a run start in one gloo process group of fixed size; gloo cannot put a new
process in the place of a dead rank there. A restarted VW (a new *incarnation* ``n`` of VW
``k``: new processes for every one of its stages) talks instead through a group of its own,
``ProcessGroupGloo(PrefixStore("vw<k>/inc<n>", store), rank, world_size)``: it has the
job's size and numbering (every rank keeps its global rank) but connects lazily
(``TORCH_GLOO_LAZY_INIT``), pair by pair on first use, so only the shards and that VW's new
stages ever join it while the other VWs go on in the first group. The shards build the same
group when they reopen the VW (:meth:`runtime.ps.core.ShardCore.incarnation`).

The rendezvous is one ``FileStore`` in the launch's rendezvous folder, shared by the
launcher, the shards and the restarted stages:

- ``vw<k>/inc<n>/decision``: the launcher's ``restart`` (it starts the new processes) or
  ``release`` (the restart budget is spent: the shards leave the VW out,
  :meth:`runtime.ps.core.ShardCore.release`);
- ``vw<k>/inc<n>/wave``: the wave the new incarnation starts at (the agreed cut, written by
  every shard alike); the new stages wait for it and train from there.
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist
from torch._C._distributed_c10d import FileStore, PrefixStore, Store

__all__ = ["RELEASE", "RESTART", "Rejoin"]

RESTART = "restart"
RELEASE = "release"


@dataclass(frozen=True)
class Rejoin:
    """The rendezvous of restarted VWs.

    Attributes:
        store_path: the ``FileStore`` file (in the launch's rendezvous folder).
        world_size: ranks of the job (the numbering every incarnation keeps).
        timeout_s: timeout of the store waits and of the incarnation groups' operations.
    """

    store_path: str
    world_size: int
    timeout_s: float

    def store(self) -> Store:
        """A handle on the shared store (any number of processes, no cleanup)."""
        store = FileStore(self.store_path, -1)
        store.set_timeout(datetime.timedelta(seconds=self.timeout_s))
        return store

    @staticmethod
    def decision_key(vw: int, inc: int) -> str:
        """Key of the launcher's decision on incarnation ``inc`` of VW ``vw``."""
        return f"vw{vw}/inc{inc}/decision"

    @staticmethod
    def wave_key(vw: int, inc: int) -> str:
        """Key of the wave incarnation ``inc`` of VW ``vw`` starts at."""
        return f"vw{vw}/inc{inc}/wave"

    def wait(self, store: Store, key: str, timeout_s: float | None = None) -> str:
        """The value of ``key`` once some process set it.

        Raises:
            RuntimeError: not set within ``timeout_s`` (default: :attr:`timeout_s`).
        """
        limit = self.timeout_s if timeout_s is None else timeout_s
        store.wait([key], datetime.timedelta(seconds=limit))
        return store.get(key).decode()

    def group(self, store: Store, vw: int, inc: int, rank: int) -> Any:
        """Incarnation ``inc`` of VW ``vw``'s process group, as rank ``rank`` (global
        numbering; lazily connected: building it never waits for the other members). Use it
        with ``group_dst``/``group_src`` (:func:`runtime.ps.server.isend`)."""
        os.environ["TORCH_GLOO_LAZY_INIT"] = "1"  # read when a gloo group is built
        prefixed = PrefixStore(f"vw{vw}/inc{inc}/", store)
        timeout = datetime.timedelta(seconds=self.timeout_s)
        return dist.ProcessGroupGloo(prefixed, rank, self.world_size, timeout)
