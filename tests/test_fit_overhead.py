"""benchmarks/fit_overhead.py's fits on stages made from a known model (no runs)."""

from __future__ import annotations

import random
from typing import Any

import pytest

from benchmarks import fit_overhead as fo

TRUE = {"ms_per_task": 0.3, "ms_per_wave": 1.5, "ms_per_mb": 1.0, "ms_per_mb_step": 0.0}


def _row(
    family: str, nm: int, mbs: list[float], scale: float = 1.0, ps: bool = True
) -> dict[str, Any]:
    """A run of 8 processes on 2 cores whose stages cost exactly ``TRUE`` x ``scale``."""
    row: dict[str, Any] = {
        "label": family,
        "family": family,
        "processes": 8,
        "cores": 2,
        "loadavg": 1.0,
    }
    stages = []
    for s, mb in enumerate(mbs):
        last = s == len(mbs) - 1
        st = {"vw": 0, "stage": s, "nm": nm, "last": last, "param_bytes": int(mb * 1e6), "ps": ps,
              "tasks_per_wave": nm * (1 if last else 2)}  # fmt: skip
        x = fo.features(row, st)
        st["overhead_ms_per_task"] = scale * sum(
            TRUE[t] * v for t, v in zip(fo.TERMS, x, strict=True)
        )
        stages.append(st)
    row["stages"] = stages
    return row


ROWS = [
    _row("readme", 3, [0.07, 0.8]),
    _row("readme", 5, [0.86, 0.01]),
    _row("ED", 16, [0.0, 1.18, 0.0, 2.12]),
    _row("HD", 29, [1.18, 2.12]),
    _row("one-vw", 4, [0.03, 0.14, 0.23, 0.3], ps=False),
]


def test_the_features_hand_computed() -> None:
    """Stretch 8 / 2 = 4; a middle stage at Nm 3 has 6 tasks per wave, a last one 3."""
    row = {"processes": 8, "cores": 2}
    mid = {"tasks_per_wave": 6, "ps": True, "param_bytes": 500_000, "last": False}
    assert fo.features(row, mid) == pytest.approx([4.0, 4 / 6, 4 / 6 * 0.5, 4 * 0.5 / 2])
    assert fo.features(row, {**mid, "ps": False})[1:3] == [0.0, 0.0]  # no shards: no wave terms


def test_the_full_model_recovers_the_terms_and_one_constant_does_not() -> None:
    full = fo.fit_model(ROWS, fo.MODELS["task+wave+mb"])
    assert [full[t] for t in fo.TERMS] == pytest.approx(list(TRUE.values()), abs=1e-9)
    assert max(abs(r) for r in fo.residuals(ROWS, full)) < 1e-9
    fitted = fo.fit(ROWS, max_load=4.0)["models"]
    assert fitted["task"]["rms_ms"] > 0.1 > fitted["task+wave+mb"]["rms_ms"]
    assert max(fitted["task+wave+mb"]["held_out_rms_ms"].values()) < 1e-6  # any family left out


def test_nnls_keeps_every_term_non_negative() -> None:
    """y = 2 x0 - 1 x1 has no non-negative exact fit: x1's term is 0, x0's the best alone."""
    xs = [[1.0, 1.0], [2.0, 1.0], [3.0, 1.0]]
    ys = [1.0, 3.0, 5.0]
    coef = fo.nnls(xs, ys)
    assert coef[1] == 0.0 and coef[0] == pytest.approx(
        sum(x[0] * y for x, y in zip(xs, ys, strict=True)) / 14
    )


def test_the_shape_fit_is_free_of_each_runs_load() -> None:
    """Each run stretched by its own load (x1 to x5): the terms' ratios come back exactly."""
    rng = random.Random(0)
    loaded = [_row(r["family"], r["stages"][0]["nm"], [s["param_bytes"] / 1e6 for s in r["stages"]],
                   scale=rng.uniform(1.0, 5.0), ps=r["stages"][0]["ps"]) for r in ROWS]  # fmt: skip
    shape = fo.fit_shape(loaded, fo.MODELS["task+wave+mb"])
    assert shape["ms_per_wave"] == pytest.approx(1.5 / 0.3, rel=1e-6)
    assert shape["ms_per_mb"] == pytest.approx(1.0 / 0.3, rel=1e-6)
    assert max(abs(r) for r in fo.shape_residuals(loaded, shape)) < 1e-6


def test_the_yaml_block_loads_as_a_cluster_model() -> None:
    from planner.cluster import parse_cluster

    line = fo.yaml_block({**TRUE, "ms_per_mb_step": 0.0}, 2)
    assert line == "runtime_overhead: {ms_per_task: 0.3, ms_per_wave: 1.5, ms_per_mb: 1, cores: 2}"
    import yaml

    doc = {"name": "c", "nodes": [{"name": "a", "gpu": "TITAN V", "count": 1}]}
    model = parse_cluster({**doc, **yaml.safe_load(line)}, "c.yaml").runtime_overhead
    assert (model.ms_per_task, model.ms_per_wave, model.ms_per_mb, model.cores) == (
        0.3,
        1.5,
        1.0,
        2,
    )
