"""The simulator's analytic checks (issue 5) and its bookkeeping."""

from __future__ import annotations

import dataclasses
import itertools
import random

import pytest

from planner.cluster import Link
from planner.draw import TraceEvent
from planner.predict import simulate_allreduce
from planner.schedule import FLUSH, HETPIPE, SCHEDULES, Schedule, actions
from planner.sim import simulator as simulator_module
from planner.sim.engine import simulate_pipelines
from planner.sim.simulator import allreduce_for_plan, pipeline_specs, simulate
from planner.sim.types import PipelineSpec, SimResult
from planner.throughput import measured_throughput
from profiler.errors import PlanError
from tests.planner.simplan import make_plan


def random_spec(rng: random.Random, n: int, comm: bool = True) -> PipelineSpec:
    fwd = [rng.uniform(0.5, 5.0) for _ in range(n)]
    bwd = [rng.uniform(1.0, 10.0) for _ in range(n)]
    rf = [0.0] + [rng.uniform(0.0, 1.0) if comm else 0.0 for _ in range(n - 1)]
    rb = [rng.uniform(0.0, 1.0) if comm else 0.0 for _ in range(n - 1)] + [0.0]
    return PipelineSpec.from_times(fwd, bwd, rf, rb)


def stage_ms(sp: PipelineSpec) -> list[float]:
    return [sum(x) for x in zip(sp.fwd_ms, sp.bwd_ms, sp.recv_fwd_ms, sp.recv_bwd_ms, strict=True)]


def period_ms(sp: PipelineSpec) -> float:
    """The steady state's time per minibatch: the busiest GPU or link. A GPU computes its
    stage's forward and backward; GPU ``s``'s link carries the activations to ``s + 1`` and
    the gradients to ``s - 1`` (transfers overlap computation, as in the runtime)."""
    n = sp.n_stages
    link = [
        (sp.recv_fwd_ms[s + 1] if s + 1 < n else 0.0) + (sp.recv_bwd_ms[s - 1] if s > 0 else 0.0)
        for s in range(n)
    ]
    return max(max(f + b for f, b in zip(sp.fwd_ms, sp.bwd_ms, strict=True)), *link)


def test_one_vw_enough_in_flight_is_bound_by_busiest_resource() -> None:
    """Analytic check 1: throughput = 1 / the busiest GPU's or link's time per minibatch
    within 1 %, once enough minibatches are in flight to cover a round trip (compute and
    transfers); never above it.

    With Nm = S it is an upper bound that the FIFO rule reaches unless two stages tie as
    bottlenecks (queueing then stretches a minibatch's round trip beyond Nm periods); see
    docs/simulator.md. ``D = 1``: with ``D = 0`` a stage's first update after a push also
    waits for the VW's whole wave (the fold wait, :func:`test_d0_update_waits_for_its_pull`).
    """
    rng = random.Random(11)
    short = 0
    for _ in range(40):
        n = rng.randint(1, 6)
        sp = random_spec(rng, n)
        period = period_ms(sp)
        expect = 8 * 1e3 / period
        round_trip = sum(stage_ms(sp))
        for nm in (n, n + 1, n + 3):
            res = simulate_pipelines([sp], nm=nm, D=1, waves=40, batch_size=8)
            assert res.throughput <= expect * 1.01, (sp, nm)
            if nm > n and nm * period >= 1.5 * round_trip:
                assert res.throughput == pytest.approx(expect, rel=0.01), (sp, nm)
            else:
                short += res.throughput < expect * 0.99
    assert short < 40
    # a pinned case, traced by hand: stage 0 runs F1 F2 B1, then F3 (admitted when B1 ends)
    # queues behind B2 (ready earlier, FIFO) and the pipeline drains once per wave
    sp = PipelineSpec.from_times([4.78, 3.05], [8.4, 3.94])
    assert simulate_pipelines([sp], nm=2, D=1, waves=40).throughput < 0.95 * 1e3 / 13.18
    assert simulate_pipelines([sp], nm=3, D=1, waves=40).throughput == pytest.approx(
        1e3 / 13.18, rel=0.01
    )
    # equal stages (the paper's Fig. 1 shape) reach the bound with Nm = S when transfers are
    # free; transfers of a twelfth of a stage lengthen the round trip, so more minibatches in
    # flight are needed (each helps, the bound is never passed)
    for n in (2, 4, 6):
        free = PipelineSpec.from_times([2.0] * n, [4.0] * n)
        assert simulate_pipelines([free], nm=n, D=1, waves=40, batch_size=8).throughput == (
            pytest.approx(8 * 1e3 / 6.0, rel=0.01)
        )
        sp = PipelineSpec.from_times(
            [2.0] * n, [4.0] * n, [0.0] + [0.5] * (n - 1), [0.5] * (n - 1) + [0.0]
        )
        got = [
            simulate_pipelines([sp], nm=nm, D=1, waves=40, batch_size=8).throughput
            for nm in range(n, n + 4)
        ]
        assert all(b >= a * 0.999 for a, b in itertools.pairwise(got))
        assert got[-1] <= 8 * 1e3 / 6.0 * 1.01
        assert got[-1] == pytest.approx(8 * 1e3 / 6.0, rel=0.04)
        assert got[0] < 8 * 1e3 / 6.0 * 0.95  # Nm = S no longer hides the transfers


