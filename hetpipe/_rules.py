"""The synchronisation-rule options shared by ``hetpipe plan``, ``run`` and ``simulate``.

``--sync backup --backups B`` and ``--sync easgd --tau T --alpha A`` (:mod:`planner.sync`);
a rule's option given with another rule is refused, naming the rule it belongs to.
"""

from __future__ import annotations

from typing import Annotated

import typer

from planner.plan import Plan
from planner.sync import RULES, with_rule
from profiler.errors import ConfigError
from runtime.options import Range, check_number

__all__ = ["SYNC_HELP", "AlphaOpt", "BackupsOpt", "TauOpt", "apply_rule", "rule_params"]

SYNC_HELP = (
    "wsp (parameter servers, threshold D) | backup (synchronous SGD with --backups backup "
    "VWs) | easgd (elastic averaging every --tau waves, rate --alpha) | allreduce (the DDP "
    "baseline)"
)
BackupsOpt = Annotated[
    int | None,
    typer.Option("--backups", help="--sync backup: VWs a wave does not wait for (default 1)"),
]
TauOpt = Annotated[
    int | None,
    typer.Option("--tau", help="--sync easgd: waves between exchanges with the centre (default 1)"),
]
AlphaOpt = Annotated[
    float | None,
    typer.Option("--alpha", help="--sync easgd: moving rate, VWs x alpha <= 1 (default 0.1)"),
]

_RANGES = {
    "backups": Range(0),
    "tau": Range(1),
    "alpha": Range(0, 1, open_low=True, open_high=False),
}
"""Each rule option's values before the plan is known (``VWs x alpha <= 1`` is checked with
the plan: :func:`planner.sync.check_rule_values`)."""


def rule_params(
    sync: str, backups: int | None, tau: int | None, alpha: float | None
) -> dict[str, float]:
    """The rule parameters given on the command line.

    Raises:
        ConfigError: an unknown rule, a parameter of another rule, or a value out of range.
    """
    if sync not in RULES or sync == "local":
        raise ConfigError(f"--sync {sync!r}: use one of wsp, backup, easgd, allreduce")
    given = {"backups": backups, "tau": tau, "alpha": alpha}
    mine = {name for name, _ in RULES[sync].params}
    for name, value in given.items():
        if value is not None and name not in mine:
            owner = next(r for r, info in RULES.items() if name in dict(info.params))
            raise ConfigError(f"--{name} applies to --sync {owner}, not --sync {sync}")
    for name, value in given.items():
        check_number(f"--{name}", value, _RANGES[name])
    return {k: float(v) for k, v in given.items() if v is not None}


def apply_rule(plan: Plan, sync: str, params: dict[str, float]) -> Plan:
    """``plan`` with rule ``sync`` when it is backup or easgd (else unchanged)."""
    if sync in ("backup", "easgd"):
        return with_rule(plan, sync, params)
    return plan
