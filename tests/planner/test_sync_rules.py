"""The pure synchronisation rules: backup workers, elastic averaging, stragglers, wave play."""

from __future__ import annotations

import doctest

import pytest
from hypothesis import given
from hypothesis import strategies as st

import planner.backup
import planner.easgd
import planner.ranges
import planner.rules
import planner.sim.waves
import planner.straggle
import planner.sync
from planner.backup import Arrival, QuorumClock, continue_at, quorum, vw_minibatches
from planner.cluster import parse_cluster
from planner.easgd import check_elastic, elastic_centre, elastic_worker, exchange_index
from planner.sim.waves import play_waves
from planner.straggle import Straggle, uniform
from profiler.errors import ConfigError


@pytest.mark.parametrize(
    "module",
    [
        planner.backup,
        planner.easgd,
        planner.ranges,
        planner.rules,
        planner.sim.waves,
        planner.straggle,
        planner.sync,
    ],
)
def test_doctests(module: object) -> None:
    res = doctest.testmod(module)  # type: ignore[arg-type]
    assert res.attempted > 0 and res.failed == 0


def test_quorum_bounds() -> None:
    assert quorum(3, 0) == 3 and quorum(3, 2) == 1
    for bad in (-1, 3):
        with pytest.raises(ValueError, match=r"backups must be in 0\.\.2"):
            quorum(3, bad)


@given(st.permutations(list(range(5))), st.integers(0, 4))
def test_first_n_counted_in_id_order_rest_dropped(order: list[int], b: int) -> None:
    q = QuorumClock(5, b)
    got = [q.arrive(v, 0) for v in order]
    n = 5 - b
    assert q.clock == 1
    assert q.counted(0) == tuple(sorted(order[:n]))
    assert got[n - 1] is Arrival.CLOSED and set(got[: n - 1]) <= {Arrival.COUNTED}
    assert all(a is Arrival.DROPPED for a in got[n:])
    assert q.dropped() == tuple(sorted((v, 0) for v in order[n:]))


def test_drop_is_recorded_once_and_duplicates_refused() -> None:
    q = QuorumClock(3, 1)
    q.arrive(0, 0)
    q.arrive(1, 0)
    assert q.arrive(2, 0) is Arrival.DROPPED
    with pytest.raises(ValueError, match="already pushed"):
        q.arrive(2, 0)
    with pytest.raises(ValueError, match="already pushed"):
        q.arrive(0, 0)
    assert q.dropped() == ((2, 0),)


def test_a_full_wave_ahead_of_the_clock_drops_extra_pushes() -> None:
    q = QuorumClock(3, 1)
    assert q.arrive(0, 1) is Arrival.COUNTED
    assert q.arrive(1, 1) is Arrival.COUNTED
    assert q.arrive(2, 1) is Arrival.DROPPED  # wave 1 already holds its N = 2
    q.arrive(2, 0)
    assert q.arrive(0, 0) is Arrival.CLOSED and q.clock == 2  # both waves close at once
    assert q.counted(1) == (0, 1)


def test_elastic_update_is_the_papers() -> None:
    c, ws, a = 0.0, [1.0, 2.0, 3.0], 0.2
    assert elastic_centre(c, ws, a) == pytest.approx(0.2 * 6)
    assert [elastic_worker(w, c, a) for w in ws] == pytest.approx([0.8, 1.6, 2.4])
    # the total is conserved when n*alpha keeps the centre a moving average of the workers
    new = [elastic_worker(w, c, a) for w in ws]
    assert sum(new) + elastic_centre(c, ws, a) == pytest.approx(sum(ws) + c)
    assert exchange_index(7, 4) == 1


def test_elastic_parameters_checked() -> None:
    check_elastic(4, 2, 0.25)
    for args, msg in [
        ((4, 0, 0.1), "tau"),
        ((4, 1, 0.0), "alpha must"),
        ((4, 1, 0.3), "overshoot"),
    ]:
        with pytest.raises(ValueError, match=msg):
            check_elastic(*args)


def test_elastic_on_tensors() -> None:
    torch = pytest.importorskip("torch")
    c, ws = torch.zeros(3), [torch.ones(3), 3 * torch.ones(3)]
    torch.testing.assert_close(elastic_centre(c, ws, 0.25), torch.full((3,), 1.0))
    torch.testing.assert_close(elastic_worker(ws[1], c, 0.25), torch.full((3,), 2.25))


