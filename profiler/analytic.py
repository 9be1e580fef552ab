"""Analytic profiles: per-layer FLOPs and bytes through a roofline of a catalog GPU.

For GPU types the user does not have at hand (paper Sec. 7 profiles every type), a layer's
time is estimated as::

    t = kernels * launch_ms + max(flops / (eff_compute * peak_flops), bytes / (eff_memory * mem_bw))

separately for forward and backward. ``flops`` come from
``torch.utils.flop_counter.FlopCounterMode``, ``bytes`` (memory traffic) and ``kernels``
from a dispatch mode summing the tensor arguments and results of every non-view aten op,
and saved-for-backward bytes from :class:`~profiler.memory.SavedTensorCounter`. All of it
runs on the ``meta`` device, so even VGG-19 or ResNet-152 at batch 32 costs no compute.

The three efficiency factors per phase are calibrated from any measured profile by
non-negative least squares (:func:`calibrate`); without one, GPU defaults are used.
Efficiencies are relative to the measuring device's peak: the catalog figures for a GPU,
or a nominal CPU roof (:data:`CPU_ROOF`) for ``cpu`` profiles.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any

import numpy as np
import pandas as pd
import torch
from scipy.optimize import nnls

from profiler.catalog import lookup_gpu
from profiler.costs import LayerCost, layer_costs
from profiler.errors import ConfigError, HetPipeError, ProfileError
from profiler.table import COLUMNS, Profile, ProfileMeta

__all__ = [
    "CPU_ROOF",
    "Calibration",
    "Efficiency",
    "LayerCost",
    "Roof",
    "analytic_profile",
    "calibrate",
    "layer_costs",
    "predict_ms",
    "roof_of",
    "scale_profile",
]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Roof:
    """Peak throughput of a device.

    Attributes:
        name: device type.
        flops_per_s: peak FP32 FLOP/s.
        bytes_per_s: peak memory bandwidth, bytes/s.
    """

    name: str
    flops_per_s: float
    bytes_per_s: float


CPU_ROOF = Roof("cpu", 100e9, 20e9)
"""Nominal roof of ``cpu`` profiles (100 GFLOP/s, 20 GB/s); only a reference for efficiencies."""


def roof_of(device_type: str) -> Roof:
    """The roof of ``cpu`` or of a catalog GPU type.

    Raises:
        ConfigError: unknown GPU type.
    """
    if device_type.strip().lower() == "cpu":
        return CPU_ROOF
    spec = lookup_gpu(device_type)
    return Roof(spec.name, spec.fp32_tflops * 1e12, spec.mem_bw_gbs * 1e9)


@dataclass(frozen=True)
class Efficiency:
    """Fractions of the roof a phase reaches, and a fixed cost per kernel.

    Attributes:
        compute: fraction of peak FLOP/s reached by FLOP-heavy kernels (convolution, matmul).
        memory: fraction of peak bandwidth reached by memory-bound kernels.
        launch_ms: fixed cost per aten kernel, milliseconds.
    """

    compute: float = 0.5
    memory: float = 0.6
    launch_ms: float = 0.004


@dataclass(frozen=True)
class Calibration:
    """Efficiencies for forward and backward, and where they came from."""

    fwd: Efficiency = field(default_factory=Efficiency)
    bwd: Efficiency = field(
        default_factory=lambda: Efficiency(compute=0.45, memory=0.6, launch_ms=0.006)
    )
    source: str = "default"


def predict_ms(flops: float, nbytes: float, kernels: float, roof: Roof, eff: Efficiency) -> float:
    """Roofline time of one phase of one layer, milliseconds."""
    compute_s = flops / (eff.compute * roof.flops_per_s)
    memory_s = nbytes / (eff.memory * roof.bytes_per_s)
    return kernels * eff.launch_ms + max(compute_s, memory_s) * 1e3


_WEIGHT_POWER = 0.5


def _fit_phase(
    flops: np.ndarray,
    nbytes: np.ndarray,
    kernels: np.ndarray,
    times: np.ndarray,
    roof: Roof,
    start: Efficiency,
    power: float = _WEIGHT_POWER,
) -> Efficiency:
    """Fit one phase's efficiencies to measured times (ms) by NNLS on the roofline's active terms.

    Rows are weighted by ``t ** -power``: 0 minimises absolute error (big layers dominate),
    1 relative error (every layer counts alike).
    """
    eff = start
    w = np.maximum(times, max(float(times.max()) * 1e-4, 1e-6)) ** -power
    for _ in range(4):
        compute_bound = flops / (eff.compute * roof.flops_per_s) >= nbytes / (
            eff.memory * roof.bytes_per_s
        )
        a = np.stack(
            [
                kernels,
                np.where(compute_bound, flops, 0.0) * 1e3,
                np.where(compute_bound, 0.0, nbytes) * 1e3,
            ],
            1,
        )
        scale = np.maximum(a.max(axis=0), 1e-30)
        coef, _ = nnls(a / scale * w[:, None], times * w)
        coef = coef / scale
        compute = 1.0 / (coef[1] * roof.flops_per_s) if coef[1] > 0 else eff.compute
        memory = 1.0 / (coef[2] * roof.bytes_per_s) if coef[2] > 0 else eff.memory
        eff = Efficiency(float(compute), float(memory), float(coef[0]))
    return eff


def _fit_data(measured: Profile) -> dict[str, np.ndarray]:
    """Per-layer features and measured times of one profile, inputs and output row excluded."""
    costs = layer_costs(measured.meta.model, measured.meta.batch_size)
    if [c.name for c in costs] != measured.layers:
        raise ProfileError(
            f"profile of {measured.meta.model!r} does not match its model graph "
            f"({len(measured.layers)} vs {len(costs)} layers); re-profile it"
        )
    # inputs and the output row (which carries the loss) are not layers the roofline models
    keep = [i for i, c in enumerate(costs) if c.op not in ("placeholder", "output")]
    data = {
        attr: np.array([float(getattr(costs[i], attr)) for i in keep])
        for attr in (
            "fwd_flops",
            "fwd_bytes",
            "fwd_kernels",
            "bwd_flops",
            "bwd_bytes",
            "bwd_kernels",
        )
    }
    data["fwd_ms"] = measured.table["fwd_ms"].to_numpy(float)[keep]
    data["bwd_ms"] = measured.table["bwd_ms"].to_numpy(float)[keep]
    return data


def calibrate(*measured: Profile) -> Calibration:
    """Fit forward and backward efficiencies to measured profiles of resolvable models.

    Several profiles (of one device type) are fitted jointly.

    Raises:
        ProfileError: no profile, mixed device types, or layers that do not match the model graph.
        ConfigError: the device type is neither ``cpu`` nor in the catalog.
    """
    if not measured:
        raise ProfileError("calibrate needs at least one measured profile")
    types = sorted({m.meta.device_type for m in measured})
    if len(types) > 1:
        raise ProfileError(f"calibration profiles must share one device type, got {types}")
    roof = roof_of(types[0])
    parts = [_fit_data(m) for m in measured]
    data = {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}
    cal = Calibration()
    effs = [
        _fit_phase(
            data[f"{ph}_flops"],
            data[f"{ph}_bytes"],
            data[f"{ph}_kernels"],
            data[f"{ph}_ms"],
            roof,
            start,
        )
        for ph, start in (("fwd", cal.fwd), ("bwd", cal.bwd))
    ]
    source = "+".join(f"{m.meta.model}@{m.meta.device_type}/b{m.meta.batch_size}" for m in measured)
    log.info("calibrated on %s: fwd %s, bwd %s", source, effs[0], effs[1])
    return Calibration(effs[0], effs[1], source)


def _rows(costs: Sequence[LayerCost], roof: Roof, cal: Calibration) -> pd.DataFrame:
    rows = []
    for c in costs:
        idle = c.op in ("placeholder", "output")
        rows.append(
            {
                "layer": c.name,
                "op": c.op,
                "inputs": c.inputs,
                "fwd_ms": 0.0
                if idle
                else predict_ms(c.fwd_flops, c.fwd_bytes, c.fwd_kernels, roof, cal.fwd),
                "bwd_ms": 0.0
                if idle
                else predict_ms(c.bwd_flops, c.bwd_bytes, c.bwd_kernels, roof, cal.bwd),
                "act_bytes": c.act_bytes,
                "saved_bytes": c.saved_bytes,
                "param_bytes": c.param_bytes,
                "buffer_bytes": c.buffer_bytes,
                "mem_per_mb_bytes": c.saved_bytes + c.param_bytes,
                "peak_bytes": 0,
                "flops": c.fwd_flops,
            }
        )
    return pd.DataFrame(rows, columns=list(COLUMNS)).astype(COLUMNS)


def analytic_profile(
    model_ref: str, batch_size: int, device_type: str, calibration: Calibration | None = None
) -> Profile:
    """Estimate a profile of ``model_ref`` at ``batch_size`` on ``device_type`` without its hardware.

    Args:
        model_ref: built-in model name or ``package.module:factory``.
        batch_size: minibatch size (> 0).
        device_type: a catalog GPU type (``"TITAN V"``) or ``"cpu"``.
        calibration: efficiencies from :func:`calibrate`; GPU defaults when ``None``.

    Raises:
        ModelError: bad model or batch size.
        ConfigError: unknown device type.
    """
    roof = roof_of(device_type)
    cal = calibration or Calibration()
    costs = layer_costs(model_ref, batch_size)
    meta = ProfileMeta(
        model=model_ref,
        device_type=roof.name,
        batch_size=batch_size,
        source="analytic",
        torch_version=torch.__version__,
        created=datetime.now(timezone.utc).isoformat(timespec="seconds"),
        extra={"calibration": cal.source, "fwd_eff": cal.fwd.__dict__, "bwd_eff": cal.bwd.__dict__},
    )
    return Profile(_rows(costs, roof, cal), meta)


def scale_profile(profile: Profile, to_type: str, from_type: str | None = None) -> Profile:
    """Scale a profile to another GPU type with the roofline model.

    For a profile of a resolvable model measured on a catalog GPU, each layer's time is
    multiplied by the ratio of its roofline times on the two types (so measured per-layer
    quirks carry over). For a ``cpu`` profile the target times are the calibrated analytic
    ones (CPU/GPU ratios are not meaningful per layer). For foreign profiles (PipeDream),
    layers with parameters scale with peak FLOP/s, the others with memory bandwidth.

    Args:
        profile: the source profile.
        to_type: the catalog GPU type to scale to.
        from_type: override of the source device type (e.g. for an imported profile).

    Raises:
        ConfigError: unknown source or target type.
    """
    src_type = from_type or profile.meta.device_type
    target = roof_of(to_type)
    try:
        source = roof_of(src_type)
    except ConfigError as exc:
        raise ConfigError(
            f"cannot scale profile of {profile.meta.model!r}: {exc}; pass from_type"
        ) from exc
    meta_kw: dict[str, Any] = {"device_type": target.name, "source": "scaled"}
    extra = {**profile.meta.extra, "scaled_from": source.name}
    try:
        costs: tuple[LayerCost, ...] | None = layer_costs(
            profile.meta.model, profile.meta.batch_size
        )
    except HetPipeError:  # foreign profiles (PipeDream) name no resolvable model
        costs = None
    if costs is not None and [c.name for c in costs] != profile.layers:
        costs = None
    table = profile.table.copy()
    if costs is not None and source is CPU_ROOF:
        # CPU efficiencies say nothing about a GPU: estimate the target with GPU defaults
        scaled = _rows(costs, target, Calibration())
        return profile.with_table(scaled, extra=extra, **meta_kw)
    for phase in ("fwd", "bwd"):
        ratios = []
        for i, row in enumerate(table.itertuples(index=False)):
            if costs is not None:
                c = costs[i]
                eff = Calibration().fwd if phase == "fwd" else Calibration().bwd
                args = (
                    (c.fwd_flops, c.fwd_bytes, c.fwd_kernels)
                    if phase == "fwd"
                    else (c.bwd_flops, c.bwd_bytes, c.bwd_kernels)
                )
                den = predict_ms(*args, source, eff)
                ratios.append(predict_ms(*args, target, eff) / den if den > 0 else 1.0)
            elif int(row.param_bytes) > 0:
                ratios.append(source.flops_per_s / target.flops_per_s)
            else:
                ratios.append(source.bytes_per_s / target.bytes_per_s)
        table[f"{phase}_ms"] = table[f"{phase}_ms"].to_numpy(float) * np.array(ratios)
    return profile.with_table(table, extra=extra, **meta_kw)
