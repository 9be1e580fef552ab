"""WSP rules of paper Sec. 5 (planner/wsp.py), with the paper's worked example."""

from __future__ import annotations

import random

import pytest

from planner.wsp import (
    GlobalClock,
    first_minibatch_needing,
    local_version,
    may_admit,
    required_global_clock,
    s_global,
    s_local,
    wave_of,
    whole_waves,
)


def test_whole_waves_rounds_up_to_nm() -> None:
    assert [whole_waves(n, 4) for n in (0, 1, 4, 5, 8, 9)] == [0, 4, 4, 8, 8, 12]
    with pytest.raises(ValueError):
        whole_waves(-1, 4)


def test_waves_and_local_version() -> None:
    assert [wave_of(p, 4) for p in range(1, 10)] == [0, 0, 0, 0, 1, 1, 1, 1, 2]
    assert [local_version(p, 4) for p in (1, 4, 5, 6, 11)] == [0, 0, 1, 2, 7]
    assert s_local(4) == 3
    with pytest.raises(ValueError):
        wave_of(0, 4)


def test_paper_example_nm4_d0() -> None:
    """Sec. 5: Nm = 4, D = 0."""
    nm, D = 4, 0
    # minibatches 1..7 run without any global update (the first wave plus Nm - 1 more)
    assert all(required_global_clock(p, nm, D) == 0 for p in range(1, 8))
    # minibatch 8 is the first that needs wave 0's global update
    assert required_global_clock(8, nm, D) == 1
    assert first_minibatch_needing(0, nm, D) == 8
    # minibatch 11 needs the global updates of minibatches 1..4 (wave 0) only
    assert required_global_clock(11, nm, D) == 1
    # ... and minibatch 12 those of waves 0 and 1
    assert required_global_clock(12, nm, D) == 2
    assert s_global(nm, D) == (D + 1) * nm + nm - 2 == 6


def test_s_global_matches_required_clock() -> None:
    """Minibatch p must see every global update of minibatches 1 .. p - (s_global + 1)."""
    for nm in range(1, 7):
        for D in range(4):
            for p in range(1, 60):
                must_see = p - (s_global(nm, D) + 1)  # last minibatch whose update is required
                waves_needed = max(0, -(-must_see // nm)) if must_see > 0 else 0
                assert required_global_clock(p, nm, D) == waves_needed, (nm, D, p)


def test_first_minibatch_needing_is_the_threshold() -> None:
    for nm in range(1, 6):
        for D in range(3):
            for w in range(5):
                p = first_minibatch_needing(w, nm, D)
                assert required_global_clock(p, nm, D) == w + 1
                assert required_global_clock(p - 1, nm, D) <= w


def test_may_admit() -> None:
    assert may_admit(7, in_flight=3, nm=4, D=0, global_clock=0)
    assert not may_admit(7, in_flight=4, nm=4, D=0, global_clock=0)
    assert not may_admit(8, in_flight=3, nm=4, D=0, global_clock=0)
    assert may_admit(8, in_flight=3, nm=4, D=0, global_clock=1)
    assert may_admit(8, in_flight=3, nm=4, D=1, global_clock=0)


def test_global_clock_min_of_local() -> None:
    c = GlobalClock(3)
    assert c.global_clock == 0 and c.distance == 0
    assert c.push(0, 0) == 0
    assert c.push(0, 1) == 0
    assert c.distance == 2
    assert c.push(1, 0) == 0
    assert c.push(2, 0) == 1
    assert c.local(0) == 2 and c.distance == 1
    with pytest.raises(ValueError, match="next wave"):
        c.push(1, 2)
    with pytest.raises(ValueError):
        GlobalClock(0)


def test_global_clock_random_against_reference() -> None:
    rng = random.Random(3)
    for _ in range(50):
        n = rng.randint(1, 6)
        c = GlobalClock(n)
        local = [0] * n
        for _ in range(100):
            vw = rng.randrange(n)
            c.push(vw, local[vw])
            local[vw] += 1
            assert c.global_clock == min(local)
            assert c.distance == max(local) - min(local)
