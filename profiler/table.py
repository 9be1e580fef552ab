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

import io
import json
import os
from collections.abc import Iterable
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from profiler.crossing import crossing_sets
from profiler.errors import ProfileError, shown
from profiler.files import atomic_write_text
from profiler.inputs import read_text, text_problem
from profiler.units import MAX_BYTES

__all__ = [
    "COLUMNS",
    "DEFAULT_BATCH_SIZE",
    "Profile",
    "ProfileMeta",
    "check_table",
    "load_profile",
    "load_profile_set",
]

DEFAULT_BATCH_SIZE = 32  # samples per minibatch when neither the profiles nor the user say

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
        return [sum(int(acts[i]) for i in cross) for cross in crossing_sets(self.input_indices())]

    def at_precision(self, precision: str) -> Profile:
        """This profile's bytes under ``precision`` (:mod:`profiler.precision`): a float32 profile
        planned for ``bf16`` gets bfloat16 activations and saved tensors plus the bfloat16 weight
        copy autograd saves (:func:`profiler.precision.bf16_memory`); its times stay as measured.

        Raises:
            ProfileError: a bfloat16 profile asked for ``fp32`` (re-profile in float32).
        """
        from profiler.precision import bf16_memory, dtype_name

        want = dtype_name(precision)
        if self.meta.dtype == want:
            return self
        if self.meta.dtype != "float32" or want != "bfloat16":
            raise ProfileError(
                f"profile of {self.meta.model!r} is {self.meta.dtype}, the plan is {precision}: "
                f"profile again with 'hetpipe profile --precision {precision}'"
            )
        table = self.table.copy()
        acts, saved = (
            zip(
                *(
                    bf16_memory(int(a), int(s), int(p))
                    for a, s, p in zip(
                        table["act_bytes"], table["saved_bytes"], table["param_bytes"], strict=True
                    )
                ),
                strict=True,
            )
            if len(table)
            else ((), ())
        )
        table["act_bytes"] = np.array(acts, dtype=np.int64)
        table["saved_bytes"] = np.array(saved, dtype=np.int64)
        table["mem_per_mb_bytes"] = table["saved_bytes"] + table["param_bytes"]
        extra = {**self.meta.extra, "precision": f"{precision} (bytes from a float32 profile)"}
        return self.with_table(table, dtype=want, extra=extra)

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
    """Read a profile written by :meth:`Profile.save`, checking every value.

    Raises:
        ProfileError: the file is missing, unreadable, truncated, not a hetpipe profile, or holds
            a value out of range (see :func:`check_table`); one line naming the file and field.
    """
    p = Path(path)
    text = read_text(p, "profile", ProfileError)
    first, _, body = text.partition("\n")
    if not first.startswith(_MAGIC):
        raise ProfileError(
            f"{p}: not a hetpipe profile (first line must start with {_MAGIC.strip()!r})"
        )
    try:
        meta_raw = json.loads(first[len(_MAGIC) :])
    except (ValueError, RecursionError) as exc:
        raise ProfileError(f"{p}: line 1: the metadata is not valid JSON ({exc!s:.80})") from None
    meta = _meta(meta_raw, p)
    try:
        table = pd.read_csv(
            io.StringIO(body),
            dtype={"layer": str, "op": str, "inputs": str},
            keep_default_na=False,
            engine="c",
        )
    except (pd.errors.ParserError, pd.errors.EmptyDataError, ValueError, OverflowError) as exc:
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ProfileError(f"{p}: malformed profile table ({reason:.120})") from None
    missing = [c for c in COLUMNS if c not in table.columns]
    if missing:
        raise ProfileError(f"{p}: profile lacks columns {missing} (truncated or foreign file?)")
    table = check_table(table, str(p))
    extra = dict(meta.extra)
    rows = extra.pop("rows", None)
    if rows is not None and rows != len(table):
        raise ProfileError(
            f"{p}: profile is truncated ({len(table)} of {shown(rows)} layer rows); re-create it"
        )
    return Profile(table, replace(meta, extra=extra))


