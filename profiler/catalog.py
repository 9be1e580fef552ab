"""A catalog of real GPU specifications, so a cluster can name a GPU type without restating it.

Figures are the vendors' published numbers for one device (one die for the dual-die K80):
memory in GiB as marketed for GPUs, FP32 peak from CUDA cores x 2 x boost clock, and
peak DRAM bandwidth. The analytic profiler turns these into per-layer time estimates.
"""

from __future__ import annotations

from dataclasses import dataclass

from profiler.errors import ConfigError

__all__ = ["CATALOG", "GPUSpec", "lookup_gpu"]

GiB = 2**30


@dataclass(frozen=True)
class GPUSpec:
    """Published specification of one GPU type.

    Attributes:
        name: canonical catalog name, e.g. ``"TITAN V"``.
        letter: one-letter code used in allocation strings (the paper's V, R, G, Q).
        memory_bytes: device memory in bytes.
        fp32_tflops: peak FP32 throughput in TFLOP/s (CUDA cores only, no tensor cores).
        mem_bw_gbs: peak memory bandwidth in GB/s (1e9 bytes/s).
        architecture: GPU architecture name.
        year: release year.
    """

    name: str
    letter: str
    memory_bytes: int
    fp32_tflops: float
    mem_bw_gbs: float
    architecture: str
    year: int


CATALOG: dict[str, GPUSpec] = {
    s.name: s
    for s in (
        # The HetPipe paper's four types (paper Table 1): cores x 2 x boost clock.
        GPUSpec("TITAN V", "V", 12 * GiB, 5120 * 2 * 1.455e9 / 1e12, 653.0, "Volta", 2017),
        GPUSpec("TITAN RTX", "R", 24 * GiB, 4608 * 2 * 1.770e9 / 1e12, 672.0, "Turing", 2018),
        GPUSpec("GeForce RTX 2060", "G", 6 * GiB, 1920 * 2 * 1.680e9 / 1e12, 336.0, "Turing", 2019),
        GPUSpec("Quadro P4000", "Q", 8 * GiB, 1792 * 2 * 1.480e9 / 1e12, 243.0, "Pascal", 2017),
        # Data-centre parts.
        GPUSpec("K80", "K", 12 * GiB, 4.37, 240.0, "Kepler", 2014),
        GPUSpec("P100", "P", 16 * GiB, 9.3, 732.0, "Pascal", 2016),
        GPUSpec("V100", "W", 16 * GiB, 15.7, 900.0, "Volta", 2017),
        GPUSpec("V100-32GB", "X", 32 * GiB, 15.7, 900.0, "Volta", 2018),
        GPUSpec("T4", "T", 16 * GiB, 8.1, 320.0, "Turing", 2018),
        GPUSpec("A100", "A", 40 * GiB, 19.5, 1555.0, "Ampere", 2020),
        GPUSpec("A100-80GB", "B", 80 * GiB, 19.5, 2039.0, "Ampere", 2020),
        GPUSpec("H100", "H", 80 * GiB, 67.0, 3350.0, "Hopper", 2022),
    )
}

_ALIASES = {
    "titanv": "TITAN V",
    "titanrtx": "TITAN RTX",
    "rtx2060": "GeForce RTX 2060",
    "geforcertx2060": "GeForce RTX 2060",
    "2060": "GeForce RTX 2060",
    "p4000": "Quadro P4000",
    "quadrop4000": "Quadro P4000",
    "teslak80": "K80",
    "teslap100": "P100",
    "teslav100": "V100",
    "teslat4": "T4",
    "a10040gb": "A100",
    "h100sxm": "H100",
}


def _key(name: str) -> str:
    return "".join(ch for ch in name.lower() if ch.isalnum())


def lookup_gpu(name: str) -> GPUSpec:
    """Return the catalog entry for ``name`` (case, spaces and dashes are ignored).

    Raises:
        ConfigError: the name is not in the catalog; the message lists the known names.
    """
    wanted = _key(name)
    for spec in CATALOG.values():
        if _key(spec.name) == wanted:
            return spec
    if wanted in _ALIASES:
        return CATALOG[_ALIASES[wanted]]
    known = ", ".join(CATALOG)
    raise ConfigError(
        f"unknown GPU type {name!r}; known types: {known} (or give memory explicitly)"
    )
