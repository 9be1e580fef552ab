"""The run-wide stop wave of a time limit with parameter servers (pure parts, no processes)."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest

from planner.wsp import required_global_clock, stop_wave
from runtime.sync.stop import StopAgreement, file_store


@pytest.mark.parametrize(("nm", "D"), list(itertools.product(range(1, 5), range(5))))
def test_stop_wave_is_beyond_every_wave_any_vw_can_have_admitted(nm: int, D: int) -> None:
    for admitted in range(0, 6 * nm):
        # the proposer has pushed at most admitted // nm waves, so the global clock is at most that
        g_max = admitted // nm
        # the most minibatches another VW can have admitted under that global clock
        others = max(p for p in range(1, 50 * nm) if required_global_clock(p, nm, D) <= g_max)
        waves = stop_wave(admitted, nm, D)
        assert waves * nm >= others  # nobody has to undo an admitted minibatch
        assert waves * nm >= admitted
        # and it is the smallest such whole number of waves
        assert (waves - 1) * nm < max(others, admitted)


def test_stop_wave_rejects_bad_input() -> None:
    with pytest.raises(ValueError):
        stop_wave(-1, 2, 0)
    with pytest.raises(ValueError):
        stop_wave(3, 0, 0)


def test_first_proposal_wins_and_others_follow(tmp_path: Path) -> None:
    now = [0.0]
    path = str(tmp_path / "stop")
    a = StopAgreement(file_store(path), nm=2, D=1, poll_s=0.05, clock=lambda: now[0])
    b = StopAgreement(file_store(path), nm=2, D=1, poll_s=0.05, clock=lambda: now[0])
    assert a.total(5, time_up=False) is None
    assert b.total(9, time_up=False) is None
    assert a.total(6, time_up=True) == 2 * stop_wave(6, 2, 1)  # a's time is up: it proposes
    now[0] = 0.01  # b polls at most every poll_s
    assert b.total(9, time_up=False) is None
    now[0] = 1.0
    assert b.total(9, time_up=False) == a.total(7, time_up=True)  # b adopts a's wave count
    assert b.total(11, time_up=True) == a.total(7, time_up=True)  # a later proposal loses
