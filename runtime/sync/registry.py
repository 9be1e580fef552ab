"""Every synchronisation rule's process side, by the name a plan gives it (one line per rule).

See :mod:`runtime.sync.rule` for the hooks and how to add a rule; the names and parameters
are :data:`planner.sync.RULES`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType

from profiler.errors import ConfigError
from runtime.sync.allreduce import AllReduceSync
from runtime.sync.rule import LocalSync, StageSync, StageView, SyncSpec, WaveFold
from runtime.sync.wave import WaveSync

__all__ = ["RULES", "RuleParts", "shard_fold", "stage_sync"]


def _no_fold(spec: SyncSpec) -> WaveFold | None:
    return None


@dataclass(frozen=True)
class RuleParts:
    """A rule's process side.

    Attributes:
        stage: ``create(spec, view)``: the stage's hooks (called by the stage worker).
        shard: ``(spec) -> WaveFold | None``: how a shard folds a complete wave (``None``:
            the plain sum).
    """

    stage: Callable[[SyncSpec, StageView], StageSync]
    shard: Callable[[SyncSpec], WaveFold | None] = _no_fold


RULES: Mapping[str, RuleParts] = MappingProxyType(
    {
        "wsp": RuleParts(WaveSync.create),
        "local": RuleParts(LocalSync.create),
        "allreduce": RuleParts(AllReduceSync.create),
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
