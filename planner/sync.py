"""The synchronisation rules across virtual workers, as a plan names them (pure, no processes).

A plan says how its VWs synchronise: ``Plan.sync`` names the rule and ``Plan.sync_params``
holds its parameters, a small frozen mapping (sorted ``(name, value)`` pairs; in the plan file
``sync_params: {alpha: 0.5}``). The rules themselves are declared in the registry
(:mod:`planner.rules`, one entry each); this module holds what every rule shares: checking a
plan's parameters, the effective rule, the data a VW trains on. Each rule's process side is
in :mod:`runtime.sync` (:mod:`runtime.sync.rule` says how to add one).

>>> check_sync_params("wsp", {}, "plan.yaml")
()
>>> effective_rule("wsp", n_shards=0, n_vws=1)
'local'
>>> global_slice(rank=2, batch_size=8)
(16, 24)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from planner.rules import ALONE_RULE, SyncParams, get_rule, rules
from profiler.errors import ConfigError, PlanError

if TYPE_CHECKING:
    from planner.plan import Plan

__all__ = [
    "SyncParams",
    "check_rule_values",
    "check_sync_params",
    "check_time_limit",
    "data_slice",
    "effective_rule",
    "global_slice",
    "param",
    "with_rule",
]


def check_sync_params(rule: str, given: Mapping[str, Any], source: str) -> SyncParams:
    """``given`` completed with the rule's defaults, checked and frozen.

    Raises:
        PlanError: an unknown rule, an unknown parameter or a value that is not a finite
            number (names the file, the field and the choices).
    """
    known = rules()
    info = known.get(rule) if isinstance(rule, str) else None
    if info is None:
        raise PlanError(
            f"{source}: sync: {str(rule)[:40]!r} is not a synchronisation rule; use one of "
            f"{', '.join(known)}"
        )
    if not isinstance(given, Mapping):
        raise PlanError(f"{source}: sync_params must be a mapping of names to numbers")
    defaults = dict(info.defaults)
    out = dict(defaults)
    for key, value in given.items():
        if key not in defaults:
            taken = ", ".join(defaults) or "none"
            raise PlanError(
                f"{source}: sync_params: {str(key)[:40]!r} is not a parameter of rule "
                f"{rule!r} (it takes: {taken})"
            )
        if isinstance(value, bool) or not isinstance(value, int | float) or value != value:
            raise PlanError(f"{source}: sync_params.{key}: {str(value)[:40]!r} is not a number")
        out[key] = float(value)
    return tuple(sorted(out.items()))


def check_rule_values(rule: str, params: SyncParams, n_vws: int, source: str) -> None:
    """Check a rule's parameter values against the plan: whole ones whole, then the rule's own
    check (:attr:`planner.rules.SyncRule.check`: ``backups < VWs``, ``VWs x alpha <= 1``).

    Raises:
        PlanError: one line naming the file, the field, the value and the fix.
    """
    info = get_rule(rule)
    values = dict(params)
    try:
        for p in info.params:
            v = values.get(p.name, p.default)
            if p.whole and v != int(v):
                raise ValueError(f"{p.name} must be a whole number, got {v}")
        info.check(values, n_vws)
    except ValueError as exc:
        raise PlanError(f"{source}: sync_params ({rule}): {exc}") from None


def with_rule(plan: Plan, rule: str, given: Mapping[str, Any], source: str = "--sync") -> Plan:
    """``plan`` synchronised by ``rule`` with parameters ``given`` (the rule's defaults for the
    rest): checked like a plan file; a rule that does not keep ``D`` (backup workers, elastic
    averaging) runs at ``D = 0``.

    Raises:
        PlanError: an unknown rule or parameter, or a value the plan cannot take.
    """
    params = check_sync_params(rule, given, source)
    check_rule_values(rule, params, len(plan.virtual_workers), source)
    D = plan.D if get_rule(rule).keeps_D else 0
    return dataclasses.replace(plan, sync=rule, sync_params=params, D=D)


def param(params: SyncParams, name: str, default: float = 0.0) -> float:
    """The value of parameter ``name`` (``default`` when the rule does not set it)."""
    return dict(params).get(name, default)


def effective_rule(sync: str, n_shards: int, n_vws: int, vw: int = -1) -> str:
    """The rule that actually trains: a rule through shards with no shards to go through, or
    one VW of the plan trained alone (``vw >= 0``), is ``local`` (nothing to synchronise).

    Raises:
        ConfigError: several VWs to synchronise by a shard rule without any shard.
    """
    info = get_rule(sync)
    if not info.uses_shards:
        return sync
    if vw >= 0 or (n_shards == 0 and n_vws == 1):
        return ALONE_RULE
    if n_shards == 0:
        raise ConfigError(
            f"the plan has {n_vws} VWs but no parameter-server shards to synchronise them by "
            f"{sync!r}; re-plan with shards (hetpipe plan) or train one VW (vw=K)"
        )
    return sync


def check_time_limit(rule: str, time_limit_s: float) -> None:
    """Refuse ``--time-limit`` for a rule that cannot stop on it
    (:attr:`planner.rules.SyncRule.no_time_limit`; ``backup``: ``docs/sync.md``, What is not
    done).

    Raises:
        ConfigError: such a rule and a time limit given.
    """
    why = get_rule(rule).no_time_limit
    if why and time_limit_s > 0:
        raise ConfigError(
            f"--time-limit with --sync {rule}: {why}; give --steps or --epochs instead"
        )


def data_slice(rule: str, vw: int, n_vws: int) -> tuple[int, int]:
    """VW ``vw``'s ``(rank, world)`` of every minibatch under ``rule``
    (:class:`runtime.data.MinibatchSource`): ``(vw, n_vws)``, its slice of the global minibatch
    of the whole training split, for a rule whose data is ``"global"``; ``(0, 1)``, the whole
    minibatch of its own shard, otherwise (:attr:`planner.rules.SyncRule.data`).

    Under backup workers the same VWs are late wave after wave on a heterogeneous cluster;
    with a shard each, their shards would be dropped nearly every time (``docs/sync.md``
    measures what that costs).

    >>> data_slice("backup", 2, 4), data_slice("wsp", 2, 4)
    ((2, 4), (0, 1))
    """
    return (vw, n_vws) if get_rule(rule).data == "global" else (0, 1)


def global_slice(rank: int, batch_size: int) -> tuple[int, int]:
    """AllReduce's data rule: rank ``r`` trains on samples ``[r*B, (r+1)*B)`` of every global
    minibatch of ``world * B`` samples, so the ranks' shards are disjoint within every epoch
    (like ``DistributedSampler``) and a step equals SGD on the combined minibatch."""
    return rank * batch_size, (rank + 1) * batch_size
