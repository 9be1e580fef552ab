"""A shard with backup workers (planner.backup): quorum, fixed-order sums, drops recorded once."""

from __future__ import annotations

import random

import pytest
import torch

from profiler.errors import ConfigError
from runtime.ps.core import ShardCore
from runtime.ps.layout import ShardSpec
from runtime.ps.outcome import Status
from tests.runtime.test_ps import init_weights, specs, update


def _numel(spec: ShardSpec, vw: int, stage: int) -> int:
    return spec.client_numel(spec.client(vw, stage))


def _expected(spec: ShardSpec, counted: list[set[int]]) -> torch.Tensor:
    """w0 + the updates of the counted VWs of each wave, in (vw, stage) order."""
    w = init_weights(spec)
    for wave, vws in enumerate(counted):
        for c in spec.clients:
            if c.vw in vws:
                u, pos = update(c.vw, c.stage, wave, spec.client_numel(c)), 0
                for off, n in spec.segments(c):
                    w[off : off + n] += u[pos : pos + n]
                    pos += n
    return w


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("backups", [1, 2])
def test_first_n_vws_make_the_wave_late_pushes_are_dropped_once(seed: int, backups: int) -> None:
    """D = 0 pushes in a random order per wave: the first N complete VWs are applied, the rest
    (late, or the pushed parts of a VW that did not complete in time) never reach the weights,
    each tag recorded exactly once in either the ledger or the dropped list."""
    rng = random.Random(seed)
    for spec in specs(D=0):
        core = ShardCore(spec, init_weights(spec), backups=backups)
        n = len(spec.vws) - backups
        counted: list[set[int]] = []
        for wave in range(4):
            tags = [(c.vw, c.stage) for c in spec.clients]
            rng.shuffle(tags)
            done: dict[int, int] = {}
            first: list[int] = []
            for vw, stage in tags:
                late = len(first) >= n
                # a late push carries garbage: if it ever reached the weights the sum would show it
                u = update(vw, stage, wave, _numel(spec, vw, stage))
                res = core.push(vw, stage, wave, torch.full_like(u, 1e6) if late else u)
                assert res.status == (Status.DROPPED if late else Status.OK)
                done[vw] = done.get(vw, 0) + 1
                if done[vw] == sum(1 for c in spec.clients if c.vw == vw) and not late:
                    first.append(vw)
            counted.append(set(first))
            assert core.clock == wave + 1
        torch.testing.assert_close(core.weights(), _expected(spec, counted), rtol=0, atol=0)
        applied = {(e.vw, e.stage, e.wave) for e in core.ledger}
        dropped = [(e.vw, e.stage, e.wave) for e in core.dropped]
        assert len(set(dropped)) == len(dropped) and not applied & set(dropped)
        everything = {(c.vw, c.stage, w) for c in spec.clients for w in range(4)}
        assert applied | set(dropped) == everything
        assert applied == {
            (c.vw, c.stage, w) for w in range(4) for c in spec.clients if c.vw in counted[w]
        }


def test_a_dropped_tag_sent_again_is_a_duplicate_and_the_clock_distance_stays_bounded() -> None:
    spec = specs(D=0)[0]
    core = ShardCore(spec, init_weights(spec), backups=1)
    for vw in (0, 2):
        for c in spec.clients:
            if c.vw == vw:
                assert (
                    core.push(vw, c.stage, 0, update(vw, c.stage, 0, spec.client_numel(c))).status
                    == Status.OK
                )
    assert core.clock == 1
    u = update(1, 0, 0, _numel(spec, 1, 0))
    assert core.push(1, 0, 0, u).status == Status.DROPPED
    assert core.push(1, 0, 0, u).status == Status.DUPLICATE
    assert [(e.vw, e.stage, e.wave) for e in core.dropped] == [(1, 0, 0)]
    # the late VW goes on with its next wave, which counts if it comes among the first N
    for c in spec.clients:
        if c.vw == 1:
            assert (
                core.push(1, c.stage, 1, update(1, c.stage, 1, spec.client_numel(c))).status
                == Status.OK
            )
    assert core.push(1, 1, 0, update(1, 1, 0, _numel(spec, 1, 1))).status == Status.DROPPED
    assert core.push(0, 0, 2, update(0, 0, 2, _numel(spec, 0, 0))).status == Status.TOO_FAR_AHEAD
    assert max(e.distance for e in core.trace) <= 1


def test_no_backups_is_wsp() -> None:
    """backups = 0 takes the WSP path: nothing is dropped, every VW is waited for."""
    spec = specs(D=0)[0]
    core = ShardCore(spec, init_weights(spec), backups=0)
    for c in spec.clients:
        if c.vw != 2:
            core.push(c.vw, c.stage, 0, update(c.vw, c.stage, 0, spec.client_numel(c)))
    assert core.clock == 0 and not core.dropped


@pytest.mark.parametrize("seed", range(4))
def test_two_shards_count_the_same_vws_whatever_order_each_sees(seed: int) -> None:
    """Shard 0 decides each wave's quorum from the pushes it sees first; shard 1 sees another
    order, receives the decisions (as over runtime.ps.peers, at a random moment) and counts
    exactly the same VWs: its late pushes carry 1e6 and never show in its weights."""
    rng = random.Random(seed)
    s0, s1 = specs(D=0)
    lead = ShardCore(s0, init_weights(s0), backups=1)
    follow = ShardCore(s1, init_weights(s1), backups=1, decides=False)
    assert lead.decides and not follow.decides
    counted: list[set[int]] = []
    for wave in range(4):
        order0 = [(c.vw, c.stage) for c in s0.clients]
        order1 = [(c.vw, c.stage) for c in s1.clients]
        rng.shuffle(order0)
        rng.shuffle(order1)
        for vw, stage in order0:
            lead.push(vw, stage, wave, update(vw, stage, wave, _numel(s0, vw, stage)))
        ((c, vws),) = lead.decisions()
        assert c == wave and lead.clock == wave + 1
        counted.append(set(vws))
        told = rng.randrange(len(order1) + 1)  # the decision arrives after `told` pushes
        for i, (vw, stage) in enumerate([*order1, (-1, -1)]):
            if i == told:
                follow.decide(wave, vws)
            if vw >= 0:
                u = update(vw, stage, wave, _numel(s1, vw, stage))
                follow.push(vw, stage, wave, u if vw in vws else torch.full_like(u, 1e6))
        assert follow.clock == wave + 1 and not follow.decisions()
    for spec, core in ((s0, lead), (s1, follow)):
        torch.testing.assert_close(core.weights(), _expected(spec, counted), rtol=0, atol=0)
        by_wave = [{e.vw for e in core.ledger if e.wave == w} for w in range(4)]
        assert by_wave == counted
    with pytest.raises(ConfigError, match="does not take"):
        lead.decide(4, (0, 1))
