"""Parsing of human-written sizes, bandwidths and durations (``12GiB``, ``56Gbit/s``, ``2us``).

Plain numbers are taken in the base unit: bytes, bytes/s, seconds.
"""

from __future__ import annotations

import re

__all__ = ["format_bytes", "parse_bandwidth", "parse_bytes", "parse_seconds"]

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
        raise ValueError(f"expected a {what}, got {value!r}")
    if isinstance(value, (int, float)):
        number, unit = float(value), ""
    elif isinstance(value, str):
        m = re.fullmatch(_NUM + r"([A-Za-zµ/]*)\s*", value)
        if m is None:
            raise ValueError(f"cannot read {value!r} as a {what}")
        number, unit = float(m.group(1)), m.group(2)
    else:
        raise ValueError(f"expected a {what}, got {type(value).__name__} {value!r}")
    # Case matters only between bits and bytes ("Gb/s" is ambiguous, so 'bit' must be spelt out).
    key = unit.lower()
    if key not in units:
        known = ", ".join(sorted(k for k in units if k))
        raise ValueError(f"unknown unit {unit!r} in {value!r} for a {what} (use one of: {known})")
    result = number * units[key]
    if result < 0:
        raise ValueError(f"a {what} cannot be negative, got {value!r}")
    return result


def parse_bytes(value: object) -> int:
    """Parse a size such as ``12GiB``, ``8 GB``, ``512MiB`` or a plain number of bytes."""
    return round(_parse(value, _BYTE_UNITS, "size in bytes (e.g. 12GiB)"))


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
