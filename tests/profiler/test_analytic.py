"""Analytic roofline profiles: FLOP and byte counts, the paper's GPU types, calibration, scaling."""

from __future__ import annotations

import dataclasses

import pytest

from profiler.analytic import (
    Calibration,
    Efficiency,
    analytic_profile,
    calibrate,
    layer_costs,
    predict_ms,
    roof_of,
    scale_profile,
)
from profiler.catalog import lookup_gpu
from profiler.errors import ConfigError, ModelError, ProfileError
from profiler.pipedream import import_pipedream
from tests.conftest import PIPEDREAM

PAPER_TYPES = ["TITAN V", "TITAN RTX", "GeForce RTX 2060", "Quadro P4000"]


@pytest.mark.parametrize("gpu", PAPER_TYPES)
def test_vgg19_profile_for_each_paper_gpu(gpu: str) -> None:
    prof = analytic_profile("vgg19", 32, gpu)
    t = prof.table
    assert prof.meta.device_type == lookup_gpu(gpu).name
    assert prof.meta.source == "analytic"
    assert len(t) == 47  # placeholder + 46 modules of the Sequential + output
    # VGG-19: 19.6 GMAC per 224x224 image = 39.3 GFLOP; 143.7 M parameters
    assert t["flops"].sum() / 32 == pytest.approx(39.26e9, rel=0.01)
    assert t["param_bytes"].sum() == 143_667_240 * 4
    compute = t[t["op"].isin(["Conv2d", "Linear"])]
    assert (compute["fwd_ms"] > 0).all() and (compute["bwd_ms"] > compute["fwd_ms"]).all()
    assert t["fwd_ms"].iloc[0] == 0 and t["fwd_ms"].iloc[-1] == 0


def test_faster_gpu_types_get_shorter_times() -> None:
    total = {
        g: analytic_profile("vgg19", 32, g).table[["fwd_ms", "bwd_ms"]].sum().sum()
        for g in PAPER_TYPES
    }
    assert total["TITAN RTX"] < total["TITAN V"] < total["GeForce RTX 2060"] < total["Quadro P4000"]
    # VGG-19 is compute bound: the ratio follows peak FLOP/s within launch overheads
    ratio = total["Quadro P4000"] / total["TITAN V"]
    peaks = lookup_gpu("TITAN V").fp32_tflops / lookup_gpu("Quadro P4000").fp32_tflops
    assert ratio == pytest.approx(peaks, rel=0.2)


def test_conv_flops_match_the_formula() -> None:
    costs = {c.name: c for c in layer_costs("vgg19", 2)}
    first = costs["_0"]  # Conv2d(3, 64, 3, padding=1) on 2x3x224x224
    assert first.fwd_flops == 2 * 2 * 64 * 224 * 224 * 3 * 3 * 3
    # backward: grad weight only for the first layer (the input needs no grad)
    assert first.bwd_flops == pytest.approx(first.fwd_flops, rel=0.01)
    second = costs["_2"]
    assert second.bwd_flops == pytest.approx(2 * second.fwd_flops, rel=0.01)


def test_saved_and_activation_bytes_are_exact_for_the_mlp() -> None:
    costs = layer_costs("mlp", 8)
    by = {c.name: c for c in costs}
    assert by["_0"].act_bytes == 8 * 256 * 4
    assert by["_1"].saved_bytes == 8 * 256 * 4  # ReLU saves its output
    assert by["_0"].saved_bytes == 8 * 64 * 4  # first Linear saves the model input
    assert by["_2"].saved_bytes == 0  # its input is ReLU's output, already charged
    assert (
        sum(c.param_bytes for c in costs)
        == (64 * 256 + 256 + 3 * (256 * 256 + 256) + 256 * 10 + 10) * 4
    )


def test_layer_costs_are_cached() -> None:
    assert layer_costs("transformer", 4) is layer_costs("transformer", 4)


