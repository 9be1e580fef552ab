"""Cost model: stage time and memory by hand on a tiny profile."""

from __future__ import annotations

import pandas as pd
import pytest

from planner.cluster import load_cluster
from planner.costmodel import CostModel, candidate_cuts, load_links, optimizer_factor
from profiler.errors import ConfigError
from profiler.table import COLUMNS, Profile, ProfileMeta
from tests.conftest import EXAMPLES


def _profile(device: str, scale: float) -> Profile:
    rows = [
        ("x", "placeholder", "", 0.0, 0.0, 100, 0, 0),
        ("a", "Linear", "x", 1.0, 2.0, 40, 40, 1000),
        ("b", "Linear", "a", 2.0, 4.0, 30, 30, 2000),
        ("c", "add", "a;b", 0.5, 0.5, 30, 0, 0),
        ("output", "output", "c", 0.0, 0.0, 0, 0, 0),
    ]
    df = pd.DataFrame(
        [
            {
                "layer": n,
                "op": op,
                "inputs": inp,
                "fwd_ms": f * scale,
                "bwd_ms": b * scale,
                "act_bytes": act,
                "saved_bytes": sav,
                "param_bytes": par,
                "buffer_bytes": 8 if par else 0,
                "mem_per_mb_bytes": 0,
                "peak_bytes": 0,
                "flops": 0.0,
            }
            for n, op, inp, f, b, act, sav, par in rows
        ],
        columns=list(COLUMNS),
    ).astype(COLUMNS)
    return Profile(df, ProfileMeta(model="tiny", device_type=device, batch_size=4))


def test_stage_time_and_memory() -> None:
    cl = load_cluster(EXAMPLES / "paper_cluster.yaml")
    v0, q0 = cl.devices[0], cl.devices[12]
    cm = CostModel(
        {"TITAN V": _profile("TITAN V", 1.0), "Quadro P4000": _profile("Quadro P4000", 3.0)},
        cl.link,
    )
    assert list(cm.positions) == [0, 1, 2, 3, 4, 5]
    assert list(cm.cut_bytes) == [0, 100, 40, 70, 30, 0]  # cut 3: a (skip) and b cross
    gpus = [v0, q0]
    first = cm.stage_cost(gpus, 0, 0, 3, nm=2)
    second = cm.stage_cost(gpus, 1, 3, 5, nm=2)
    ib = cl.inter_node
    assert first.fwd_ms == pytest.approx(3.0) and first.bwd_ms == pytest.approx(6.0)
    assert first.recv_fwd_ms == 0.0
    assert first.recv_bwd_ms == pytest.approx(ib.time_s(70) * 1e3)
    assert second.fwd_ms == pytest.approx(1.5) and second.recv_fwd_ms == pytest.approx(
        ib.time_s(70) * 1e3
    )
    # static = P*(2+1) + buffers + (Nm-1)*P; in flight: Nm on stage 0, 1 on the last
    assert first.in_flight == 2 and second.in_flight == 1
    assert first.memory_bytes == 3000 * 3 + 16 + 1 * 3000 + 2 * (70 + 0)
    assert second.memory_bytes == 0 + 0 + 1 * (0 + 70)
    assert cm.time_matrix(gpus, 0)[0, 3] == pytest.approx(first.time_ms)
    assert cm.memory_matrix(2, 0, 2)[0, 3] == pytest.approx(first.memory_bytes)
    assert cm.model_memory_bytes(1) == 3000 * 3 + 16 + 70


def test_coarsening_keeps_single_tensor_cuts() -> None:
    prof = _profile("TITAN V", 1.0)
    assert candidate_cuts(prof, None) == [1, 2, 3, 4]
    assert candidate_cuts(prof, 2) == [1, 2, 4]  # cut 3 is crossed by a and b


def test_optimizer_factor() -> None:
    assert optimizer_factor("adam") == 2.0 and optimizer_factor("SGD") == 0.0
    with pytest.raises(ConfigError, match="unknown optimizer"):
        optimizer_factor("lion")


def test_links_file(tmp_path: object) -> None:
    from pathlib import Path

    p = Path(str(tmp_path)) / "links.yaml"
    p.write_text("intra_node: {bandwidth: 10GB/s, latency: 5us}\ninter_node: {bandwidth: 1GB/s}\n")
    links = load_links(p)
    assert links["intra_node"].bandwidth_bps == 10e9
    assert links["intra_node"].latency_s == pytest.approx(5e-6)
    assert links["inter_node"].bandwidth_bps == 1e9
    p.write_text("foo: 1\n")
    with pytest.raises(ConfigError, match="neither"):
        load_links(p)


def test_coarsening_ignores_tensors_that_cross_most_cuts() -> None:
    """A language model's labels reach the last layer: block boundaries stay candidates."""
    rows = [("ids", "placeholder", ""), ("labels", "placeholder", "")]
    rows += [(f"h{i}", "block", "ids" if i == 0 else f"h{i - 1}") for i in range(6)]
    rows += [("loss", "nll", "h5;labels"), ("output", "output", "loss")]
    base = _profile("TITAN V", 1.0)
    row = base.table.iloc[1].to_dict()
    table = pd.DataFrame([{**row, "layer": n, "op": op, "inputs": i} for n, op, i in rows])
    prof = base.with_table(table[list(COLUMNS)].astype(COLUMNS))
    every = candidate_cuts(prof, None)
    assert len(every) == 9
    # labels cross cuts 2..8 with one block output each: every cut stays (not only 1 and 9)
    assert candidate_cuts(prof, 3) == every


@pytest.mark.parametrize(
    ("optimizer", "extra_at_nm"), [("momentum", [0, 1, 1]), ("sgd", [1, 2, 2])]
)
def test_predict_adds_the_copies_the_stage_keeps(optimizer: str, extra_at_nm: list[int]) -> None:
    """Every memory path (stage cost, memory matrix) counts predict's weight copies
    (planner.staleness.remedy_weight_copies; tests/runtime/test_remedy_memory.py checks the
    stage keeps exactly those)."""
    cl = load_cluster(EXAMPLES / "paper_cluster.yaml")
    gpus = [cl.devices[0], cl.devices[12]]
    profs = {"TITAN V": _profile("TITAN V", 1.0), "Quadro P4000": _profile("Quadro P4000", 3.0)}
    f = optimizer_factor(optimizer)
    none, predict = CostModel(profs, cl.link, f), CostModel(profs, cl.link, f, remedy="predict")
    for nm, extra in zip([1, 2, 3], extra_at_nm, strict=True):
        a, b = none.stage_cost(gpus, 0, 0, 3, nm), predict.stage_cost(gpus, 0, 0, 3, nm)
        assert (
            b.memory_bytes
            == a.memory_bytes + extra * a.param_bytes
            == 3000 * extra + a.memory_bytes
        )
        grown = predict.memory_matrix(2, 0, nm)[0, 3] - none.memory_matrix(2, 0, nm)[0, 3]
        assert grown == extra * 3000
