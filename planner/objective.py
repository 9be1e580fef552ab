"""The planning objective: rank candidate plans by predicted throughput or by time to a target.

``hetpipe plan --objective throughput`` (the default) keeps the fastest plan in samples/s.
``--objective time`` ranks candidates by predicted *time to target*: the samples sequential
SGD needs (``--target-samples``; relative times need none) divided by the plan's goodput,
``throughput x efficiency`` (:mod:`planner.efficiency`, Pollux's goodput). The candidates:
the throughput plan's allocation (and others given: ``hetpipe plan`` adds ``auto``'s best
and, when the user chose no VW count, one VW of every device) at each Nm in turn, under each remedy that acts there (``predict`` from Nm 2,
``pipemare`` from Nm 3; a remedy whose memory does not fit is left out), at each WSP
threshold ``D`` given (only where ``D`` acts: a WSP plan through shards, :func:`takes_d`),
and the AllReduce baseline on the devices that hold the model. The ranking is pure:
:func:`rank` over :class:`Choice` rows, tested on hand-built candidates; :func:`plan_for_time`
builds the rows from plans made by injected functions.

Example:
    >>> from planner.efficiency import EfficiencyInputs, Setting
    >>> e = EfficiencyInputs(noise_scale=0.0, delay_cost={"none": 1.0})
    >>> fast_stale = Choice("wsp Nm 4", "wsp", 1, 4, 0, "none", 400.0, Setting(32, 32, 3.0))
    >>> slow_fresh = Choice("wsp Nm 1", "wsp", 1, 1, 0, "none", 150.0, Setting(32, 32))
    >>> [(r.choice.label, r.relative_time) for r in rank([fast_stale, slow_fresh], e)]
    [('wsp Nm 1', 1.0), ('wsp Nm 4', 1.5)]
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace
from typing import Any

from planner.efficiency import EfficiencyInputs, Setting, efficiency, mean_delay
from planner.plan import Plan
from planner.rules import get_rule, time_ranked
from planner.sync import effective_rule
from profiler.errors import ConfigError, PlanError

__all__ = [
    "OBJECTIVES",
    "Choice",
    "Ranked",
    "Replan",
    "choice_of",
    "plan_for_time",
    "rank",
    "remedies_at",
    "takes_d",
]

OBJECTIVES = ("throughput", "time")
"""What ``hetpipe plan --objective`` ranks plans by."""


@dataclass(frozen=True)
class Choice:
    """One candidate plan as the objective sees it.

    Attributes:
        label: how the table names it (``wsp hd 2 VWs Nm 3 predict``, ``allreduce 4 devices``).
        sync: its synchronisation rule (``wsp``, ``backup``, ``allreduce``).
        vws: virtual workers (AllReduce: devices).
        nm: minibatches in flight per VW.
        D: WSP clock-distance threshold.
        remedy: staleness remedy of the run.
        throughput: predicted samples/s.
        setting: what it does to the optimisation (:class:`planner.efficiency.Setting`).
    """

    label: str
    sync: str
    vws: int
    nm: int
    D: int
    remedy: str
    throughput: float
    setting: Setting


@dataclass(frozen=True)
class Ranked:
    """A candidate with its predictions, as the table shows it.

    Attributes:
        choice: the candidate.
        efficiency: progress per sample relative to sequential SGD (:mod:`planner.efficiency`).
        goodput: ``throughput x efficiency``, sequential-SGD-equivalent samples/s.
        relative_time: predicted time to target over the best candidate's (1.0: the best).
        seconds: predicted seconds to ``target_samples`` (0.0: no target given).
    """

    choice: Choice
    efficiency: float
    goodput: float
    relative_time: float
    seconds: float


def rank(
    choices: Sequence[Choice], inputs: EfficiencyInputs, target_samples: float = 0.0
) -> list[Ranked]:
    """The candidates by predicted time to target, best first (ties: less delay, then no
    remedy, then the order given)."""
    scored = []
    for k, c in enumerate(choices):
        e = efficiency(c.setting, inputs)
        scored.append((c, e, c.throughput * e, k))
    best = max((g for _, _, g, _ in scored), default=0.0)

    def key(row: tuple[Choice, float, float, int]) -> tuple[float, float, bool, int]:
        c, _, goodput, k = row
        time = 1.0 / goodput if goodput > 0 else math.inf
        return (time, c.setting.local_delay + c.setting.foreign_delay, c.remedy != "none", k)

    out = []
    for c, e, g, _ in sorted(scored, key=key):
        relative = best / g if g > 0 else math.inf
        seconds = target_samples / g if g > 0 and target_samples > 0 else 0.0
        out.append(Ranked(c, e, g, relative, seconds))
    return out


def choice_of(plan: Plan, remedy: str = "none") -> Choice:
    """The candidate a plan is under ``remedy``.

    Raises:
        ConfigError: a rule the efficiency model does not cover (no
            :attr:`planner.rules.SyncRule.time_delays`: ``easgd``).
    """
    n, b = len(plan.virtual_workers), plan.batch_size
    tp = plan.predicted.throughput
    rule = get_rule(plan.sync)
    if rule.layout == "ddp":  # every device averages every minibatch: no delay
        setting = Setting(batch=n * b, base_batch=b)
        return Choice(f"{rule.name} {n} devices", rule.name, n, 1, 0, "none", tp, setting)
    if rule.time_delays is None:
        raise ConfigError(
            f"--objective time: no efficiency model for --sync {rule.name}; use --sync "
            f"{' or '.join(time_ranked())}, or --objective throughput"
        )
    syncing, D = rule.time_delays(dict(plan.sync_params), n, plan.D)
    local, foreign = mean_delay(plan.nm, syncing, D)
    policy = plan.policy.removeprefix("auto:")
    shown_d = D if takes_d(plan) else 0
    label = (
        f"{plan.sync} {policy} {n} VW{'s' if n > 1 else ''} Nm {plan.nm}"
        + (f" D {shown_d}" if shown_d > 0 else "")
        + (f" {remedy}" if remedy != "none" else "")
    )
    setting = Setting(b, b, local, foreign, remedy)
    return Choice(label, plan.sync, n, plan.nm, shown_d, remedy, tp, setting)


def takes_d(plan: Plan) -> bool:
    """Whether the WSP threshold ``D`` acts on ``plan``: its rule keeps ``D`` (not backup or
    EASGD) and trains through parameter-server shards (not one VW without shards, the
    ``local`` rule, nor AllReduce). Where it acts, ``D > 0`` lets a stage update without
    waiting for its pull (:func:`planner.wsp.folds_at_update`) and, with several VWs, adds
    foreign delay (:func:`planner.efficiency.mean_delay`); where not, candidates at other
    ``D`` would be the same plan.

    Example:
        >>> from types import SimpleNamespace as NS
        >>> one = NS(sync="wsp", shards=(), virtual_workers=(0,))
        >>> takes_d(one), takes_d(NS(sync="wsp", shards=(0,), virtual_workers=(0,)))
        (False, True)
        >>> takes_d(NS(sync="backup", shards=(0,), virtual_workers=(0, 1)))
        False
    """
    rule = get_rule(plan.sync)
    if not rule.keeps_D or not rule.uses_shards:
        return False
    try:
        alone = effective_rule(plan.sync, len(plan.shards), len(plan.virtual_workers))
    except ConfigError:  # several VWs without shards: not a runnable plan, D moot
        return False
    return alone == plan.sync


def remedies_at(nm: int, inputs: EfficiencyInputs) -> list[str]:
    """The remedies worth comparing at ``nm``: those that act there (``predict`` from Nm 2,
    ``pipemare`` from Nm 3, :mod:`planner.staleness`) and that ``inputs`` has a cost for.

    Example:
        >>> e = EfficiencyInputs(1.0, {"none": 1.0, "predict": 0.2, "pipemare": 1.0})
        >>> remedies_at(1, e), remedies_at(2, e), remedies_at(3, e)
        (['none'], ['none', 'predict'], ['none', 'predict', 'pipemare'])
    """
    acts = {"none": 1, "predict": 2, "pipemare": 3}
    return [r for r, low in acts.items() if nm >= low and r in inputs.delay_cost]


Replan = Callable[[int, str, int], Plan]
"""An allocation's planner for ``--objective time``: ``(nm, memory, D) -> plan`` at exactly Nm
``nm``, with remedy ``memory``'s memory counted, at WSP threshold ``D``."""


