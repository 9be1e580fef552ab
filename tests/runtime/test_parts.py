"""Pure parts of the runtime: data order, cuts, roles, memory accounting, pacing."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from planner.manual import balanced_cuts, manual_plan
from profiler.errors import ConfigError, HetPipeRuntimeError
from profiler.graph import ModelGraph
from runtime.config import ModelSource, RunConfig
from runtime.data import DigitsDataset, MinibatchSource, SyntheticDataset
from runtime.launch.roles import stage_contexts, total_steps
from runtime.stage.comm import cut_specs
from runtime.stage.emulation import Calibration, MemoryMeter, pace_until
from runtime.stage.model import build_stage, reference_module, resolve_source


def test_minibatch_order_is_deterministic_and_covers_each_epoch() -> None:
    ds = SyntheticDataset(((3,),), (torch.float32,), (), torch.int64, classes=5, size=40, seed=1)
    a = MinibatchSource(ds, 8, seed=7)
    b = MinibatchSource(ds, 8, seed=7)
    assert a.steps_per_epoch == 5
    first_epoch = sorted(i for mb in range(1, 6) for i in a.indices(mb))
    assert first_epoch == list(range(40))
    assert a.indices(6) != a.indices(1)  # a new permutation each epoch
    x1, y1 = a.batch(3)
    x2, y2 = b.batch(3)
    assert torch.equal(x1[0], x2[0]) and torch.equal(y1, y2)
    assert MinibatchSource(ds, 8, seed=8).indices(1) != a.indices(1)


def test_digits_is_the_mlp_default() -> None:
    ds = DigitsDataset()
    x, y = ds[0]
    assert x.shape == (64,) and float(x.min()) >= 0.0 and float(x.max()) <= 1.0
    assert int(y) in range(10)


def test_too_small_dataset_is_a_config_error() -> None:
    ds = SyntheticDataset(((3,),), (torch.float32,), (), torch.int64, classes=5, size=4)
    with pytest.raises(ConfigError, match="fewer than one minibatch"):
        MinibatchSource(ds, 8)


def test_balanced_cuts_and_roles() -> None:
    source = ModelSource(ref="mlp")
    graph = ModelGraph.from_spec(resolve_source(source, 4, meta=True))
    for n in (1, 2, 3, 4):
        cuts = balanced_cuts(graph, n)
        assert len(cuts) == n - 1
        assert list(cuts) == sorted(set(cuts)) and all(0 < c < len(graph.layers) for c in cuts)
    plan = manual_plan(graph, balanced_cuts(graph, 3), "mlp", 4, nm=2)
    roles = stage_contexts(plan, 0, nm=2, steps=10)
    assert [(r.rank, r.prev_rank, r.next_rank) for r in roles] == [
        (0, None, 1),
        (1, 0, 2),
        (2, 1, None),
    ]
    assert roles[0].cuts == balanced_cuts(graph, 3)
    with pytest.raises(ConfigError, match="virtual workers"):
        stage_contexts(plan, 1, 2, 10)


def test_total_steps() -> None:
    assert total_steps(RunConfig(steps=7), 100) == 7
    assert total_steps(RunConfig(epochs=1.5), 10) == 15
    assert total_steps(RunConfig(), 10) == 10
    assert total_steps(RunConfig(time_limit_s=5), 10) > 10**9


def test_stage_builds_only_its_parameters_with_reference_init() -> None:
    """Meta-built stages hold only their parameters, equal to the single-process reference's."""
    source = ModelSource(ref="resnet")
    graph = ModelGraph.from_spec(resolve_source(source, 2, meta=True))
    cuts = balanced_cuts(graph, 3)
    ref, names, _ = reference_module(source, 2, seed=5)
    ref_params = {names[n]: p for n, p in ref.named_parameters()}
    seen: set[str] = set()
    for s in range(3):
        built = build_stage(source, 2, cuts, s, seed=5)
        assert built.meta_built
        for n, p in built.module.named_parameters():
            orig = built.names[n]
            assert p.device.type == "cpu"
            assert torch.equal(p, ref_params[orig]), orig
            seen.add(orig)
    assert seen == set(ref_params)


def test_cut_specs_include_skip_connections() -> None:
    source = ModelSource(ref="resnet")
    graph = ModelGraph.from_spec(resolve_source(source, 2, meta=True))
    inside_block = next(k for k in range(1, len(graph.layers)) if len(graph.crossing[k]) == 2)
    specs = cut_specs(graph, inside_block)
    assert len(specs) == 2 and all(s.shape[0] == 2 and s.is_float for s in specs)


def test_memory_meter_counts_in_flight_and_raises_above_cap() -> None:
    meter = MemoryMeter(
        "vw 0 | stage 1",
        cap_bytes=10_000,
        param_bytes=1000,
        buffer_bytes=0,
        optimizer_state_factor=1,
    )
    assert meter.static_bytes == 3000
    assert meter.check(1, 3000, stashed_bytes=1000) == 7000
    meter.release(1)
    assert meter.check(2, 3000, stashed_bytes=0) == 6000
    with pytest.raises(HetPipeRuntimeError, match="out of memory on vw 0 \\| stage 1"):
        meter.check(3, 5000, stashed_bytes=0)
    assert meter.peak_bytes == 11000