def _meta(raw: object, p: Path) -> ProfileMeta:
    """The metadata line's fields, type- and range-checked."""
    if not isinstance(raw, dict):
        raise ProfileError(f"{p}: line 1: the metadata must be a JSON object")
    names = {f.name: f for f in fields(ProfileMeta)}
    for key, value in raw.items():
        f = names.get(key)
        if f is None:
            raise ProfileError(f"{p}: metadata field {shown(key, 40)} is unknown; remove it")
        ok = {
            "str": lambda v: isinstance(v, str) and text_problem(v, 1000) is None,
            "int": lambda v: isinstance(v, int) and not isinstance(v, bool) and 1 <= v <= 2**31,
        }.get(str(f.type), lambda v: isinstance(v, dict))(value)
        if not ok:
            want = {"int": "a whole number from 1", "str": "printable text without [tags]"}.get(
                str(f.type), "a JSON object"
            )
            raise ProfileError(f"{p}: metadata field {key}: {shown(value)} is not {want}")
    try:
        return ProfileMeta(**raw)
    except TypeError as exc:
        raise ProfileError(f"{p}: malformed profile metadata ({exc})") from None


def check_table(table: pd.DataFrame, source: str) -> pd.DataFrame:
    """Convert and range-check a profile table's columns (schema in this module's docstring).

    Times and FLOPs must be finite and non-negative, byte counts whole, non-negative and at most
    2**60; layer names non-empty, printable and unique; every input an earlier layer.

    Returns:
        The table with every numeric column of its declared dtype.

    Raises:
        ProfileError: one line naming ``source``, the column, the row's layer and the value.
    """
    if table.empty:
        raise ProfileError(f"{source}: profile has no layers")
    table = table.copy()
    for col, dtype in COLUMNS.items():
        if dtype == "str":
            table[col] = table[col].astype(dtype)
            continue
        values = pd.to_numeric(table[col], errors="coerce").astype("float64")
        bad = ~np.isfinite(values) | (values < 0)
        if dtype == "int64":
            bad |= (values > MAX_BYTES) | (values != np.floor(values))
        if bad.any():
            row = int(np.argmax(bad.to_numpy()))
            layer = shown(str(table["layer"].iloc[row]), 40)
            kind = (
                "a whole number of bytes from 0 to 2**60"
                if dtype == "int64"
                else "a finite number >= 0"
            )
            cell = table[col].iloc[row]
            cell = cell.item() if isinstance(cell, np.generic) else cell
            raise ProfileError(
                f"{source}: column {col!r}, layer {layer} (line {row + 3}): "
                f"{shown(cell, 40)} must be {kind}"
            )
        table[col] = values.astype(dtype)
    names = table["layer"].tolist()
    seen: dict[str, int] = {}
    for row, (name, op) in enumerate(zip(names, table["op"], strict=True)):
        for col, text in (("layer", name), ("op", op)):
            why = text_problem(text, 1000) if text else "it is empty"
            if col == "layer" and name in seen:
                why = f"it repeats the layer of line {seen[name] + 3}"
            if why is not None:
                raise ProfileError(
                    f"{source}: column {col!r}, line {row + 3}: {shown(text, 40)} cannot be used: {why}"
                )
        seen[name] = row
    for row, cell in enumerate(table["inputs"]):
        for name in (n for n in cell.split(";") if n and n != "nan"):
            if seen.get(name, row) >= row:
                raise ProfileError(
                    f"{source}: column 'inputs', layer {shown(names[row], 40)} (line {row + 3}): "
                    f"{shown(name, 40)} is not an earlier layer (the rows must be in "
                    "topological order)"
                )
    return table


def load_profile_set(paths: Iterable[str | os.PathLike[str]]) -> list[Profile]:
    """Read every ``*.csv`` profile in the given files or folders."""
    result = []
    for path in paths:
        p = Path(path)
        files = sorted(p.glob("*.csv")) if p.is_dir() else [p]
        result += [load_profile(f) for f in files if not f.name.startswith("links")]
    return result