def test_calibration_recovers_known_efficiencies() -> None:
    truth = Calibration(
        Efficiency(compute=0.31, memory=0.42, launch_ms=0.011),
        Efficiency(compute=0.27, memory=0.38, launch_ms=0.017),
        "truth",
    )
    synthetic = analytic_profile("resnet", 8, "TITAN V", truth)
    fitted = calibrate(synthetic)
    for phase in ("fwd", "bwd"):
        got, want = getattr(fitted, phase), getattr(truth, phase)
        for f in dataclasses.fields(Efficiency):
            assert getattr(got, f.name) == pytest.approx(getattr(want, f.name), rel=1e-3), (
                phase,
                f.name,
            )
    again = analytic_profile("resnet", 8, "TITAN V", fitted)
    assert again.table["fwd_ms"].tolist() == pytest.approx(
        synthetic.table["fwd_ms"].tolist(), rel=1e-3
    )


def test_predict_ms_is_a_roofline() -> None:
    roof = roof_of("TITAN V")
    eff = Efficiency(compute=0.5, memory=0.5, launch_ms=0.0)
    compute_bound = predict_ms(1e12, 1.0, 0, roof, eff)
    assert compute_bound == pytest.approx(1e12 / (0.5 * roof.flops_per_s) * 1e3)
    memory_bound = predict_ms(1.0, 1e9, 0, roof, eff)
    assert memory_bound == pytest.approx(1e9 / (0.5 * roof.bytes_per_s) * 1e3)
    assert predict_ms(0, 0, 3, roof, Efficiency(launch_ms=0.01)) == pytest.approx(0.03)


def test_scale_between_gpu_types_preserves_measured_quirks() -> None:
    src = analytic_profile("resnet", 8, "TITAN V")
    doubled = src.with_table(src.table.assign(fwd_ms=src.table["fwd_ms"] * 2))
    scaled = scale_profile(doubled, "Quadro P4000")
    direct = analytic_profile("resnet", 8, "Quadro P4000")
    assert scaled.meta.device_type == "Quadro P4000" and scaled.meta.source == "scaled"
    assert scaled.table["fwd_ms"].tolist() == pytest.approx(
        (direct.table["fwd_ms"] * 2).tolist(), rel=1e-9
    )
    assert scaled.table["bwd_ms"].tolist() == pytest.approx(
        direct.table["bwd_ms"].tolist(), rel=1e-9
    )


def test_scale_imported_pipedream_profile() -> None:
    src = import_pipedream(PIPEDREAM / "vgg16" / "graph.txt")
    with pytest.raises(ConfigError, match="from_type"):
        scale_profile(src, "Quadro P4000")
    scaled = scale_profile(src, "Quadro P4000", from_type="TITAN V")
    assert (scaled.table["fwd_ms"] >= src.table["fwd_ms"]).all()
    assert scaled.table["act_bytes"].tolist() == src.table["act_bytes"].tolist()


@pytest.mark.parametrize(
    "args, error",
    [
        (("vgg19", 32, "TPU v9"), ConfigError),
        (("nope", 32, "TITAN V"), ModelError),
        (("mlp", 0, "TITAN V"), ModelError),
    ],
)
def test_bad_arguments(args: tuple[str, int, str], error: type[Exception]) -> None:
    with pytest.raises(error):
        analytic_profile(*args)


def test_scale_cpu_profile_gives_the_analytic_estimate() -> None:
    cpu = analytic_profile("mlp", 4, "cpu")  # stands in for a measured CPU profile
    scaled = scale_profile(cpu, "TITAN V")
    direct = analytic_profile("mlp", 4, "TITAN V")
    assert scaled.table["fwd_ms"].tolist() == pytest.approx(direct.table["fwd_ms"].tolist())
    assert scaled.meta.extra["scaled_from"] == "cpu"


def test_calibrate_needs_one_device_type() -> None:
    with pytest.raises(ProfileError):
        calibrate()
    with pytest.raises(ProfileError, match="one device type"):
        calibrate(analytic_profile("mlp", 4, "cpu"), analytic_profile("mlp", 4, "TITAN V"))