def test_pacing_waits_until_the_deadline_with_an_injected_clock() -> None:
    ticks = iter([0.0, 0.0, 0.0005, 0.0009, 0.001])
    assert pace_until(0.001, clock=lambda: next(ticks)) == 0.0  # spins (no sleep) under 1 ms
    # a task that already ran past its deadline is not paced and reports how late it is
    assert pace_until(0.001, clock=lambda: 0.0035) == pytest.approx(0.0025)


def test_pacing_table_from_a_plan_gives_back_the_planned_stage_times() -> None:
    """Solo time = planned device time x speed, so pacing to solo / speed is the plan's time."""
    cal = Calibration.from_plan("k", [(10.0, 20.0), (4.0, 6.0)], [0.2, 0.05])
    assert cal.fwd_s == pytest.approx((0.002, 0.0002)) and cal.bwd_s == pytest.approx(
        (0.004, 0.0003)
    )
    assert cal.task_s(0, "FB") / 0.2 == pytest.approx(0.030)  # the plan's 10 + 20 ms
    assert cal.task_s(1, "B") / 0.05 == pytest.approx(0.006)


def test_emulated_stages_and_ddp_are_paced_by_the_planners_profile() -> None:
    """One source of truth: a planned stage's table and the AllReduce baseline's whole-model
    time come from the same CPU profile the planner partitioned with."""
    from hetpipe.planning import profiles_for
    from planner.baseline import allreduce_plan
    from planner.cluster import load_cluster
    from planner.planner import make_plan

    cluster = load_cluster(
        Path(__file__).resolve().parents[2] / "examples" / "emulated_cluster.yaml"
    )
    cpu = profiles_for(cluster, [], "mlp", 16)
    plan = make_plan(cluster, cpu, model="mlp", batch_size=16, policy="ed", optimizer="sgd")
    ddp = allreduce_plan(cluster, "mlp", 16, profiles=cpu, optimizer="sgd")
    worker = plan.virtual_workers[0]
    speeds = [worker.gpus[st.gpu].speed for st in worker.stages]
    cal = Calibration.from_plan("k", [(st.fwd_ms, st.bwd_ms) for st in worker.stages], speeds)
    whole = next(v for v in ddp.virtual_workers if v.gpus[0].type == worker.gpus[0].type)
    solo = Calibration.from_plan(
        "w", [(whole.stages[0].fwd_ms, whole.stages[0].bwd_ms)], [whole.gpus[0].speed]
    )
    # the stages of one VW cover the model once: their solo times add up to the whole model's
    assert sum(cal.fwd_s) == pytest.approx(solo.fwd_s[0], rel=1e-6)
    assert sum(cal.bwd_s) == pytest.approx(solo.bwd_s[0], rel=1e-6)


def test_fast_gather_equals_collating_items_one_by_one() -> None:
    from torch.utils.data import Subset, TensorDataset, default_collate

    from runtime.data import DigitsDataset, MinibatchSource

    x, y = torch.randn(50, 3), torch.randint(0, 4, (50,))
    cases = [
        DigitsDataset(),
        Subset(Subset(DigitsDataset(), list(range(7, 900, 3))), list(range(0, 200, 2))),
        TensorDataset(x, y),
        Subset(TensorDataset(x, y), list(range(49, 0, -2))),
    ]
    for ds in cases:
        src = MinibatchSource(ds, 8, seed=3)
        for mb in (1, 2, src.steps_per_epoch + 1):
            (xs,), ys = src.batch(mb)
            ref_x, ref_y = default_collate([ds[i] for i in src.indices(mb)])
            torch.testing.assert_close(xs, ref_x, rtol=0, atol=0)
            torch.testing.assert_close(ys, ref_y, rtol=0, atol=0)


def test_measured_trace_puts_stage_0_pull_waits_behind_the_whole_vw() -> None:
    from runtime.results.metrics import StageResult
    from runtime.results.timeline import measured_trace

    s0 = StageResult(rank=1, vw=0, stage=0, device="V:0")
    s1 = StageResult(rank=2, vw=0, stage=1, device="Q:0")
    s0.task_log += [("wait", 1, 10.000, 10.002), ("F", 1, 10.002, 10.004)]
    s1.task_log += [("FB", 1, 10.005, 10.009), ("wait", 2, 10.009, 10.010)]
    trace = measured_trace([s0, s1])
    assert [(e.stage, e.cat, e.mb) for e in trace] == [
        (-1, "wait", 1),  # stage 0 waiting blocks the VW's admission
        (0, "F", 1),
        (1, "FB", 1),
        (1, "wait", 2),  # another stage's wait stays on its own row
    ]
    assert trace[0].start_ms == 0.0 and trace[2].end_ms == pytest.approx(9.0)


def test_a_stage_too_large_for_this_host_is_refused_before_it_is_materialised() -> None:
    """A stage process builds its stage on meta first: weights larger than the host's memory
    are one ModelError line (what the launcher reports), never an allocator traceback."""
    from profiler.errors import ModelError

    ref = "mlp(hidden=1000000000000,depth=1)"  # 256 TB in its first layer
    with pytest.raises(ModelError, match=r"^model '.*' needs [\d,]+ bytes of weights but this"):
        build_stage(ModelSource(ref=ref), 2, (2,), 0, seed=5)
