"""The synchronisation rules across virtual workers, as a plan names them (pure, no processes).

A plan says how its VWs synchronise: ``Plan.sync`` names the rule and ``Plan.sync_params``
holds its parameters, a small frozen mapping (sorted ``(name, value)`` pairs; in the plan file
``sync_params: {alpha: 0.5}``). :data:`RULES` is the one list the planner, the simulator and
the runtime agree on. Each rule's pure logic lives in ``planner/`` (WSP's clocks in
:mod:`planner.wsp`, AllReduce's below and its predictor in
:func:`planner.predict.simulate_allreduce`), its process side in :mod:`runtime.sync`
(:mod:`runtime.sync.rule` says how to add one).

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
from dataclasses import dataclass
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

from planner.backup import quorum
from planner.easgd import check_elastic
from profiler.errors import ConfigError, PlanError

if TYPE_CHECKING:
    from planner.plan import Plan

__all__ = [
    "RULES",
    "RuleInfo",
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

SyncParams = tuple[tuple[str, float], ...]
"""A rule's parameters: sorted ``(name, value)`` pairs (frozen, hashable, pickles anywhere)."""


@dataclass(frozen=True)
class RuleInfo:
    """One synchronisation rule as the planner sees it.

    Attributes:
        name: what ``Plan.sync`` says (``wsp``).
        uses_shards: the VWs synchronise through parameter-server shards (the launcher starts
            them; the plan must place some).
        params: the parameters the rule takes, with their defaults (``Plan.sync_params``).
        doc: one line for error messages and ``--help``.
        data: what each VW trains on: ``"shard"``, its own disjoint shard of the training
            split (an epoch over it); ``"global"``, its slice of every global minibatch of the
            whole split (:func:`global_slice`): a rule that drops some VWs' work must, or a VW
            that is always late would have its shard never learned (:func:`data_slice`).
    """

    name: str
    uses_shards: bool
    params: SyncParams
    doc: str
    data: str = "shard"


RULES: Mapping[str, RuleInfo] = MappingProxyType(
    {
        "wsp": RuleInfo(
            "wsp",
            True,
            (),
            "Wave Synchronous Parallel through the shards (paper Sec. 5; threshold Plan.D)",
        ),
        "local": RuleInfo("local", False, (), "one VW alone: nothing to synchronise"),
        "allreduce": RuleInfo(
            "allreduce",
            False,
            (),
            "BSP data parallelism: gradients averaged over every VW after every minibatch",
            data="global",
        ),
        "backup": RuleInfo(
            "backup",
            True,
            (("backups", 1.0),),
            "synchronous SGD with backup workers: a wave closes at the first VWs - backups "
            "pushes, the rest are dropped (planner.backup)",
            data="global",  # the dropped pushes are a different random sample every epoch
        ),
        "easgd": RuleInfo(
            "easgd",
            True,
            (("alpha", 0.1), ("tau", 1.0)),
            "elastic averaging: each VW its own weights, pulled towards the centre every tau "
            "waves with moving rate alpha (planner.easgd)",
        ),
    }
)


def check_sync_params(rule: str, given: Mapping[str, Any], source: str) -> SyncParams:
    """``given`` completed with the rule's defaults, checked and frozen.

    Raises:
        PlanError: an unknown rule, an unknown parameter or a value that is not a finite
            number (names the file, the field and the choices).
    """
    info = RULES.get(rule)
    if info is None:
        raise PlanError(
            f"{source}: sync: {str(rule)[:40]!r} is not a synchronisation rule; use one of "
            f"{', '.join(RULES)}"
        )
    if not isinstance(given, Mapping):
        raise PlanError(f"{source}: sync_params must be a mapping of names to numbers")
    defaults = dict(info.params)
    out = dict(defaults)
    for key, value in given.items():
        if key not in defaults:
            known = ", ".join(defaults) or "none"
            raise PlanError(
                f"{source}: sync_params: {str(key)[:40]!r} is not a parameter of rule "
                f"{rule!r} (it takes: {known})"
            )
        if isinstance(value, bool) or not isinstance(value, int | float) or value != value:
            raise PlanError(f"{source}: sync_params.{key}: {str(value)[:40]!r} is not a number")
        out[key] = float(value)
    return tuple(sorted(out.items()))