def test_straggle_is_a_pure_function_of_seed_vw_wave() -> None:
    s = Straggle(0.3, 3.0, seed=7)
    a = [s.slowdown(v, c) for v in range(3) for c in range(50)]
    assert a == [s.slowdown(v, c) for v in range(3) for c in range(50)]
    assert set(a) == {1.0, 3.0}
    assert a != [s.with_seed(8).slowdown(v, c) for v in range(3) for c in range(50)]
    assert 0.0 <= uniform(1, 2, 3) < 1.0
    with pytest.raises(ValueError, match="factor"):
        Straggle(0.1, 0.5)


def test_cluster_yaml_straggle_round_trip_and_errors() -> None:
    node = {"name": "V", "gpu": "TITAN V", "count": 1}
    emu = {"speed": 0.1, "memory": "4MiB", "straggle": {"p": 0.05, "factor": 3}}
    c = parse_cluster({"nodes": [{**node, "emulate": emu}]})
    assert c.nodes[0].emulation is not None
    assert c.nodes[0].emulation.straggle == Straggle(0.05, 3.0, 0)
    assert parse_cluster(c.to_dict()).nodes == c.nodes
    emu["straggle"] = {"p": 0.05, "factor": 0.5}
    with pytest.raises(ConfigError, match=r"emulate\.straggle\.factor"):
        parse_cluster({"nodes": [{**node, "emulate": emu}]}, "c.yaml")


def test_backup_without_backups_or_stragglers_is_wsp_d0() -> None:
    slow = Straggle(0.2, 3.0, seed=3)
    wsp = play_waves("wsp", [7.0, 9.0, 11.0], 30, 3, slow)
    bk = play_waves("backup", [7.0, 9.0, 11.0], 30, 3, slow, backups=0)
    assert bk.arrivals_ms == wsp.arrivals_ms and bk.closed_ms == wsp.closed_ms
    assert bk.dropped == 0 and bk.applied == 90


def test_backups_hide_stragglers_and_wsp_d_helps() -> None:
    slow = Straggle(0.1, 3.0, seed=0)
    t = [10.0] * 4
    d0 = play_waves("wsp", t, 100, 4, slow).makespan_ms
    assert play_waves("wsp", t, 100, 4, slow, D=3).makespan_ms < d0
    bk = play_waves("backup", t, 100, 4, slow, backups=1)
    assert bk.makespan_ms < d0
    assert all(len(a) >= 3 for a in bk.arrivals_ms)
    # Fig. 4: the k-th push of a wave comes no earlier than the (k-1)-th
    assert all(list(a) == sorted(a) for a in bk.arrivals_ms)
    assert bk.applied == 3 * 100


def test_easgd_meets_every_tau_waves() -> None:
    play = play_waves("easgd", [10.0, 20.0], 12, 2, tau=3)
    assert play.closed_ms[:6] == (20.0, 40.0, 60.0, 80.0, 100.0, 120.0)  # the slow VW's pace
    # the fast VW runs waves 0-8 freely (exchange 1 at 60 ms needs both VWs' exchange 0, made
    # at 60 ms), then exchange 2 (90 ms) waits for the slow one's exchange 1 (120 ms)
    fast = [a[0] for a in play.arrivals_ms]
    assert fast == [10.0, 20.0, 30.0, 40.0, 50.0, 60.0, 70.0, 80.0, 90.0, 130.0, 140.0, 150.0]
    with pytest.raises(ValueError, match="unknown synchronisation rule"):
        play_waves("gossip", [1.0], 2, 1)


def test_predict_rule_on_a_plan_uses_the_clusters_stragglers() -> None:
    from hetpipe.planning import profiles_for
    from planner.cluster import load_cluster
    from planner.planner import make_plan
    from planner.sim.waves import plan_slowdown, predict_rule

    doc = load_cluster("examples/emulated_cluster.yaml").to_dict()
    doc.pop("runtime_overhead", None)  # stragglers alone: the wave times the test was built on
    for node in doc["nodes"]:
        node["emulate"]["straggle"] = {"p": 0.2, "factor": 3}
    cluster = parse_cluster(doc)
    cpu = profiles_for(cluster, [], "mlp", 32)
    plan = make_plan(cluster, cpu, model="mlp", batch_size=32, num_vws=2, policy="hd")
    slow = plan_slowdown(plan)
    assert {slow(v, c) for v in range(2) for c in range(40)} == {1.0, 3.0}
    wsp = predict_rule(plan, "wsp", 30)
    easgd = predict_rule(plan, "easgd", 30, tau=4)
    assert easgd.makespan_ms < wsp.makespan_ms  # exchanges every 4 waves absorb stragglers
    assert predict_rule(plan, "backup", 30, backups=1).dropped > 0


