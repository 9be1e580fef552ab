"""Restart of a lost VW at the shards (``--on-failure restart``): pure state machine tests.

As in ``test_eviction.py``, two shards exchange their reports in random order with the
pushes and VW 1 dies after a random prefix of its pushes. With ``rejoin`` both shards must
agree on the cut, drop its buffered pushes from the cut on once, and wait there for its next
incarnation, whose pushes (other values) then fill the waves from the cut: every update
applied once, the dead incarnation's wholly below the cut, the new one's wholly from it. A
shard accepts the new incarnation's messages only once it reopened the VW itself (its server
starts that incarnation's readers then). Without a restart (:meth:`ShardCore.release`) the
VW is left out from the same cut.
"""

from __future__ import annotations

import random
from collections import deque
from typing import Any

import pytest
import torch

from runtime.ps.core import ShardCore
from runtime.ps.layout import ShardSpec
from tests.runtime.test_eviction import DEAD, WAVES, push
from tests.runtime.test_ps import init_weights, specs, update

NEW = -3.0  # the new incarnation's updates: the old ones times this


def expected(spec: ShardSpec, cut: int, rejoined: bool) -> torch.Tensor:
    """w0 + the survivors' updates + VW ``DEAD``'s old updates below ``cut`` and, rejoined,
    its new incarnation's from ``cut`` on."""
    w = init_weights(spec)
    for c in spec.clients:
        for wave in range(WAVES):
            n = spec.client_numel(c)
            if c.vw != DEAD or wave < cut:
                u = update(c.vw, c.stage, wave, n)
            elif rejoined:
                u = NEW * update(c.vw, c.stage, wave, n)
            else:
                continue
            pos = 0
            for off, k in spec.segments(c):
                w[off : off + k] += u[pos : pos + k]
                pos += k
    return w


def gated(cores: list[ShardCore]) -> None:
    """The commit rule across incarnations: a shard applied a wave of the new incarnation
    only once the other shard holds that incarnation's pushes of it."""
    for a, b in ((cores[0], cores[1]), (cores[1], cores[0])):
        cut, vi = a.rejoin_wave(DEAD), a.spec.vws.index(DEAD)
        if cut is not None and a.clock > cut and a.incarnation(DEAD) == 1:
            assert b.incarnation(DEAD) == 1 and b.local_clocks()[vi] >= a.clock, (cut, a.clock)


