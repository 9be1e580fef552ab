"""Memory placements inside the partitioning: busy time and host memory (planner.offload).

The partitioners (DP, search, MILP) charge every stage its busy time under the placement
(compute + recompute, or the host-link time of its offloaded bytes on its GPU's share of the
node's link when longer) and check host memory beside device memory, so their optimum is the
optimum of ``CostModel.stage_cost`` itself (brute force below).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import replace

import pandas as pd
import pytest

from hetpipe.planning import profiles_for
from planner.cluster import Device, Link, load_cluster
from planner.costmodel import CostModel
from planner.offload import LADDER, HostShare, MemoryPlacement, Place, host_link_ms
from planner.partition.dp import InfeasiblePartition, distinct_orders, partition_dp
from planner.partition.memory import fits_memory
from planner.partition.milp import partition_milp
from planner.partition.search import partition_exact
from planner.plan import Plan
from planner.planner import PlanOptions, make_plan
from profiler.errors import PlanError
from profiler.table import COLUMNS, Profile, ProfileMeta
from tests.conftest import EXAMPLES
from tests.planner.synth import synthetic_profiles

GRADS = MemoryPlacement(gradients=Place.OFFLOAD)
PAPER = load_cluster(EXAMPLES / "paper_cluster.yaml")


def _profile(device: str, ms: Sequence[float], params: Sequence[int]) -> Profile:
    """A chain ``x -> l1 .. ln -> output``: layer ``i`` takes ``ms[i]`` (fwd + bwd) and holds
    ``params[i]`` parameter bytes; activations are tiny."""
    names = ["x", *[f"l{i + 1}" for i in range(len(ms))], "output"]
    rows = []
    for i, name in enumerate(names):
        inner = 0 < i < len(names) - 1
        rows.append(
            {
                "layer": name,
                "op": "Linear" if inner else ("placeholder" if i == 0 else "output"),
                "inputs": names[i - 1] if i else "",
                "fwd_ms": ms[i - 1] / 3 if inner else 0.0,
                "bwd_ms": 2 * ms[i - 1] / 3 if inner else 0.0,
                "act_bytes": 8 if i < len(names) - 1 else 0,
                "saved_bytes": 8 if inner else 0,
                "param_bytes": params[i - 1] if inner else 0,
                "buffer_bytes": 0,
                "mem_per_mb_bytes": 0,
                "peak_bytes": 0,
                "flops": 0.0,
            }
        )
    df = pd.DataFrame(rows, columns=list(COLUMNS)).astype(COLUMNS)
    return Profile(df, ProfileMeta(model="chain", device_type=device, batch_size=4))


def _gpus(*labels: str) -> list[Device]:
    by_label = {d.label: d for d in PAPER.devices}
    return [by_label[x] for x in labels]


def _bottleneck(cm: CostModel, gpus: Sequence[Device], bounds: Sequence[int], nm: int) -> float:
    return max(
        cm.stage_cost(gpus, j, bounds[j], bounds[j + 1], nm).time_ms for j in range(len(gpus))
    )


def test_joint_choice_beats_adding_the_transfers_after_partitioning() -> None:
    # 4 layers of 10 ms; l3 and l4 hold 10 MB each, whose gradients go to host memory and
    # back (2 x 10 MB at 1 GB/s: 20 ms per layer). Compute alone splits 2|2: the second stage
    # then waits 40 ms on the host link; charged while cutting, 3|1 is 30 ms.
    prof = _profile("TITAN V", [10.0] * 4, [0, 0, 10**7, 10**7])
    gpus = _gpus("V:0", "V:1")

    def model(bandwidth: float) -> CostModel:
        cm = CostModel({"TITAN V": prof}, PAPER.link, 0.0, host_link=Link(bandwidth, 0.0))
        return cm.with_placement(GRADS)

    joint, compute_only = model(1e9), model(1e30)
    post_hoc = partition_dp(compute_only, gpus, nm=2)
    assert post_hoc.bounds == (0, 3, 6)  # x l1 l2 | l3 l4 output
    assert _bottleneck(joint, gpus, post_hoc.bounds, 2) == pytest.approx(40.0, rel=1e-3)
    for part in (
        partition_dp(joint, gpus, nm=2),
        partition_exact(joint, gpus, nm=2),
        partition_milp(joint, gpus, nm=2, time_limit_s=30),
    ):
        assert part.bounds == (0, 4, 6)
        assert part.bottleneck_ms == pytest.approx(30.0, rel=1e-3)
        assert part.objective_ms == pytest.approx(part.bottleneck_ms, rel=1e-6)


def _brute(cm: CostModel, gpus: Sequence[Device], nm: int, orders: bool) -> float:
    """Best bottleneck of ``stage_cost`` over every order (or the given one) and every split
    that fits device memory and host share."""
    best = float("inf")
    c, k = cm.num_segments, len(gpus)
    for order in distinct_orders(gpus) if orders else [tuple(gpus)]:
        for cuts in itertools.combinations(range(1, c), k - 1):
            bounds = (0, *cuts, c)
            fits = True
            for j in range(k):
                mem = cm.stage_memory(order, j, bounds[j], bounds[j + 1], nm)
                host = cm.host_share(order[j]).memory_bytes
                fits &= mem.device_bytes <= order[j].memory_bytes
                fits &= not host or mem.host_bytes <= host
            if fits:
                best = min(best, _bottleneck(cm, order, bounds, nm))
    return best


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("placement", [*LADDER[1:], MemoryPlacement(activations=Place.RECOMPUTE)])
def test_partitioners_find_the_optimum_of_the_stage_cost(
    seed: int, placement: MemoryPlacement
) -> None:
    profs = synthetic_profiles(9, seed=seed, act_mib=4.0, param_mib=4.0)
    gpus = _gpus("V:0", "V:1", "Q:0")
    hosts = {"V": HostShare(4, 40 * 2**20), "Q": HostShare(4, 0)}  # shared link, tight host
    cm = CostModel(profs, PAPER.link, 1.0, host_link=Link(2e9, 1e-5), hosts=hosts)
    cm = cm.with_placement(placement)
    nm = 4
    fixed = _brute(cm, gpus, nm, orders=False)
    every = _brute(cm, gpus, nm, orders=True)
    if fixed == float("inf"):
        with pytest.raises(InfeasiblePartition):
            partition_dp(cm, gpus, nm)
    else:
        assert partition_dp(cm, gpus, nm).bottleneck_ms == pytest.approx(fixed, rel=1e-9)
    assert fits_memory(cm, gpus, nm) == (every < float("inf"))
    if every == float("inf"):
        return
    assert partition_exact(cm, gpus, nm).bottleneck_ms == pytest.approx(every, rel=1e-9)
    milp = partition_milp(cm, gpus, nm, time_limit_s=30)
    assert milp.bottleneck_ms == pytest.approx(every, rel=1e-6)


def test_gpus_of_a_node_share_its_host_link() -> None:
    profs = synthetic_profiles(9, seed=0, act_mib=4.0, param_mib=4.0)
    gpus = _gpus("V:0", "V:1")
    link = Link(1e8, 0.0)  # slow: the transfer is exposed
    alone = CostModel(profs, PAPER.link, 1.0, host_link=link).with_placement(GRADS)
    shared = CostModel(profs, PAPER.link, 1.0, host_link=link, hosts={"V": HostShare(4)})
    shared = shared.with_placement(GRADS)
    a, b = (cm.stage_memory(gpus, 0, 0, 4, 2) for cm in (alone, shared))
    assert a.transfer_bytes == b.transfer_bytes > 0
    fwd_bwd = alone.stage_cost(gpus, 0, 0, 4, 2, GRADS).fwd_ms + alone.bwd_prefix["TITAN V"][4]
    assert host_link_ms(float(a.transfer_bytes), link, 4) == pytest.approx(
        4 * host_link_ms(float(a.transfer_bytes), link, 1)
    )
    assert b.transfer_ms > a.transfer_ms > 0
    assert a.transfer_ms + fwd_bwd == pytest.approx(host_link_ms(float(a.transfer_bytes), link))
    assert b.transfer_ms + fwd_bwd == pytest.approx(host_link_ms(float(b.transfer_bytes), link, 4))
    assert PAPER.host_share("V") == HostShare(4, 0)


MODEL = "mlp(hidden=400,depth=8)"
EMULATED = load_cluster(EXAMPLES / "emulated_cluster.yaml")


def _emulated_plan(host_memory: int, memory: str, nm: int | None = None) -> Plan:
    """One VW over the emulated cluster, every node with ``host_memory`` bytes of host memory."""
    nodes = tuple(replace(n, host_memory_bytes=host_memory) for n in EMULATED.nodes)
    return make_plan(
        replace(EMULATED, nodes=nodes),
        profiles_for(EMULATED, [], MODEL, 32),
        model=MODEL,
        batch_size=32,
        policy="ed",
        num_vws=1,
        optimizer="sgd",
        nm=nm,
        options=PlanOptions(memory=memory, simulate_waves=0, nm_choice="max"),
    )


def _auto_plan(host_memory: int, nm: int | None = None) -> tuple[int, list[int]]:
    vw = _emulated_plan(host_memory, "auto", nm).virtual_workers[0]
    return vw.nm_max, [s.host_bytes for s in vw.stages]


def test_nm_bound_counts_host_memory() -> None:
    free, _ = _auto_plan(0)
    nothing, host = _auto_plan(1)
    assert nothing < free and not any(host)  # no host memory: the all-keep bound
    mib = 2**20
    bounded, host = _auto_plan(mib // 2)  # per node (one GPU each): 0.5 MiB
    assert nothing <= bounded < free
    assert max(host) <= mib // 2
    # the bound is the planner's: asking for more is capped, never a failure
    capped, host = _auto_plan(mib // 2, nm=free)
    assert capped == bounded and max(host) <= mib // 2


def test_forced_offload_without_host_memory_names_the_fix() -> None:
    with pytest.raises(PlanError, match="host_memory"):
        _emulated_plan(1, "gradients:offload")


def test_a_smaller_nm_optimum_is_reused_only_when_the_times_agree() -> None:
    profs = synthetic_profiles(9, seed=0)
    cm = CostModel(profs, PAPER.link, 1.0)
    weights = cm.with_placement(MemoryPlacement(weights=Place.OFFLOAD))
    assert cm.same_times(3, 1, 8)
    assert weights.same_times(3, 2, 3)  # Nm - 1 <= 2 versions: nothing moves at either
    assert not weights.same_times(3, 3, 4)  # the third version goes to host memory at 4
    recompute = cm.with_placement(MemoryPlacement(activations=Place.RECOMPUTE))
    assert not recompute.same_times(3, 1, 2) and recompute.same_times(3, 2, 5)
