"""The ``--on-nonfinite`` rule (:mod:`planner.nonfinite`), pure: every stage of a VW applies or
skips a minibatch alike, or the run stops; ``stop`` never skips."""

from __future__ import annotations

import doctest

from hypothesis import given
from hypothesis import strategies as st

import planner.nonfinite
from planner.nonfinite import POLICIES, Verdict, after_reduction, verdict


def test_doctests() -> None:
    res = doctest.testmod(planner.nonfinite)
    assert res.attempted > 0 and res.failed == 0


def _pipeline(policy: str, finite: list[bool]) -> list[Verdict]:
    """The verdicts on one minibatch, judged from the last stage back to stage 0 (the order of
    its backward), until one stops the run; ``finite[s]``: what stage ``s`` computed."""
    out: list[Verdict] = []
    for s in reversed(range(len(finite))):
        skipped_after = bool(out) and out[-1] is Verdict.SKIP
        out.append(verdict(policy, finite[s], skipped_after, last=s == len(finite) - 1))
        if out[-1] is Verdict.STOP:
            break
    return out


@given(st.sampled_from(POLICIES), st.lists(st.booleans(), min_size=1, max_size=6))
def test_a_vw_never_applies_and_skips_the_same_minibatch(policy: str, finite: list[bool]) -> None:
    out = _pipeline(policy, finite)
    done = set(out) - {Verdict.STOP}
    assert len(done) <= 1  # the stages that went on all did the same
    if all(finite):
        assert set(out) == {Verdict.APPLY}
    elif policy == "stop":
        assert Verdict.SKIP not in out and out[-1] is Verdict.STOP
    elif not finite[-1]:  # the last stage saw it first: every stage skips, the run goes on
        assert out == [Verdict.SKIP] * len(finite)
    else:  # a later stage applied it already: it cannot be skipped consistently
        assert out[-1] is Verdict.STOP and Verdict.SKIP not in out


@given(st.booleans(), st.booleans(), st.booleans())
def test_stop_never_skips(finite: bool, skipped_after: bool, last: bool) -> None:
    assert verdict("stop", finite, skipped_after, last) is not Verdict.SKIP


def test_a_marked_reduction_skips_under_skip_and_stops_under_stop() -> None:
    for local in Verdict:
        assert after_reduction("skip", local, reduced_finite=True) is local
    assert after_reduction("skip", Verdict.APPLY, reduced_finite=False) is Verdict.SKIP
    assert after_reduction("stop", Verdict.APPLY, reduced_finite=False) is Verdict.STOP