def plan_for_time(
    allocations: Sequence[tuple[Replan, Sequence[int]]],
    allreduce: Callable[[], Plan] | None,
    inputs: EfficiencyInputs,
    target_samples: float = 0.0,
    d_values: Sequence[int] = (0,),
) -> tuple[Plan, list[Ranked]]:
    """The plan of the fastest predicted time to target and every candidate ranked.

    Args:
        allocations: per allocation, ``replan`` (:data:`Replan`; may raise
            :class:`PlanError` or :class:`ConfigError`, or come back with a smaller Nm: not a
            candidate) and the Nm values to compare.
        allreduce: the AllReduce baseline's plan (may raise :class:`ConfigError`: no device
            holds the model), or ``None``.
        inputs: the efficiency model's inputs.
        target_samples: samples sequential SGD needs to the target (0: relative times only).
        d_values: the WSP thresholds compared (each candidate planned and simulated at each;
            a plan ``D`` does not act on, :func:`takes_d`, only at the first). The record's
            ``d_values`` lists those some candidate was compared at where ``D`` acts (empty:
            nowhere, e.g. ``backup`` or one VW without shards).

    Raises:
        PlanError: no candidate could be planned.
    """
    plans = _candidates(allocations, inputs, d_values)
    if allreduce is not None:
        try:
            ar = allreduce()
        except ConfigError:
            ar = None
        if ar is not None:
            plans[choice_of(ar)] = ar
    if not plans:
        raise PlanError("--objective time: no candidate plan fits; try --objective throughput")
    ranked = rank(list(plans), inputs, target_samples)
    best = ranked[0]
    compared = sorted({c.D for c, p in plans.items() if takes_d(p)})  # where D acts
    record = _record(best, inputs, target_samples, len(ranked), compared)
    return replace(plans[best.choice], objective=record), ranked


