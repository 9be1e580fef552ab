"""What a run's synchronisation rule did: when each VW's push of each wave arrived, what was dropped.

The seed 003's Fig. 4 ("time to collect k gradients") for VWs: for every wave, the time each VW
finished pushing it (the latest push of its stages), sorted; :func:`kth_push_s` averages, over
the waves every VW pushed, the delay of the k-th push after the first. With backup workers the
wave closes at the ``N``-th; the pushes after it are the ones dropped.
"""

from __future__ import annotations

from collections.abc import Sequence

from planner.rules import get_rule
from planner.sync import SyncParams
from runtime.results.metrics import VWResult

__all__ = ["arrival_table", "describe_rule", "dropped_vw_waves", "kth_push_s", "vw_arrivals"]


def describe_rule(rule: str, params: SyncParams, D: int) -> str:
    """``WSP D=1``, ``backup b=1``, ``EASGD tau=4 alpha=0.1``, ``allreduce (BSP)``: the rule's
    :meth:`planner.rules.SyncRule.label`."""
    return get_rule(rule).label(params, D)


def vw_arrivals(vws: Sequence[VWResult]) -> dict[int, dict[int, float]]:
    """``wave -> {vw: wall-clock time its last stage pushed the wave}``."""
    out: dict[int, dict[int, float]] = {}
    for k, vw in enumerate(vws):
        for stage in vw.stages:
            for wave, t in stage.pushes:
                mine = out.setdefault(wave, {})
                mine[k] = max(mine.get(k, t), t)
    return out


def kth_push_s(vws: Sequence[VWResult]) -> list[float]:
    """Mean seconds from a wave's first VW push to its k-th (k = 1..VWs), over the waves every
    VW pushed (empty when there is none)."""
    n = len(vws)
    full = [sorted(d.values()) for d in vw_arrivals(vws).values() if len(d) == n]
    if not full:
        return []
    return [sum(a[k] - a[0] for a in full) / len(full) for k in range(n)]


def dropped_vw_waves(vws: Sequence[VWResult]) -> int:
    """(VW, wave) pairs some shard dropped (a VW counts once per wave, whatever its stages)."""
    return len({(k, w) for k, vw in enumerate(vws) for s in vw.stages for _, w in s.dropped})


def arrival_table(vws: Sequence[VWResult]) -> list[list[float | None]]:
    """Per wave (in order), each VW's push time in seconds since the run's first stage start
    (``None``: that VW did not push the wave): the data of the seed's Fig. 4."""
    starts = [s.start_time for vw in vws for s in vw.stages if s.start_time > 0]
    t0 = min(starts, default=0.0)
    arrivals = vw_arrivals(vws)
    return [
        [round(arrivals[w][k] - t0, 6) if k in arrivals[w] else None for k in range(len(vws))]
        for w in sorted(arrivals)
    ]
