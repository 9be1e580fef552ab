"""Eviction of a lost VW at the shards (``--on-failure continue``): pure state machine tests.

Two shards exchange their VW clocks through FIFO queues delivered in random order with the
pushes; VW 1 dies after a random prefix of its pushes (possibly between its pushes to shard 0
and shard 1 of one wave). Both shards must agree on the cut, hold VW 1's updates of the waves
below it exactly once and none above, and apply every survivor update once.
"""

from __future__ import annotations

import random
from collections import deque

import pytest
import torch

from profiler.errors import ConfigError
from runtime.ps.core import ShardCore
from runtime.ps.layout import ShardSpec
from runtime.ps.outcome import Status
from tests.runtime.test_ps import init_weights, specs, update

WAVES = 4
DEAD = 1


def expected(spec: ShardSpec, cut: int) -> torch.Tensor:
    """w0 + every update of the survivors and VW ``DEAD``'s updates of waves below ``cut``."""
    w = init_weights(spec)
    for c in spec.clients:
        for wave in range(cut if c.vw == DEAD else WAVES):
            u, pos = update(c.vw, c.stage, wave, spec.client_numel(c)), 0
            for off, n in spec.segments(c):
                w[off : off + n] += u[pos : pos + n]
                pos += n
    return w


def push(core: ShardCore, vw: int, stage: int, wave: int) -> None:
    n = core.spec.client_numel(core.spec.client(vw, stage))
    assert core.push(vw, stage, wave, update(vw, stage, wave, n)).status == Status.OK


def run_scenario(seed: int) -> tuple[ShardCore, ShardCore]:
    """Both shards after VW ``DEAD`` died at a random point; messages in random order."""
    rng = random.Random(seed)
    shard_specs = specs()
    cores = [ShardCore(s, init_weights(s), peers=[1 - s.id]) for s in shard_specs]
    # each stage pushes its waves in order, to its shards in id order (one client's program)
    holds = {(c.vw, c.stage, s.id) for s in shard_specs for c in s.clients}
    programs = {
        (vw, st): deque((sid, w) for w in range(WAVES) for sid in (0, 1) if (vw, st, sid) in holds)
        for vw, st, _ in holds
    }
    dead_after = rng.randrange(
        0, 3 * WAVES + 1
    )  # VW 1 has 3 (client, shard) pairs  # pushes VW DEAD makes in all before dying
    made = 0
    wires: list[deque[tuple[tuple[int, ...], tuple[bool, ...]]]] = [deque(), deque()]

    sent: list[object] = [None, None]

    def tell(sid: int) -> None:  # shard sid's report travels to the other shard, when it changed
        rep = cores[sid].report()
        if rep != sent[sid]:
            wires[1 - sid].append(rep)
            sent[sid] = rep

    died = False
    while any(programs.values()) or any(wires) or not died:
        if not died and made == dead_after:  # VW DEAD dies: its programs stop, shards notice
            died = True
            for key in programs:
                if key[0] == DEAD:
                    programs[key].clear()
            for core in cores:
                core.lose(DEAD)
                for c in core.spec.clients:
                    if c.vw == DEAD:
                        core.end_pushes(c.vw, c.stage)
                tell(core.spec.id)
            continue
        choices = [k for k, p in programs.items() if p] + [f"wire{i}" for i in (0, 1) if wires[i]]
        pick = rng.choice(choices)
        if isinstance(pick, str):
            to = int(pick[-1])
            cores[to].peer_report(1 - to, *wires[to].popleft())
            tell(to)
            continue
        vw, stage = pick
        sid, wave = programs[pick].popleft()
        made += vw == DEAD
        push(cores[sid], vw, stage, wave)
        tell(sid)
    return cores[0], cores[1]


@pytest.mark.parametrize("seed", range(40))
def test_a_vw_dying_between_shards_is_wholly_in_or_out_at_both(seed: int) -> None:
    a, b = run_scenario(seed)
    assert len(a.evictions) == len(b.evictions) == 1
    cut = a.evictions[0].wave
    assert b.evictions[0].wave == cut and a.evictions[0].vw == DEAD
    for core in (a, b):
        assert core.clock == WAVES and not core.waiting_on_eviction
        tags = [(e.vw, e.stage, e.wave) for e in core.ledger]
        assert len(tags) == len(set(tags))  # exactly once
        want = {
            (c.vw, c.stage, w)
            for c in core.spec.clients
            for w in range(cut if c.vw == DEAD else WAVES)
        }
        assert set(tags) == want  # the dead VW's waves below the cut, none above
        torch.testing.assert_close(core.weights(), expected(core.spec, cut), rtol=0, atol=0)
        applied_dead = sum(t[0] == DEAD for t in tags)
        assert core.evictions[0].discarded + applied_dead <= WAVES * len(
            [c for c in core.spec.clients if c.vw == DEAD]
        )


def test_a_wave_complete_here_waits_for_the_peer() -> None:
    spec = specs()[0]
    core = ShardCore(spec, init_weights(spec), peers=[1])
    for c in spec.clients:
        push(core, c.vw, c.stage, 0)
    assert core.local_clocks() == (1, 1, 1) and core.clock == 0  # shard 1 has not said so
    assert core.peer_report(1, (1, 0, 1), (False,) * 3) == 0 and core.clock == 0
    assert core.peer_report(1, (1, 1, 1), (False,) * 3) == 1 and core.clock == 1


def test_a_lost_vw_blocks_until_final_everywhere_then_is_cut_at_the_minimum() -> None:
    spec = specs()[0]
    core = ShardCore(spec, init_weights(spec), peers=[1])
    for c in spec.clients:
        push(core, c.vw, c.stage, 0)
        if c.vw == DEAD:
            push(core, c.vw, c.stage, 1)  # wave 1 of VW 1 complete here only
    core.peer_report(1, (1, 1, 1), (False,) * 3)
    assert core.clock == 1
    core.lose(DEAD)
    assert core.waiting_on_eviction and not core.evictions
    for c in spec.clients:
        if c.vw == DEAD:
            core.end_pushes(c.vw, c.stage)
    assert core.report()[1] == (False, True, False) and not core.evictions  # peer not final
    core.peer_report(1, (1, 1, 1), (False, True, False))
    (ev,) = core.evictions
    assert (ev.vw, ev.wave, ev.discarded) == (DEAD, 1, 2)  # its 2 clients' wave-1 pushes
    for c in spec.clients:
        if c.vw != DEAD:
            push(core, c.vw, c.stage, 1)
    core.peer_report(1, (2, 1, 2), (False, True, False))
    assert core.clock == 2 and core.state().evictions == ((DEAD, 1, 2),)


def test_a_report_from_a_stranger_is_refused() -> None:
    spec = specs()[0]
    core = ShardCore(spec, init_weights(spec), peers=[1])
    with pytest.raises(ConfigError, match="report of shard 5"):
        core.peer_report(5, (0, 0, 0), (False,) * 3)
    with pytest.raises(ConfigError, match="with 2 VW clocks"):
        core.peer_report(1, (0, 0), (False,) * 2)
