"""The pydantic schema of cluster.yaml (and of a links file), and its one-line errors.

:func:`planner.cluster.parse_cluster` validates a document with :class:`ClusterIn`, then
turns it into the frozen :class:`planner.cluster.Cluster`. Values are range-checked here:
sizes, bandwidths and latencies finite (bandwidth positive), names printable and short.
"""

from __future__ import annotations

from typing import Annotated

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
)

from profiler.errors import ConfigError, shown
from profiler.inputs import text_problem
from profiler.units import parse_bandwidth, parse_bytes, parse_seconds

__all__ = ["PCIE_BPS", "ClusterIn", "LinkIn", "pydantic_error"]

MAX_NAME_CHARS = 128  # node, host, GPU type and cluster names
PCIE_BPS = 15.75e9 * 0.8  # PCIe 3.0 x16, 80 % of the nominal rate


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)


def _name(v: object) -> object:
    """A name must be short, printable text (it is echoed on terminals and used as a label)."""
    problem = text_problem(v, MAX_NAME_CHARS) if isinstance(v, str) else None
    if problem is not None:
        raise ValueError(f"{shown(v)} cannot be a name: {problem}; rename it")
    return v


_Name = Annotated[str, BeforeValidator(_name)]


class LinkIn(_Strict):
    bandwidth: float
    latency: float = 0.0

    @field_validator("bandwidth", mode="before")
    @classmethod
    def _bw(cls, v: object) -> float:
        bw = parse_bandwidth(v)
        if bw <= 0:
            raise ValueError("bandwidth must be positive (e.g. 15.75GB/s)")
        return bw

    @field_validator("latency", mode="before")
    @classmethod
    def _lat(cls, v: object) -> float:
        return parse_seconds(v)


class _LinksIn(_Strict):
    intra_node: LinkIn = LinkIn(bandwidth=15.75e9 * 0.8, latency=5e-6)
    inter_node: LinkIn = LinkIn(bandwidth=56e9 / 8 * 0.8, latency=5e-6)
    host_link: LinkIn = LinkIn(bandwidth=PCIE_BPS, latency=10e-6)
    scale: float = Field(default=1.0, gt=0, le=1e9)  # emulated clusters: link time factor


class _StraggleIn(_Strict):
    p: float = Field(ge=0, le=1)
    factor: float = Field(ge=1, le=1000)
    seed: int = Field(default=0, ge=0)


class _EmulateIn(_Strict):
    speed: float = Field(gt=0, le=8)
    memory: int
    straggle: _StraggleIn | None = None

    @field_validator("memory", mode="before")
    @classmethod
    def _mem(cls, v: object) -> int:
        m = parse_bytes(v)
        if m <= 0:
            raise ValueError("memory must be positive (e.g. 64MiB)")
        return m


class _NodeIn(_Strict):
    name: _Name = Field(min_length=1)
    host: _Name | None = None
    gpu: _Name = Field(min_length=1)
    count: int = Field(ge=1, le=1024)
    memory: int | None = None
    host_memory: int | None = None
    emulate: _EmulateIn | None = None

    @field_validator("count", mode="before")
    @classmethod
    def _count(cls, v: object) -> object:
        if isinstance(v, bool) or not isinstance(v, int):
            raise ValueError(f"count must be a whole number of GPUs, got {v!r}")
        return v

    @field_validator("memory", "host_memory", mode="before")
    @classmethod
    def _mem(cls, v: object) -> int | None:
        if v is None:
            return None
        m = parse_bytes(v)
        if m <= 0:
            raise ValueError("memory must be positive (e.g. 12GiB)")
        return m


class _RuntimeOverheadIn(_Strict):
    ms_per_task: float = Field(default=0.0, ge=0, le=1e6)  # planner.overhead.RuntimeOverhead
    cores: int = Field(default=0, ge=0, le=1_000_000)  # host cores shared (0: one per process)
    ms_per_wave: float = Field(default=0.0, ge=0, le=1e6)  # per stage per wave through shards
    ms_per_mb: float = Field(default=0.0, ge=0, le=1e6)  # per MB of the stage's params per wave


class ClusterIn(_Strict):
    name: _Name = "cluster"
    nodes: list[_NodeIn] = Field(min_length=1, max_length=100_000)
    links: _LinksIn = _LinksIn()
    runtime_overhead: _RuntimeOverheadIn = _RuntimeOverheadIn()


def _loc(loc: tuple[int | str, ...]) -> str:
    """A field path as written in the file: ``nodes[2].emulate.memory``."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif part.isidentifier() and len(part) <= 40:
            out += f".{part}" if out else part
        else:  # a key the user wrote: escaped and cut
            out += f"[{shown(part, 40)}]"
    return out or "<document>"


def pydantic_error(exc: ValidationError, source: str) -> ConfigError:
    """The first validation error as one line: ``source: field.path: message (hint)``."""
    err = exc.errors()[0]
    msg = str(err["msg"]).removeprefix("Value error, ")
    hint = ""
    if err["type"] in ("model_type", "dict_type"):  # pydantic's words name our private class
        msg = f"{shown(err.get('input'), 40)} is not a mapping"
        hint = " (give its keys as `key: value` lines indented under it)"
    elif err["type"] == "missing":
        hint = " (add it)"
    elif err["type"] == "extra_forbidden":
        hint = " (unknown field: remove it or fix its spelling)"
    return ConfigError(f"{source}: {_loc(tuple(err['loc']))}: {msg}{hint}")
