"""Synthetic profiles for planner tests and benchmarks (random layer DAGs with skips)."""

from __future__ import annotations

import numpy as np
import pandas as pd

from profiler.catalog import lookup_gpu
from profiler.table import COLUMNS, Profile, ProfileMeta

__all__ = ["synthetic_profiles"]

MiB = 2**20


def synthetic_profiles(
    n_layers: int,
    types: tuple[str, ...] = ("TITAN V", "TITAN RTX", "GeForce RTX 2060", "Quadro P4000"),
    seed: int = 0,
    skip_prob: float = 0.1,
    model: str = "synthetic",
    batch_size: int = 32,
    act_mib: float = 64.0,
    param_mib: float = 16.0,
) -> dict[str, Profile]:
    """One profile per GPU type of a random ``n_layers``-layer model (placeholder and output included).

    Times on type ``t`` are a base time scaled by TITAN RTX's FP32 peak over ``t``'s, times a
    per-layer jitter, so types differ non-uniformly (as real GPUs do).
    """
    rng = np.random.default_rng(seed)
    names = ["x"] + [f"l{i}" for i in range(1, n_layers - 1)] + ["output"]
    inputs = [""]
    for i in range(1, n_layers):
        preds = {i - 1}
        if i >= 3 and rng.random() < skip_prob:
            preds.add(int(rng.integers(max(0, i - 6), i - 1)))
        inputs.append(";".join(names[p] for p in sorted(preds)))
    base = rng.gamma(2.0, 0.5, n_layers)
    base[0] = base[-1] = 0.0
    act = (rng.gamma(2.0, act_mib / 2, n_layers) * MiB).astype(np.int64)
    act[-1] = 0
    par = (rng.gamma(0.7, param_mib / 0.7, n_layers) * MiB).astype(np.int64)
    par[0] = par[-1] = 0
    ref = lookup_gpu("TITAN RTX").fp32_tflops
    out = {}
    for t in types:
        ratio = ref / lookup_gpu(t).fp32_tflops
        jitter = rng.uniform(0.8, 1.25, n_layers)
        fwd = base * ratio * jitter / 3
        table = pd.DataFrame(
            {
                "layer": names,
                "op": ["placeholder"] + ["Linear"] * (n_layers - 2) + ["output"],
                "inputs": inputs,
                "fwd_ms": fwd,
                "bwd_ms": 2 * fwd,
                "act_bytes": act,
                "saved_bytes": act,
                "param_bytes": par,
                "buffer_bytes": np.zeros(n_layers, dtype=np.int64),
                "mem_per_mb_bytes": act + par,
                "peak_bytes": np.zeros(n_layers, dtype=np.int64),
                "flops": np.zeros(n_layers),
            },
            columns=list(COLUMNS),
        ).astype(COLUMNS)
        out[t] = Profile(
            table,
            ProfileMeta(model=model, device_type=t, batch_size=batch_size, source="synthetic"),
        )
    return out
