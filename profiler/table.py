"""The profile table: the one contract between profiler and planner.

A profile is one pandas ``DataFrame`` (one row per layer of the model graph, in its
topological linear order) plus metadata, for one (model, device type, batch size).
It is stored as CSV whose first line is ``# hetpipe-profile <json metadata>``;
:func:`load_profile` reads it back losslessly. A *profile set* is a folder of such files.

Columns (units in the names):

=================  =====================================================================
``layer``          layer name (fx node name, or ``nodeN`` for PipeDream imports)
``op``             operation (``Conv2d``, ``add``, ``placeholder``, ``output``, ...)
``inputs``         ``;``-joined names of the layers this layer reads (the DAG's edges)
``fwd_ms``         forward time of one minibatch, milliseconds
``bwd_ms``         backward time of one minibatch, milliseconds
``act_bytes``      bytes of the layer's output activations for one minibatch
``saved_bytes``    bytes autograd saves for backward (held until the backward pass)
``param_bytes``    bytes of the parameters the layer owns
``buffer_bytes``   bytes of non-trainable buffers (batch-norm statistics)
``mem_per_mb_bytes`` memory per in-flight minibatch: saved activations + one stashed weight version
``peak_bytes``     measured peak allocator memory of the layer's step (CUDA only, else 0)
``flops``          forward FLOPs of one minibatch (0 when unknown)
=================  =====================================================================
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import pandas as pd

from profiler.errors import ProfileError
from profiler.files import atomic_write_text

__all__ = [
    "COLUMNS",
    "Profile",
    "ProfileMeta",
    "load_profile",
    "load_profile_set",
]

COLUMNS: dict[str, str] = {
    "layer": "str",
    "op": "str",
    "inputs": "str",
    "fwd_ms": "float64",
    "bwd_ms": "float64",
    "act_bytes": "int64",
    "saved_bytes": "int64",
    "param_bytes": "int64",
    "buffer_bytes": "int64",
    "mem_per_mb_bytes": "int64",
    "peak_bytes": "int64",
    "flops": "float64",
}

_MAGIC = "# hetpipe-profile "


@dataclass(frozen=True)
class ProfileMeta:
    """Where a profile came from.

    Attributes:
        model: model reference (built-in name, ``pkg.mod:factory`` or the imported file's name).
        device_type: catalog GPU type (``"TITAN V"``) or ``"cpu"``.
        batch_size: minibatch size the times and sizes are for.
        source: ``measured``, ``analytic``, ``scaled`` or ``pipedream``.
        dtype: parameter/activation dtype, e.g. ``float32``.
        torch_version: torch version that measured it.
        host: machine name that measured it.
        created: ISO timestamp.
        extra: free-form provenance (repeats, warm-up, calibration source, ...).
    """

    model: str
    device_type: str
    batch_size: int
    source: str = "measured"
    dtype: str = "float32"
    torch_version: str = ""
    host: str = ""
    created: str = ""
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Profile:
    """A per-layer profile: ``table`` (schema in this module's docstring) and ``meta``."""

    table: pd.DataFrame
    meta: ProfileMeta

    def __post_init__(self) -> None:
        missing = [c for c in COLUMNS if c not in self.table.columns]
        if missing:
            raise ProfileError(f"profile of {self.meta.model!r} lacks columns {missing}")

    # ------------------------------------------------------------ graph queries

    @property
    def layers(self) -> list[str]:
        """Layer names in linear order."""
        return [str(x) for x in self.table["layer"]]

    def input_indices(self) -> list[tuple[int, ...]]:
        """For every layer, the indices of the layers it reads."""
        pos = {name: i for i, name in enumerate(self.layers)}
        result = []
        for i, cell in enumerate(self.table["inputs"]):
            names = [n for n in str(cell).split(";") if n and n != "nan"]
            try:
                result.append(tuple(sorted(pos[n] for n in names)))
            except KeyError as exc:
                raise ProfileError(
                    f"profile of {self.meta.model!r}: layer {self.layers[i]!r} reads unknown layer {exc}"
                ) from exc
        return result

    def cut_bytes(self) -> list[int]:
        """``result[k]``: activation bytes crossing cut ``k`` (skips included), ``k = 0..L``."""
        acts = self.table["act_bytes"].tolist()
        from profiler.graph import crossing_sets  # torch: only when a graph is needed

        return [sum(int(acts[i]) for i in cross) for cross in crossing_sets(self.input_indices())]

    def with_table(self, table: pd.DataFrame, **meta: Any) -> Profile:
        """A copy with another table and some metadata fields replaced."""
        return Profile(table.reset_index(drop=True), replace(self.meta, **meta))

    # ------------------------------------------------------------ storage

    def save(self, path: str | os.PathLike[str]) -> Path:
        """Write the profile as CSV with a metadata header, atomically (write, then rename)."""
        meta = dict(self.meta.__dict__)
        meta["extra"] = {
            **self.meta.extra,
            "rows": len(self.table),
        }  # detects a file cut at a row boundary
        body = self.table[list(COLUMNS)].to_csv(
            index=False, float_format="%.17g", lineterminator="\n"
        )
        text = _MAGIC + json.dumps(meta, sort_keys=True) + "\n" + body
        return atomic_write_text(Path(path), text)


def load_profile(path: str | os.PathLike[str]) -> Profile:
    """Read a profile written by :meth:`Profile.save`.

    Raises:
        ProfileError: the file is missing, unreadable, truncated or not a hetpipe profile.
    """
    p = Path(path)
    try:
        with p.open(encoding="utf-8") as fh:
            first = fh.readline()
            if not first.startswith(_MAGIC):
                raise ProfileError(
                    f"{p}: not a hetpipe profile (first line must start with {_MAGIC.strip()!r})"
                )
            meta_raw = json.loads(first[len(_MAGIC) :])
            table = pd.read_csv(
                fh, dtype={"layer": str, "op": str, "inputs": str}, keep_default_na=False
            )
    except OSError as exc:
        raise ProfileError(f"{p}: cannot read profile ({exc.strerror or exc})") from exc
    except (
        json.JSONDecodeError,
        pd.errors.ParserError,
        pd.errors.EmptyDataError,
        UnicodeDecodeError,
    ) as exc:
        raise ProfileError(f"{p}: malformed profile ({type(exc).__name__}: {exc})") from exc
    try:
        meta = ProfileMeta(**meta_raw)
    except TypeError as exc:
        raise ProfileError(f"{p}: malformed profile metadata ({exc})") from exc
    missing = [c for c in COLUMNS if c not in table.columns]
    if missing:
        raise ProfileError(f"{p}: profile lacks columns {missing} (truncated or foreign file?)")
    try:
        for col, dtype in COLUMNS.items():
            if dtype != "str":
                table[col] = pd.to_numeric(table[col], errors="raise").astype(dtype)
    except (ValueError, TypeError) as exc:
        raise ProfileError(f"{p}: column {col!r} holds a non-numeric value ({exc})") from exc
    if table.empty:
        raise ProfileError(f"{p}: profile has no layers")
    extra = dict(meta.extra)
    rows = extra.pop("rows", None)
    if rows is not None and rows != len(table):
        raise ProfileError(
            f"{p}: profile is truncated ({len(table)} of {rows} layer rows); re-create it"
        )
    meta = replace(meta, extra=extra)
    return Profile(table, meta)


def load_profile_set(paths: Iterable[str | os.PathLike[str]]) -> list[Profile]:
    """Read every ``*.csv`` profile in the given files or folders."""
    result = []
    for path in paths:
        p = Path(path)
        files = sorted(p.glob("*.csv")) if p.is_dir() else [p]
        result += [load_profile(f) for f in files if not f.name.startswith("links")]
    return result
