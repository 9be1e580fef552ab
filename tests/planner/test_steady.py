"""The planner predicts a plan's steady state: what a long run measures, not a short one's lead."""

from __future__ import annotations

import pytest

from planner.assemble import _simulated
from planner.planner import PlanOptions
from planner.sim.simulator import simulate
from planner.throughput import measured_throughput, steady_throughput
from tests.planner.simplan import make_plan

LONG_WAVES = 400  # long enough that a D + 1-wave lead is a negligible share of the window


def test_steady_throughput_is_every_vw_at_the_slowest_rate() -> None:
    fast = [10.0, 20.0, 30.0, 40.0]  # nm 1: a wave every 10 ms after wave 0
    slow = [10.0, 30.0, 50.0, 70.0]  # a wave every 20 ms
    assert steady_throughput([fast, slow], 1, 10) == pytest.approx(2 * 10 / 0.020)
    assert measured_throughput([fast, slow], 1, 10) > steady_throughput([fast, slow], 1, 10)


def test_steady_throughput_refuses_a_run_under_two_waves() -> None:
    with pytest.raises(Exception, match="raise --waves"):
        steady_throughput([[10.0, 20.0, 30.0]], 2, 10)


@pytest.mark.parametrize("D", [0, 1, 2])
def test_prediction_equals_a_long_simulation(D: int) -> None:
    # a VW 20 % slower than the other: at D > 0 the fast one runs D + 1 waves ahead, which
    # over the planner's former 8 waves inflated D = 1 by 9 % (this test failed on main)
    slow = 1.2
    plan = make_plan(
        [[("V", 2.0, 4.0), ("R", 2.0, 4.0)], [("G", 2.0 * slow, 4.0 * slow), ("Q", 2.4, 4.8)]],
        nm=3,
        D=D,
    )
    predicted = _simulated(plan, PlanOptions().simulate_waves)
    assert predicted is not None
    assert predicted.throughput == pytest.approx(
        simulate(plan, waves=LONG_WAVES).throughput, rel=0.01
    )
