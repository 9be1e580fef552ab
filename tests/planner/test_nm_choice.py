"""The planner's Nm choice: the smallest Nm within tolerance of the best."""

from __future__ import annotations

from planner.planner import NM_TOLERANCE, _stable_best_nm


def test_stable_best_nm_prefers_the_smallest_nm_within_tolerance() -> None:
    top = 100.0
    near = top * (1 - NM_TOLERANCE / 2)
    assert _stable_best_nm([(near, -2), (top, -8), (50.0, -1)]) == 2
    assert _stable_best_nm([(top * (1 - 2 * NM_TOLERANCE), -2), (top, -8)]) == 8
    assert _stable_best_nm([(10.0, -1)]) == 1
