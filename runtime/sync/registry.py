"""Every synchronisation rule's process side, by the name a plan gives it (one line per rule).

See :mod:`runtime.sync.rule` for the hooks and how to add a rule; the names, parameters and
everything else the planner knows of a rule are its entry in :mod:`planner.rules`, keyed by
the same names (a plug-in of ``$HETPIPE_RULES`` gives its ``PARTS`` beside its ``RULE``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType

from planner.rules import plugin, plugin_modules
from profiler.errors import ConfigError
from runtime.sync import backup
from runtime.sync.allreduce import AllReduceSync
from runtime.sync.elastic import ElasticSync
from runtime.sync.rule import LocalSync, StageSync, StageView, SyncSpec, WaveFold
from runtime.sync.wave import WaveSync

__all__ = ["BUILTIN", "RuleParts", "parts", "shard_backups", "shard_fold", "stage_sync"]


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


BUILTIN: Mapping[str, RuleParts] = MappingProxyType(
    {
        "wsp": RuleParts(WaveSync.create),
        "local": RuleParts(LocalSync.create),
        "allreduce": RuleParts(AllReduceSync.create),
        "backup": RuleParts(backup.create, backups=backup.shard_backups),
        "easgd": RuleParts(ElasticSync.create),
    }
)


"""The process sides of :data:`planner.rules.BUILTIN`, by name."""


def parts(rule: str, extra: tuple[str, ...] = ()) -> RuleParts:
    """The process side of ``rule``: built in, or the ``PARTS`` of a plug-in module
    (``$HETPIPE_RULES`` or ``extra``, :attr:`runtime.sync.rule.SyncSpec.plugins`).

    Raises:
        ConfigError: no process side for that name.
    """
    found: object = BUILTIN.get(rule)
    if found is None:
        for module in dict.fromkeys((*plugin_modules(), *extra)):
            if getattr(plugin(module, "RULE"), "name", None) == rule:
                found = plugin(module, "PARTS")
    if not isinstance(found, RuleParts):
        raise ConfigError(
            f"synchronisation rule {rule!r} has no runtime side; use one of {', '.join(BUILTIN)}"
            " or a $HETPIPE_RULES module with RULE and PARTS"
        )
    return found


def stage_sync(spec: SyncSpec, view: StageView) -> StageSync:
    """The hooks of ``spec.rule`` for one stage (the stage worker's constructor calls this)."""
    return parts(spec.rule, spec.plugins).stage(spec, view)


def shard_fold(spec: SyncSpec) -> WaveFold | None:
    """How a shard of ``spec.rule`` folds a complete wave (``None``: the plain sum)."""
    return parts(spec.rule, spec.plugins).shard(spec)


def shard_backups(spec: SyncSpec) -> int:
    """How many VWs a shard of ``spec.rule`` does not wait for in a wave (0: none)."""
    return parts(spec.rule, spec.plugins).backups(spec)
