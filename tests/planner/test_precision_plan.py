"""``precision="bf16"``: the planner's bytes (activations, saved tensors, the bf16 weight copy)
and the simulator's follow the plan's precision."""

from __future__ import annotations

from planner.cluster import load_cluster
from planner.planner import make_plan
from planner.sim.simulator import simulate
from tests.conftest import REPO


def test_a_bf16_plan_moves_half_the_bytes_and_records_its_precision() -> None:
    cluster = load_cluster(REPO / "examples" / "paper_cluster.yaml")
    fp32 = make_plan(cluster, model="resnet", batch_size=32, policy="ed", nm=2)
    bf16 = make_plan(cluster, model="resnet", batch_size=32, policy="ed", nm=2, precision="bf16")
    assert (fp32.precision, bf16.precision) == ("fp32", "bf16")
    mem32 = sum(s.memory_bytes for vw in fp32.virtual_workers for s in vw.stages)
    mem16 = sum(s.memory_bytes for vw in bf16.virtual_workers for s in vw.stages)
    assert mem16 < 0.75 * mem32  # activations and saved tensors at 2 bytes per element
    sent32 = sum(s.send_bytes for vw in fp32.virtual_workers for s in vw.stages)
    sent16 = sum(s.send_bytes for vw in bf16.virtual_workers for s in vw.stages)
    assert 0 < sent16 < sent32
    assert simulate(bf16, waves=3).throughput > 0  # the simulator runs on the bf16 stage costs
