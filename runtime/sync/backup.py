"""The process side of synchronous SGD with backup workers (``--sync backup``, :mod:`planner.backup`).

A stage does exactly what WSP does at ``D = 0`` (:class:`runtime.sync.wave.WaveSync`): push the
wave's update, pull the global weights of the next clock before the first minibatch that needs
them. The difference is all in the shards (:class:`runtime.ps.core.ShardCore` with
``backups = b``): a wave closes at the first ``VWs - b`` complete pushes and a late push is
acknowledged ``DROPPED`` (the client counts it in ``PSClient.dropped``); the late VW's next pull
returns the current global weights without its dropped update.
"""

from __future__ import annotations

import dataclasses

from planner.sync import param
from runtime.sync.rule import StageView, SyncSpec
from runtime.sync.wave import WaveSync

__all__ = ["create", "shard_backups"]


def create(spec: SyncSpec, view: StageView) -> WaveSync:
    """The ``backup`` rule's stage hooks: WSP's at ``D = 0``."""
    return WaveSync.create(dataclasses.replace(spec, D=0), view)


def shard_backups(spec: SyncSpec) -> int:
    """``b``: how many VWs' pushes each wave does not wait for."""
    return int(param(spec.params, "backups"))
