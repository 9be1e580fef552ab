"""What ``--on-failure restart`` did, for the result: VWs restarted alone at the shards' cut
(their rows count every incarnation) and whole-job restarts from the last snapshot."""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Sequence

from runtime.persist.checkpoint import ShardState
from runtime.results.metrics import VWResult

__all__ = ["ALONE", "restart_caption", "restart_notes", "whole_vws"]

ALONE = "restarted alone at wave"  # marks a restart note of one VW (the others: the whole job)


def _cut(vw: int, inc: int, states: Sequence[ShardState]) -> tuple[int, int]:
    """The wave incarnation ``inc`` of VW ``vw`` rejoined at (the shards' ``inc``-th eviction
    of it; -1: unknown) and the buffered pushes the shards discarded there."""
    evs = [[e for e in s.evictions if e[0] == vw][inc - 1 : inc] for s in states]
    hits = [e[0] for e in evs if e]
    return min((e[1] for e in hits), default=-1), sum(e[2] for e in hits)


def restart_notes(
    restarted: Sequence[tuple[int, int, str]], states: Sequence[ShardState]
) -> tuple[str, ...]:
    """One line per VW restarted alone (``(vw, incarnation, cause)``): the cause, the wave it
    rejoined at (its cut: the shards' ``incarnation``-th eviction of it) and the buffered
    pushes the shards discarded (recomputed by the new incarnation; no wave is lost)."""
    notes = []
    for vw, inc, cause in restarted:
        wave, dropped = _cut(vw, inc, states)
        notes.append(f"{cause} (vw {vw} {ALONE} {wave}; {dropped} buffered "
                     "pushes discarded and recomputed, no wave lost)")  # fmt: skip
    return tuple(notes)


def whole_vws(
    vws: Sequence[VWResult],
    restarted: Sequence[tuple[int, int, str]],
    states: Sequence[ShardState],
    first_wave: int,
) -> tuple[VWResult, ...]:
    """``vws`` with each VW restarted alone counted whole: the minibatches its earlier
    incarnations trained up to its last cut (waves ``first_wave`` to the cut, kept by the
    shards) added to its last incarnation's, its throughput over the attempt."""
    last = {vw: inc for vw, inc, _ in sorted(restarted, key=lambda r: r[1])}
    start = min((s.start_time for v in vws for s in v.stages if s.start_time > 0), default=0.0)
    out = list(vws)
    for vw, inc in last.items():
        wave, _ = _cut(vw, inc, states)
        if wave >= first_wave and out[vw].stages:
            kept = (wave - first_wave) * out[vw].nm
            out[vw] = dataclasses.replace(out[vw], earlier=kept, run_start=start)
    return tuple(out)


def restart_caption(restarts: Sequence[str]) -> str:
    """The summary caption's part on restarts: the VWs restarted alone (where, what was
    recomputed) and the whole-job restarts from the last snapshot ("" for none)."""
    parts = []
    alone = [r for r in restarts if ALONE in r]
    for note in alone:  # "<cause> (vw K restarted alone at wave W; N buffered ...)"
        parts.append(note[note.rfind(" (vw ") + 2 : -1] if " (vw " in note else note)
    whole = [r for r in restarts if ALONE not in r]
    if whole:
        clock = re.search(r"restarted from clock (\d+)", whole[-1])
        since = f" (clock {clock.group(1)}: the table counts from there)" if clock else ""
        parts.append(f"the whole job restarted {len(whole)}x from the last snapshot{since}")
    return "; ".join(parts)
