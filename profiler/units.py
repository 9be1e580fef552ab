"""Parsing of human-written sizes, bandwidths and durations (``12GiB``, ``56Gbit/s``, ``2us``).

Plain numbers are taken in the base unit: bytes, bytes/s, seconds. Every result is finite and
non-negative; a size is at most :data:`MAX_BYTES` (a larger one is a unit mistake).
"""

from __future__ import annotations

import math
import re

from profiler.errors import shown

__all__ = ["MAX_BYTES", "format_bytes", "parse_bandwidth", "parse_bytes", "parse_seconds"]

MAX_BYTES = 2**60  # 1 EiB: no memory or message is larger (and it fits an int64)

_NUM = r"\s*([0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)\s*"

_BYTE_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}
_BW_UNITS = {
    "": 1.0,
    "b/s": 1.0,
    "kb/s": 1e3,
    "mb/s": 1e6,
    "gb/s": 1e9,
    "kib/s": 2.0**10,
    "mib/s": 2.0**20,
    "gib/s": 2.0**30,
    "kbit/s": 1e3 / 8,
    "mbit/s": 1e6 / 8,
    "gbit/s": 1e9 / 8,
    "kbps": 1e3 / 8,
    "mbps": 1e6 / 8,
    "gbps": 1e9 / 8,
}
_TIME_UNITS = {"": 1.0, "s": 1.0, "ms": 1e-3, "us": 1e-6, "µs": 1e-6, "ns": 1e-9}


def _parse(value: object, units: dict[str, float] | dict[str, int], what: str) -> float:
    if isinstance(value, bool):
        raise ValueError(f"expected a {what}, got {value}")
    if isinstance(value, (int, float)):
        number, unit = _float(value), ""
    elif isinstance(value, str):
        m = re.fullmatch(_NUM + r"([A-Za-zµ/]*)\s*", value)
        if m is None:
            raise ValueError(f"cannot read {shown(value)} as a {what}")
        number, unit = float(m.group(1)), m.group(2)
    else:
        raise ValueError(f"expected a {what}, got {type(value).__name__} {shown(value)}")
    # Case matters only between bits and bytes ("Gb/s" is ambiguous, so 'bit' must be spelt out).
    key = unit.lower()
    if key not in units:
        known = ", ".join(sorted(k for k in units if k))
        raise ValueError(
            f"unknown unit {shown(unit, 20)} in {shown(value)} for a {what} (use one of: {known})"
        )
    result = number * units[key]
    if not math.isfinite(result):
        raise ValueError(f"a {what} must be a finite number, got {shown(value)}")
    if result < 0:
        raise ValueError(f"a {what} cannot be negative, got {shown(value)}")
    return result


def _float(value: int | float) -> float:
    try:
        return float(value)
    except OverflowError:  # an int beyond float range
        return math.inf if value > 0 else -math.inf


def parse_bytes(value: object) -> int:
    """Parse a size such as ``12GiB``, ``8 GB``, ``512MiB`` or a plain number of bytes."""
    what = "size in bytes (e.g. 12GiB)"
    n = _parse(value, _BYTE_UNITS, what)
    if n > MAX_BYTES:
        raise ValueError(f"a {what} must be at most 1 EiB, got {shown(value)}: check the unit")
    return round(n)


def parse_bandwidth(value: object) -> float:
    """Parse a bandwidth such as ``15.75GB/s`` or ``56Gbit/s`` into bytes per second."""
    return _parse(value, _BW_UNITS, "bandwidth (e.g. 15.75GB/s or 56Gbit/s)")


def parse_seconds(value: object) -> float:
    """Parse a duration such as ``2us``, ``0.5ms`` or ``1s`` into seconds."""
    return _parse(value, _TIME_UNITS, "duration (e.g. 5us or 0.2ms)")


def format_bytes(n: float) -> str:
    """Format a byte count with a binary unit that keeps 3 significant digits: ``1.50 MiB``."""
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:.3g} {unit}"
    return f"{n:.0f} B"