def test_each_stage_waits_for_its_own_pull() -> None:
    """A stage's pull holds up that stage's forward that runs on the pulled weights, not the
    VW's admission: the runtime's stages each wait for their own pull (runtime/sync/wave.py).
    The cnn benchmark's `GR` plan, whose last stage holds most of the parameters, ran 1.15x
    the prediction that made admission wait for the slowest stage's pull."""

    def run(pull_ms: tuple[float, float]) -> list[TraceEvent]:
        sp = PipelineSpec.from_times([10.0, 10.0], [20.0, 20.0], pull_ms=pull_ms)
        res = simulate_pipelines([sp], nm=3, D=0, waves=6, batch_size=1, record_trace=True)
        return list(res.trace)

    trace = run((1.0, 40.0))
    waits = [e.end_ms - e.start_ms for e in trace if e.cat == "wait"]
    assert len(waits) == 5 and waits == pytest.approx([1.0] * 5)  # stage 0's own pull
    # wave 0 is pushed when B3 ends (no push time): the clock is 1, stage 1 pulls for 40 ms
    # and its first forward on those weights (minibatch 6, Nm = 3, D = 0) waits for it
    b3 = next(e for e in trace if (e.stage, e.cat, e.mb) == (0, "B", 3))
    fb6 = next(e for e in trace if (e.stage, e.cat, e.mb) == (1, "FB", 6))
    assert fb6.start_ms == pytest.approx(b3.end_ms + 40.0)
    # a first stage's long pull does hold up admission
    assert [e.end_ms - e.start_ms for e in run((40.0, 1.0)) if e.cat == "wait"] == pytest.approx(
        [40.0] * 5
    )


def test_transfers_overlap_compute_but_not_each_other() -> None:
    """A transfer occupies its link, not the receiving GPU: a link slower than both stages
    sets the pace (one transfer at a time), and a receive the GPU can hide behind other
    work costs nothing once the pipeline is full."""
    hidden = PipelineSpec.from_times([3.0, 3.0], [6.0, 6.0], [0.0, 2.0], [2.0, 0.0])
    assert simulate_pipelines([hidden], nm=4, D=1, waves=40, batch_size=8).throughput == (
        pytest.approx(8 * 1e3 / 9.0, rel=0.01)
    )
    slow = PipelineSpec.from_times([3.0, 3.0], [6.0, 6.0], [0.0, 12.0], [12.0, 0.0])
    res = simulate_pipelines([slow], nm=10, D=1, waves=40, batch_size=8, record_trace=True)
    assert res.throughput == pytest.approx(8 * 1e3 / 12.0, rel=0.01)
    for stage in (0, 1):  # the receives into one stage never overlap each other
        recv = sorted(
            (e.start_ms, e.end_ms) for e in res.trace if e.cat == "recv" and e.stage == stage
        )
        assert recv and all(a[1] <= b[0] + 1e-9 for a, b in itertools.pairwise(recv))