def check_rule_values(rule: str, params: SyncParams, n_vws: int, source: str) -> None:
    """Check a rule's parameter values against the plan (``backups < VWs``, whole ``tau``,
    ``VWs x alpha <= 1``: :func:`planner.backup.quorum`, :func:`planner.easgd.check_elastic`).

    Raises:
        PlanError: one line naming the file, the field, the value and the fix.
    """
    try:
        if rule == "backup":
            b = param(params, "backups")
            if b != int(b):
                raise ValueError(f"backups must be a whole number, got {b}")
            quorum(n_vws, int(b))
        elif rule == "easgd":
            tau = param(params, "tau", 1.0)
            if tau != int(tau):
                raise ValueError(f"tau must be a whole number of waves, got {tau}")
            check_elastic(n_vws, int(tau), param(params, "alpha"))
    except ValueError as exc:
        raise PlanError(f"{source}: sync_params ({rule}): {exc}") from None


def with_rule(plan: Plan, rule: str, given: Mapping[str, Any], source: str = "--sync") -> Plan:
    """``plan`` synchronised by ``rule`` with parameters ``given`` (the rule's defaults for the
    rest): checked like a plan file; backup workers and elastic averaging run at ``D = 0``.

    Raises:
        PlanError: an unknown rule or parameter, or a value the plan cannot take.
    """
    params = check_sync_params(rule, given, source)
    check_rule_values(rule, params, len(plan.virtual_workers), source)
    D = 0 if rule in ("backup", "easgd") else plan.D
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
    info = RULES[sync]
    if not info.uses_shards:
        return sync
    if vw >= 0 or (n_shards == 0 and n_vws == 1):
        return "local"
    if n_shards == 0:
        raise ConfigError(
            f"the plan has {n_vws} VWs but no parameter-server shards to synchronise them by "
            f"{sync!r}; re-plan with shards (hetpipe plan) or train one VW (vw=K)"
        )
    return sync


def check_time_limit(rule: str, time_limit_s: float) -> None:
    """Refuse ``--time-limit`` for a rule that cannot stop on it: under ``backup`` a VW that
    skipped waves cannot agree on a stop wave yet (``docs/sync.md``, What is not done).

    Raises:
        ConfigError: ``rule`` is ``backup`` and a time limit is given.
    """
    if rule == "backup" and time_limit_s > 0:
        raise ConfigError(
            "--time-limit with --sync backup: a VW that skipped waves cannot agree on a stop "
            "wave yet; give --steps or --epochs instead"
        )


def data_slice(rule: str, vw: int, n_vws: int) -> tuple[int, int]:
    """VW ``vw``'s ``(rank, world)`` of every minibatch under ``rule``
    (:class:`runtime.data.MinibatchSource`): ``(vw, n_vws)``, its slice of the global minibatch
    of the whole training split, for a rule whose data is ``"global"``; ``(0, 1)``, the whole
    minibatch of its own shard, otherwise (:attr:`RuleInfo.data`).

    Under backup workers the same VWs are late wave after wave on a heterogeneous cluster;
    with a shard each, their shards would be dropped nearly every time (``docs/sync.md``
    measures what that costs).

    >>> data_slice("backup", 2, 4), data_slice("wsp", 2, 4)
    ((2, 4), (0, 1))
    """
    return (vw, n_vws) if RULES[rule].data == "global" else (0, 1)


def global_slice(rank: int, batch_size: int) -> tuple[int, int]:
    """AllReduce's data rule: rank ``r`` trains on samples ``[r*B, (r+1)*B)`` of every global
    minibatch of ``world * B`` samples, so the ranks' shards are disjoint within every epoch
    (like ``DistributedSampler``) and a step equals SGD on the combined minibatch."""
    return rank * batch_size, (rank + 1) * batch_size
