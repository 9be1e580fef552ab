"""Every synchronisation rule's process side, by the name a plan gives it (one line per rule).

See :mod:`runtime.sync.rule` for the hooks and how to add a rule; the names and parameters
are :data:`planner.sync.RULES`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType

from profiler.errors import ConfigError
from runtime.sync import backup
from runtime.sync.allreduce import AllReduceSync
from runtime.sync.elastic import ElasticSync
from runtime.sync.rule import LocalSync, StageSync, StageView, SyncSpec, WaveFold
from runtime.sync.wave import WaveSync

__all__ = ["RULES", "RuleParts", "shard_backups", "shard_fold", "stage_sync"]


def _no_fold(spec: SyncSpec) -> WaveFold | None:
    return None


def _no_backups(spec: SyncSpec) -> int:
    return 0


@dataclass(frozen=True)
class RuleParts:
    """A rule's process side.

    Attributes:
        stage: ``create(spec, view)``: the stage's hooks (called by the stage worker).
        shard: ``(spec) -> WaveFold | None``: how a shard folds a complete wave (``None``:
            the plain sum).
        backups: ``(spec) -> b``: a shard closes a wave without waiting for ``b`` VWs
            (:mod:`planner.backup`; 0: every VW).
    """

    stage: Callable[[SyncSpec, StageView], StageSync]
    shard: Callable[[SyncSpec], WaveFold | None] = _no_fold
    backups: Callable[[SyncSpec], int] = _no_backups


RULES: Mapping[str, RuleParts] = MappingProxyType(
    {
        "wsp": RuleParts(WaveSync.create),
        "local": RuleParts(LocalSync.create),
        "allreduce": RuleParts(AllReduceSync.create),
        "backup": RuleParts(backup.create, backups=backup.shard_backups),
        "easgd": RuleParts(ElasticSync.create),
    }
)


def _parts(rule: str) -> RuleParts:
    parts = RULES.get(rule)
    if parts is None:
        raise ConfigError(
            f"synchronisation rule {rule!r} has no runtime side; use one of {', '.join(RULES)}"
        )
    return parts


def stage_sync(spec: SyncSpec, view: StageView) -> StageSync:
    """The hooks of ``spec.rule`` for one stage (the stage worker's constructor calls this)."""
    return _parts(spec.rule).stage(spec, view)


def shard_fold(spec: SyncSpec) -> WaveFold | None:
    """How a shard of ``spec.rule`` folds a complete wave (``None``: the plain sum)."""
    return _parts(spec.rule).shard(spec)


def shard_backups(spec: SyncSpec) -> int:
    """How many VWs a shard of ``spec.rule`` does not wait for in a wave (0: none)."""
    return _parts(spec.rule).backups(spec)