def _start_ms(res: SimResult, stage: int, cat: str, mb: int) -> float:
    return next(e.start_ms for e in res.trace if (e.stage, e.cat, e.mb) == (stage, cat, mb))


def test_d0_update_waits_for_its_pull() -> None:
    """With D = 0 a stage other than the last folds the pull after its wave's push before
    its next update (planner.wsp.folds_at_update). As on a GPU, only the update waits: the
    backward computes when it is ready, its gradients leave when it ends, and the stage is
    free once the pull arrived too (the runtime's stage waits in ``before_update``), except
    on stage 0: the runtime admitted the next wave's first forward ahead of that backward,
    and the forward waits for the pull. Nm = 2, traced by hand."""
    # stage 0 pulls in 5 ms: wave 0's push leaves when B2 ends (9), when F4 is due; B3, ready
    # at 10, runs after the pull (14), F4 after it; the last stage never waits (it folds at F4)
    sp = dataclasses.replace(PipelineSpec.from_times([1.0, 1.0], [2.0, 2.0]), pull_ms=(5.0, 0.0))
    res = simulate_pipelines([sp], nm=2, waves=2, record_trace=True)
    assert (_start_ms(res, 0, "B", 3), _start_ms(res, 0, "F", 4)) == (14.0, 16.0)
    assert _start_ms(res, 1, "FB", 4) == 17.0
    # a slow gradient link into stage 0 (10 ms): stage 1's B3 is ready at 24 (FB3 ends),
    # before the wave's last push (stage 0's B2, 27-29) started the pull: it computes 24-26,
    # its gradients leave at 26, its update waits for the pull (29); F4 arrived at 30
    sp = PipelineSpec.from_times([1.0] * 3, [2.0] * 3, [0.0] * 3, [10.0, 0.0, 0.0])
    res = simulate_pipelines([sp], nm=2, waves=2, record_trace=True)
    assert _start_ms(res, 1, "B", 3) == 24.0
    # its gradients, sent at 26, wait for the link (B2's until 27), not for the pull (31)
    assert _start_ms(res, 0, "recv", 3) == 27.0
    assert _start_ms(res, 1, "F", 4) == 30.0
    res = simulate_pipelines([sp], nm=2, D=1, waves=2, record_trace=True)
    assert _start_ms(res, 1, "B", 3) == 24.0  # D = 1 folds at the forward that needs it
    res = simulate_pipelines([sp], nm=2, waves=2, record_trace=True, alone=True)
    assert _start_ms(res, 1, "B", 3) == 24.0  # one VW alone (no shards) pulls nothing


def test_d0_fold_sends_the_gradients_before_the_pull_arrives() -> None:
    """A folding backward whose pull has not even started: it computes when ready, its
    gradients leave for the previous stage when it ends, long before the pull arrives, and
    its stage is free at the pull's arrival (its next task starts then), not a backward
    later. Nm = 2, 3 stages, traced by hand."""
    # forwards 1 ms, backwards 2 ms, a 10 ms gradient link into stage 0, stage 1 pulls in
    # 5 ms. Stage 1's B3 is ready at 24 (FB3 ends); the pull it folds starts only at 29
    # (wave 0's last push: stage 0's B2, 27-29) and arrives at 34
    sp = PipelineSpec.from_times([1.0] * 3, [2.0] * 3, [0.0] * 3, [10.0, 0.0, 0.0])
    sp = dataclasses.replace(sp, pull_ms=(0.0, 5.0, 0.0))
    res = simulate_pipelines([sp], nm=2, waves=2, record_trace=True)
    b3 = [(e.start_ms, e.end_ms) for e in res.trace if (e.stage, e.cat, e.mb) == (1, "B", 3)]
    assert b3 == [(24.0, 26.0)]  # main: 34-36, after the pull
    assert _start_ms(res, 0, "recv", 3) == 27.0  # once B2's gradients left the link (main: 36)
    assert _start_ms(res, 1, "F", 4) == 34.0  # free at the pull (main: 36)


