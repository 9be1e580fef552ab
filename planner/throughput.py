"""The throughput of a pipelined run, one definition for the simulator and the runtime.

Samples/s over the window after the warm-up wave 0, from each VW's stage-0 backward completion
times: :mod:`planner.sim` predicts with it and :class:`runtime.results.metrics.VWResult`
measures with it, so a predicted and a measured figure mean the same thing.
:func:`steady_throughput` is the planner's prediction: the rate once the run has settled.
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Sequence

from profiler.errors import PlanError

__all__ = ["measured_throughput", "own_rate", "steady_throughput"]


def measured_throughput(
    completions_ms: Sequence[Sequence[float]], nm: int, batch_size: int
) -> float:
    """Samples/s over the measured window (warm-up wave 0 excluded); the runtime's definition too.

    Args:
        completions_ms: per VW, sorted end times (ms) of each minibatch's stage-0 backward;
            every VW must have completed at least two waves (``2 * nm`` minibatches).
        nm: minibatches per wave.
        batch_size: samples per minibatch.

    Raises:
        PlanError: fewer than two waves completed by some VW.
    """
    waves = _waves(completions_ms, nm)
    t_a = max(c[nm - 1] for c in completions_ms)
    t_b = min(c[w * nm - 1] for c, w in zip(completions_ms, waves, strict=True))
    if t_b <= t_a:  # VWs too far apart for a common window: use each VW's own window
        return sum(
            own_rate(c, w, nm, batch_size) for c, w in zip(completions_ms, waves, strict=True)
        )
    done = sum(_count_in(c, t_a, t_b) for c in completions_ms)
    return batch_size * done / ((t_b - t_a) / 1e3)


def steady_throughput(completions_ms: Sequence[Sequence[float]], nm: int, batch_size: int) -> float:
    """Samples/s once a long run has settled: every VW at the slowest VW's rate (wave 0 excluded).

    Under WSP no VW may run more than ``D + 1`` waves ahead of the slowest, so over a long run
    every VW completes waves at the slowest one's rate. A short window (what
    :func:`measured_throughput` sees) also counts the lead a faster VW builds up before the
    clock holds it, which inflates D > 0 plans (docs/simulator.md, "Steady state").

    Args:
        completions_ms: per VW, sorted end times (ms) of each minibatch's stage-0 backward;
            every VW must have completed at least two waves (``2 * nm`` minibatches).
        nm: minibatches per wave (the same for every VW).
        batch_size: samples per minibatch.

    Raises:
        PlanError: fewer than two waves completed by some VW.
    """
    waves = _waves(completions_ms, nm)
    slowest = min(
        own_rate(c, w, nm, batch_size) for c, w in zip(completions_ms, waves, strict=True)
    )
    return len(completions_ms) * slowest


def own_rate(c: Sequence[float], waves: int, nm: int, batch_size: int) -> float:
    """One VW's samples/s from its stage-0 backward completion times ``c`` (ms), wave 0 excluded."""
    span = c[waves * nm - 1] - c[nm - 1]
    return batch_size * (waves - 1) * nm / (span / 1e3) if span > 0 else float("inf")


def _waves(completions_ms: Sequence[Sequence[float]], nm: int) -> list[int]:
    """Each VW's completed waves, refused below two (wave 0 is warm-up)."""
    waves = [len(c) // nm for c in completions_ms]
    if not completions_ms or min(waves) < 2:
        raise PlanError(
            f"throughput needs >= 2 completed waves per virtual worker (got {waves}); raise --waves"
        )
    return waves


def _count_in(c: Sequence[float], lo: float, hi: float) -> int:
    return bisect_right(c, hi) - bisect_right(c, lo)
