"""The staleness-remedy rules: doctests, and the runtime's staleness rule they build on."""

from __future__ import annotations

import doctest

import pytest

import planner.staleness as rules
from planner.wsp import local_version, required_global_clock


def test_doctests() -> None:
    assert doctest.testmod(rules).failed == 0


@pytest.mark.parametrize("nm", [1, 2, 3, 6])
def test_staleness_counts_the_updates_between_forward_and_update(nm: int) -> None:
    for mb in range(1, 4 * nm):
        # the forward sees updates 1..local_version, its own update follows update mb - 1
        assert rules.staleness(mb, nm) == len(range(local_version(mb, nm) + 1, mb))
        assert rules.predict_steps(mb, nm) in (0, rules.staleness(mb, nm))
    assert rules.stage_delay(nm) == nm - 1


@pytest.mark.parametrize("nm", [1, 2, 3, 4])
@pytest.mark.parametrize("D", [0, 1, 3])
def test_foreign_staleness_counts_the_other_vws_updates_not_pulled(nm: int, D: int) -> None:
    for mb in range(1, 8 * nm):
        pulled = set(range(1, required_global_clock(mb, nm, D) * nm + 1))  # waves < G
        missed = [q for q in range(1, mb) if q not in pulled]
        assert rules.foreign_staleness(mb, nm, D) == len(missed)


@pytest.mark.parametrize("nm", [1, 2, 3, 5])
def test_predict_steps_of_one_vw_is_the_local_staleness_rule(nm: int) -> None:
    for mb in range(1, 6 * nm):
        one = rules.staleness(mb, nm) if local_version(mb, nm) >= 1 else 0
        assert rules.predict_steps(mb, nm) == one == rules.predict_steps(mb, nm, 1, 3)
        whole = one + 3 * rules.foreign_staleness(mb, nm, 1)
        assert rules.predict_steps(mb, nm, 4, 1) == (whole if one and nm > 1 else 0)


def test_remedies_are_no_ops_at_nm1() -> None:
    assert all(rules.predict_scale(mb, 1, 0.3) == 0.0 for mb in range(1, 20))
    assert all(rules.predict_scale(mb, 1, 0.3, 4, 2) == 0.0 for mb in range(1, 20))
    assert all(rules.pipemare_lr(0.3, k, rules.stage_delay(1), 10) == 0.3 for k in range(20))


def test_pipemare_warms_up_from_lr_over_delay_to_lr() -> None:
    lrs = [rules.pipemare_lr(0.1, k, delay=3, warmup=10) for k in range(12)]
    assert lrs[0] == pytest.approx(0.1 / 3) and lrs[10:] == [0.1, 0.1]
    assert lrs == sorted(lrs)


def test_unknown_remedy_names_the_known_ones() -> None:
    with pytest.raises(ValueError, match="use one of none, predict, pipemare"):
        rules.check_remedy("later")