@given(
    st.integers(1, 5).flatmap(lambda n: st.tuples(st.just(n), st.integers(0, n - 1))),
    st.integers(1, 8),
    st.lists(st.integers(0, 10**6), min_size=200, max_size=200),
)
def test_late_vws_continue_at_the_clock_and_every_run_ends(
    nb: tuple[int, int], waves: int, picks: list[int]
) -> None:
    """Any interleaving of VWs pushing (D = 0) and pulling: a pull after pushing wave ``c``
    is answered once ``c`` closed and the VW continues at :func:`continue_at`; a VW whose
    number reaches the run's end stops. Nothing ever waits for a wave that never comes: the
    run always finishes at global clock ``waves``, each VW with :func:`vw_minibatches`."""
    n, b = nb
    q = QuorumClock(n, b)
    wave, data, pulling = [0] * n, [0] * n, [False] * n
    pushes: list[list[int]] = [[] for _ in range(n)]
    step = 0
    while True:
        live = [v for v in range(n) if wave[v] < waves]
        enabled = [v for v in live if not pulling[v] or q.clock > wave[v]]
        if not live:
            break
        assert enabled, f"stuck at clock {q.clock}: waves {wave}, pulling {pulling}"
        v = enabled[picks[step % len(picks)] % len(enabled)]
        step += 1
        if not pulling[v]:
            assert q.clock >= wave[v]  # D = 0: the wave's last minibatch had its clock
            q.arrive(v, wave[v])
            pushes[v].append(wave[v])
            pulling[v] = True
        else:
            wave[v], data[v], pulling[v] = continue_at(wave[v], q.clock), data[v] + 1, False
            assert wave[v] >= q.clock  # never works on a wave that closed already
    assert q.clock == waves
    assert all(len(q.counted(c)) == n - b for c in range(waves))
    for v in range(n):
        assert pushes[v] == sorted(set(pushes[v])) and all(c < waves for c in pushes[v])
        skipped = wave[v] - data[v]
        assert len(pushes[v]) == waves - skipped if wave[v] == waves else len(pushes[v]) == data[v]
        # its stage 0 had admitted one minibatch of the next data wave when it jumped
        runs = vw_minibatches(waves, skipped, data[v] * 2 + 1, 2) // 2
        assert runs == data[v] + 1 if wave[v] > waves else runs in (data[v], data[v] + 1)
    if b == 0:
        assert all(p == list(range(waves)) for p in pushes)


def test_continue_at_and_the_end_rule() -> None:
    assert continue_at(3, 4) == 4 and continue_at(3, 9) == 9
    with pytest.raises(ValueError, match="clock >= 4"):
        continue_at(3, 3)
    assert vw_minibatches(5, 0, 0, 2) == 10 and vw_minibatches(5, 5, 1, 2) == 2
    with pytest.raises(ValueError, match="nm >= 1"):
        vw_minibatches(5, 0, 0, 0)


def test_a_late_vw_rejoins_in_the_wave_player() -> None:
    """VW 3 straggles 10x in its data wave 2: the others close waves without it; when it is
    back it continues at the clock (its numbers skip), and once VW 0 straggles in turn its
    pushes count again (with equal speeds a VW that rejoins mid-wave stays last until then)."""
    slow = lambda v, d: 10.0 if (v, d) in ((3, 2), (0, 15)) else 1.0  # noqa: E731
    play = play_waves("backup", [10.0] * 4, 30, 2, slow, backups=1)
    nums = play.numbers[3]
    assert nums[:2] == (0, 1) and nums[3] > nums[2] + 1  # the late wave, then a jump
    assert sum(3 in play.counted[c] for c in nums[3:] if c < len(play.counted)) > 0
    assert len(nums) < 30 and all(len(play.numbers[v]) == 30 for v in (1, 2))
