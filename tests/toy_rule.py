"""A toy synchronisation rule kept in the tests, plugged in through ``$HETPIPE_RULES``: it
averages like WSP (its shards, its hooks, its wave player) and takes one parameter of its own,
``beta``; no file outside ``tests/`` names it (``tests/test_toy_rule.py``)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

from planner.ranges import Range
from planner.rules import RuleParam, SyncRule
from planner.sim.waves import play_wsp
from runtime.sync.registry import RuleParts

if TYPE_CHECKING:
    from runtime.sync.rule import StageSync, StageView, SyncSpec


def _check(params: Mapping[str, float], n_vws: int) -> None:
    """``beta x VWs <= 1``, so the plan is what the rule is checked against."""
    if params["beta"] * n_vws > 1:
        raise ValueError(f"beta x VWs must be <= 1, got {params['beta']:g} x {n_vws}")


def _stage(spec: SyncSpec, view: StageView) -> StageSync:
    """WSP's hooks (a stage pushes every wave and pulls as WSP does)."""
    from runtime.sync.wave import WaveSync

    return WaveSync.create(spec, view)


RULE = SyncRule(
    "toy",
    "WSP's averaging with a toy knob (tests only)",
    "toy (WSP with a --beta knob)",
    "toy beta={beta}",
    params=(
        RuleParam(
            "beta", 0.5, "a knob the plan records", Range(0, 1, open_low=True, open_high=False)
        ),
    ),
    check=_check,
    play=play_wsp,
)
PARTS = RuleParts(_stage)