def test_a_vw_without_shards_folds_no_pull(monkeypatch: pytest.MonkeyPatch) -> None:
    """A plan of one VW and no shards trains by the ``local`` rule (planner.sync): nothing is
    pulled, so no update waits for a pull at D = 0, as in the runtime. (Its pulls are free, so
    the fold, which holds the update alone, costs nothing here: the simulator must be told.)"""
    plan = make_plan([[("V", 2.0, 4.0), ("G", 3.0, 6.0), ("Q", 3.0, 6.0)]], nm=4, shards=False)
    specs = pipeline_specs(plan)
    alone = simulate_pipelines(specs, 4, 0, 20, plan.batch_size, alone=True).throughput
    told: list[bool] = []

    def spy(*args: object) -> SimResult:
        told.append(bool(args[-1]))
        return simulate_pipelines(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(simulator_module, "simulate_pipelines", spy)
    assert simulate(plan, waves=20).throughput == alone
    assert told == [True]


def test_one_vw_nm1_is_bound_by_sum_of_stages() -> None:
    """Analytic check 2: with Nm = 1, throughput = 1 / (sum of stage times and transfers)."""
    rng = random.Random(12)
    for _ in range(30):
        n = rng.randint(1, 6)
        sp = random_spec(rng, n)
        res = simulate_pipelines([sp], nm=1, D=rng.randint(0, 2), waves=20, batch_size=4)
        assert res.throughput == pytest.approx(4 * 1e3 / sum(stage_ms(sp)), rel=0.01)
        assert all(m == 1 for m in res.max_in_flight[0])


def test_identical_vws_d0_scale_minus_sync_cost() -> None:
    """Analytic check 3: D = 0 with identical VWs = single VW x #VWs minus the sync cost."""
    rng = random.Random(13)
    sp = random_spec(rng, 4)
    single = simulate_pipelines([sp], nm=4, D=0, waves=30).throughput
    for n_vw in (2, 5):
        free = simulate_pipelines([sp] * n_vw, nm=4, D=0, waves=30).throughput
        assert free == pytest.approx(n_vw * single, rel=0.01)
    # with push/pull costs: identical VWs move in lock-step, so each pays what one VW pays
    synced = PipelineSpec.from_times(
        sp.fwd_ms, sp.bwd_ms, sp.recv_fwd_ms, sp.recv_bwd_ms, push_ms=6.0, pull_ms=9.0
    )
    one = simulate_pipelines([synced], nm=4, D=0, waves=30)
    many = simulate_pipelines([synced] * 4, nm=4, D=0, waves=30)
    assert many.throughput == pytest.approx(4 * one.throughput, rel=0.01)
    assert many.throughput < 4 * single * 0.99  # the synchronisation cost is visible
    assert all(w > 0 for w in many.waiting_s)
    assert all(0 <= i <= w + 1e-12 for i, w in zip(many.idle_s, many.waiting_s, strict=True))


def test_clock_distance_never_exceeds_d_plus_1() -> None:
    """Analytic check 4: randomised plans and times, thousands of runs."""
    rng = random.Random(14)
    reached = 0
    for _ in range(2000):
        n_vw = rng.randint(2, 4)
        D = rng.randint(0, 2)
        nm = rng.randint(1, 3)
        specs = []
        for _ in range(n_vw):
            sp = random_spec(rng, rng.randint(1, 3))
            scale = rng.choice([1.0, 1.0, 3.0, 10.0])  # some VWs are stragglers
            specs.append(
                PipelineSpec.from_times(
                    [f * scale for f in sp.fwd_ms], sp.bwd_ms, sp.recv_fwd_ms, sp.recv_bwd_ms,
                    push_ms=rng.uniform(0, 3), pull_ms=rng.uniform(0, 3),
                )
            )  # fmt: skip
        res = simulate_pipelines(specs, nm=nm, D=D, waves=D + 4)
        assert res.max_clock_distance <= D + 1
        reached += res.max_clock_distance == D + 1
        for spec, peaks in zip(specs, res.max_in_flight, strict=True):
            assert all(
                p <= HETPIPE.in_flight_bound(s, spec.n_stages, nm) for s, p in enumerate(peaks)
            )
    assert reached > 100  # the bound is tight, not vacuous


def test_straggler_makes_fast_vw_wait() -> None:
    fast = PipelineSpec.from_times([1.0, 1.0], [2.0, 2.0])
    slow = PipelineSpec.from_times([3.0, 3.0], [6.0, 6.0])
    res = simulate_pipelines([fast, slow], nm=2, D=0, waves=10, batch_size=1)
    assert res.waiting_s[0] > 0 and res.waiting_s[1] == 0
    assert res.idle_s[0] > 0
    assert res.per_vw_throughput[0] == pytest.approx(res.per_vw_throughput[1], rel=0.05)
    loose = simulate_pipelines([fast, slow], nm=2, D=3, waves=10, batch_size=1)
    assert loose.waiting_s[0] < res.waiting_s[0]


def test_measured_throughput_definition() -> None:
    # one VW, nm = 2, 3 waves: wave 0 ends at t=20 ms, the last at t=60 ms: 4 minibatches in 40 ms
    assert measured_throughput([[10, 20, 30, 40, 50, 60]], 2, 10) == pytest.approx(10 * 4 / 0.040)
    with pytest.raises(PlanError, match="waves"):
        measured_throughput([[10, 20, 30]], 2, 10)


def test_trace_is_consistent() -> None:
    sp = PipelineSpec.from_times(
        [1.0, 2.0, 1.0], [2.0, 3.0, 2.0], [0, 0.5, 0.5], [0.5, 0.5, 0], push_ms=1.0
    )
    res = simulate_pipelines([sp, sp], nm=3, D=0, waves=4, record_trace=True)
    for v in range(2):
        for s in range(3):
            comp = sorted(
                (e.start_ms, e.end_ms)
                for e in res.trace
                if (e.vw, e.stage) == (v, s) and e.cat in ("F", "B", "FB")
            )
            assert len(comp) == (12 if s == 2 else 24)
            assert all(
                a[1] <= b[0] + 1e-9 for a, b in itertools.pairwise(comp)
            )  # one task at a time
    assert {e.cat for e in res.trace} >= {"F", "B", "FB", "recv", "push"}
    assert not simulate_pipelines([sp], nm=3, waves=3).trace  # off by default


def test_invalid_inputs() -> None:
    sp = PipelineSpec.from_times([1.0], [1.0])
    with pytest.raises(PlanError, match="waves"):
        simulate_pipelines([sp], nm=1, waves=1)
    with pytest.raises(PlanError, match="no virtual workers"):
        simulate_pipelines([], nm=1)
    with pytest.raises(PlanError, match=">= 0"):
        PipelineSpec.from_times([1.0, -1.0], [1.0, 1.0])


def test_simulate_plan_matches_stage_times_and_counts_bytes() -> None:
    plan = make_plan(
        [[("V", 2.0, 4.0), ("R", 2.0, 4.0), ("G", 3.0, 6.0), ("Q", 3.0, 6.0)]],
        nm=4,
        shards=False,  # one VW alone: no pull, no fold wait (at D = 0 too)
    )
    res = simulate(plan, waves=20)
    stages = plan.virtual_workers[0].stages
    # between the paper's stage time (receives included) and the compute alone: the
    # receives overlap computation, but 4 in flight cannot hide all of their latency
    slowest = max(s.time_ms for s in stages)
    compute = max(s.fwd_ms + s.bwd_ms for s in stages)
    assert 32 * 1e3 / slowest < res.throughput <= 32 * 1e3 / compute * 1.001
    # 3 cross-node cuts, 1 MB each way per minibatch, 80 minibatches
    assert res.cross_node_bytes == 3 * 2 * 1_000_000 * 80


def test_local_placement_moves_fewer_bytes_than_default() -> None:
    ed = [[("V", 2.0, 4.0), ("R", 2.0, 4.0), ("G", 3.0, 6.0), ("Q", 3.0, 6.0)] for _ in range(4)]
    default = simulate(make_plan(ed, nm=4, D=0, placement="default"), waves=10)
    local = simulate(make_plan(ed, nm=4, D=0, placement="local"), waves=10)
    assert local.cross_node_bytes < default.cross_node_bytes
    # its pushes share each GPU's own link with the activations (FIFO) instead of the
    # node's card: within 2 %
    assert local.throughput >= default.throughput * 0.98


def test_allreduce_formula() -> None:
    link = Link(bandwidth_bps=1e9, latency_s=0.0)
    r = simulate_allreduce(
        [10.0, 20.0, 15.0, 20.0], 4_000_000, link, 32, nodes=["a", "a", "b", "b"]
    )
    ar = 2 * 3 * (1_000_000 / 1e9) * 1e3  # 6 steps of 1 MB at 1 GB/s
    assert r.allreduce_ms == pytest.approx(ar)
    assert r.throughput == pytest.approx(4 * 32 / ((20.0 + ar) / 1e3))
    assert r.cross_node_bytes_per_iter == 2 * (2 * 3 * 1_000_000)
    assert simulate_allreduce([], 1, link, 1).throughput == 0.0


def test_allreduce_for_plan_without_profiles() -> None:
    np_plan = make_plan([[("V", 1.0, 2.0)] * 2, [("Q", 3.0, 6.0)] * 2], nm=2, D=0)
    r = allreduce_for_plan(np_plan)
    assert r.gpus == 16  # tiny synthetic model fits everywhere
    # the slowest worker is a Quadro P4000: its whole-model time is that VW's stage sum
    assert r.iteration_ms >= 18.0


@pytest.mark.parametrize("schedule", list(SCHEDULES.values()), ids=list(SCHEDULES))
def test_simulator_runs_the_schedules_action_list(schedule: Schedule) -> None:
    """Without transfers and WSP waits the simulator runs exactly :func:`actions`' order: the
    schedule's admission and task order, not a copy of them."""
    for n, nm in ((1, 2), (2, 2), (3, 2), (4, 4), (3, 5)):
        spec = PipelineSpec.from_times([1.0] * n, [2.0] * n)
        res = simulate_pipelines([spec], nm, D=10, waves=3, record_trace=True, schedule=schedule)
        ran = [
            [f"{e.cat}{e.mb}" for e in res.trace if e.stage == s and e.cat in ("F", "B", "FB")]
            for s in range(n)
        ]
        expected = actions(schedule, n, nm, 3 * nm)
        assert ran == [[f"{t.kind.value}{t.mb}" for t in tasks] for tasks in expected]


def test_flushing_every_wave_is_slower_than_hetpipe() -> None:
    spec = PipelineSpec.from_times([1.0] * 4, [2.0] * 4)
    ours = simulate_pipelines([spec], nm=4, waves=10, schedule=HETPIPE)
    flushed = simulate_pipelines([spec], nm=4, waves=10, schedule=FLUSH)
    assert flushed.throughput < 0.8 * ours.throughput
    assert flushed.max_in_flight == ours.max_in_flight == ((4, 4, 4, 1),)


def test_the_runtimes_overhead_per_task_lengthens_every_task() -> None:
    """``overhead_ms_per_task`` (measured by ``hetpipe run --profile-runtime``) adds to each
    task: one stage runs FB(p) back to back, so a minibatch takes fwd + bwd + overhead."""
    sp = PipelineSpec.from_times([2.0], [3.0])
    slow = dataclasses.replace(sp, overhead_ms_per_task=1.0).validated()
    assert simulate_pipelines([sp], nm=1, waves=20).throughput == pytest.approx(1e3 / 5.0)
    assert simulate_pipelines([slow], nm=1, waves=20).throughput == pytest.approx(1e3 / 6.0)
    two = PipelineSpec.from_times([1.0, 1.0], [1.0, 4.0])  # the last stage (FB, 5 ms) bounds
    over = dataclasses.replace(two, overhead_ms_per_task=0.5)
    assert simulate_pipelines([over], nm=3, waves=40).throughput == pytest.approx(
        1e3 / 5.5, rel=1e-3
    )
    with pytest.raises(PlanError, match=r"overhead_ms_per_task = -1.0: give a finite number"):
        dataclasses.replace(sp, overhead_ms_per_task=-1.0).validated()