def run_scenario(seed: int, restart: bool) -> tuple[ShardCore, ShardCore]:
    """Both shards after VW ``DEAD`` died at a random point and (``restart``) came back."""
    rng = random.Random(seed)
    shard_specs = specs()
    cores = [ShardCore(s, init_weights(s), peers=[1 - s.id], rejoin=True) for s in shard_specs]
    holds = {(c.vw, c.stage, s.id) for s in shard_specs for c in s.clients}
    order = sorted({(vw, st) for vw, st, _ in holds})

    def program(vw: int, st: int, first: int) -> deque[tuple[int, int]]:
        return deque(
            (sid, w) for w in range(first, WAVES) for sid in (0, 1) if (vw, st, sid) in holds
        )

    programs = {key: program(*key, 0) for key in order}
    dead_after = rng.randrange(0, 3 * WAVES + 1)
    made, died, back, released = 0, False, False, False
    wires: list[deque[object]] = [deque(), deque()]
    sent: list[object] = [None, None]

    def tell(sid: int) -> None:
        rep = cores[sid].report()
        if rep != sent[sid]:
            wires[1 - sid].append(rep)
            sent[sid] = rep

    reopened, gave_up = [False, False], set()
    ends: list[deque[Any]] = [deque(), deque()]
    busy = lambda: any(programs.values()) or any(wires) or any(ends)  # noqa: E731
    while busy() or not died or not back or (released and len(gave_up) < 2):
        if not died and made == dead_after:  # each shard notices its streams end, in turn
            died = True
            for key in programs:
                if key[0] == DEAD:
                    programs[key].clear()
            ends = [deque(c for c in core.spec.clients if c.vw == DEAD) for core in cores]
            continue
        reopened = [core.incarnation(DEAD) == 1 for core in cores]
        if died and not back and any(reopened):  # the launcher restarts (or gives up on) it
            back = True
            cut = next(c.rejoin_wave(DEAD) for c in cores if c.incarnation(DEAD) == 1)
            assert cut is not None
            for key in order:
                if key[0] == DEAD and restart:
                    programs[key] = program(*key, cut)
            released = not restart
        choices: list[object] = [f"wire{i}" for i in (0, 1) if wires[i]]
        choices += [f"end{i}" for i in (0, 1) if ends[i]]
        choices += [
            k for k, p in programs.items() if p and (k[0] != DEAD or not back or reopened[p[0][0]])
        ]
        choices += [f"release{i}" for i in (0, 1) if released and reopened[i] and i not in gave_up]
        if not choices:  # a shard has not reopened yet: only its peer's report can move it
            raise AssertionError(f"stuck: reopened {reopened}, wires {[len(w) for w in wires]}")
        pick = rng.choice(choices)
        if isinstance(pick, str) and pick.startswith("end"):
            to = int(pick[-1])
            c = ends[to].popleft()
            cores[to].lose(DEAD)
            cores[to].end_pushes(c.vw, c.stage)
            tell(to)
            continue
        if isinstance(pick, str) and pick.startswith("release"):
            to = int(pick[-1])
            cores[to].release(DEAD)
            gave_up.add(to)
            tell(to)
            continue
        if isinstance(pick, str):
            to = int(pick[-1])
            cores[to].peer_report(1 - to, *wires[to].popleft())  # type: ignore[misc]
            tell(to)
            if restart:
                gated(cores)
            continue
        assert isinstance(pick, tuple)
        vw, stage = pick
        sid, wave = programs[pick].popleft()
        n = cores[sid].spec.client_numel(cores[sid].spec.client(vw, stage))
        if vw == DEAD and back:
            assert cores[sid].push(vw, stage, wave, NEW * update(vw, stage, wave, n)).status == 0
        else:
            made += vw == DEAD
            push(cores[sid], vw, stage, wave)
        tell(sid)
        if restart:
            gated(cores)
    return cores[0], cores[1]


@pytest.mark.parametrize("seed", range(30))
def test_a_restarted_vw_fills_the_waves_from_the_cut_exactly_once(seed: int) -> None:
    a, b = run_scenario(seed, restart=True)
    cut = a.evictions[0].wave
    assert [e.wave for e in b.evictions] == [cut] and a.rejoin_wave(DEAD) == b.rejoin_wave(
        DEAD
    ) == cut
    for core in (a, b):
        assert core.clock == WAVES and core.incarnation(DEAD) == 1
        tags = [(e.vw, e.stage, e.wave) for e in core.ledger]
        assert len(tags) == len(set(tags)) == WAVES * len(core.spec.clients)  # every one, once
        torch.testing.assert_close(core.weights(), expected(core.spec, cut, True), rtol=0, atol=0)


@pytest.mark.parametrize("seed", range(10))
def test_without_a_restart_the_vw_is_left_out_at_the_same_cut(seed: int) -> None:
    a, b = run_scenario(seed, restart=False)
    cut = a.evictions[0].wave
    assert b.evictions[0].wave == cut
    for core in (a, b):
        assert core.clock == WAVES and not core.unsettled
        tags = {(e.vw, e.stage, e.wave) for e in core.ledger}
        assert not any(t[0] == DEAD and t[2] >= cut for t in tags)
        torch.testing.assert_close(core.weights(), expected(core.spec, cut, False), rtol=0, atol=0)


def test_a_report_of_another_incarnation_is_ignored() -> None:
    spec = specs()[0]
    core = ShardCore(spec, init_weights(spec), peers=[1], rejoin=True)
    for c in spec.clients:
        push(core, c.vw, c.stage, 0)
    assert core.peer_report(1, (1, 1, 1), (False,) * 3, (0, 1, 0)) == 0  # vw 1's entry: ignored
    assert core.clock == 0
    assert core.peer_report(1, (1, 1, 1), (False,) * 3, (0, 0, 0)) == 1 and core.clock == 1