def _candidates(
    allocations: Sequence[tuple[Replan, Sequence[int]]],
    inputs: EfficiencyInputs,
    d_values: Sequence[int],
) -> dict[Choice, Plan]:
    """Every pipelined candidate (allocation x Nm x remedy x D) with its plan (remedy set),
    in planning order; one per label. ``D`` changes neither the memory model nor so the Nm
    that fits (:mod:`planner.offload`), only the simulated throughput and the delay."""
    out: dict[Choice, Plan] = {}
    labels: set[str] = set()
    for replan, nm_values in allocations:
        for nm in nm_values:
            for remedy in remedies_at(nm, inputs):
                for plan in _at_each_d(replan, nm, remedy, d_values):
                    c = choice_of(plan, remedy)
                    if c.label not in labels:
                        labels.add(c.label)
                        out[c] = replace(plan, remedy=remedy)
    return out


def _at_each_d(replan: Replan, nm: int, remedy: str, d_values: Sequence[int]) -> Iterator[Plan]:
    """``replan``'s plans at exactly ``nm`` with ``remedy``'s memory, at each of ``d_values``
    (the first only where ``D`` does not act, :func:`takes_d`; none where Nm ``nm`` does not
    fit, which no ``D`` changes)."""
    memory = "predict" if remedy == "predict" else "none"  # pipemare keeps no more
    for D in d_values:
        try:
            plan = replan(nm, memory, D)
        except (PlanError, ConfigError):
            return
        if plan.nm != nm:
            return
        yield plan
        if not takes_d(plan):  # the same plan at every D: plan it once
            return


def _record(
    best: Ranked, inputs: EfficiencyInputs, target: float, n: int, d_values: Sequence[int]
) -> dict[str, Any]:
    """The plan file's ``objective`` section: what was ranked, how, and the winner's figures."""
    return {
        "objective": "time",
        "efficiency": best.efficiency,
        "goodput": best.goodput,
        "target_samples": target,
        "seconds_to_target": best.seconds,
        "candidates": n,
        "d_values": [int(d) for d in d_values],
        **inputs.to_dict(),
    }
