"""The values a numeric option or rule parameter takes (:class:`Range`), plain data shared by
the planner's rule registry (:mod:`planner.rules`) and the run options (:mod:`runtime.options`)."""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = ["Range"]


@dataclass(frozen=True)
class Range:
    """The values a numeric option takes: finite, ``low <= v`` (``low < v`` when
    ``open_low``) and ``v < high`` (``v <= high`` unless ``open_high``).

    >>> Range(0, 1).problem(1.0)
    'must be a finite number in [0, 1)'
    >>> Range(0, open_low=True).problem(float("nan"))
    'must be a finite number > 0'
    """

    low: float
    high: float = math.inf
    open_low: bool = False
    open_high: bool = True

    def describe(self) -> str:
        """``> 0``, ``>= 1``, ``in [0, 1)``."""
        low = _number(self.low)
        if self.high == math.inf:
            return f"> {low}" if self.open_low else f">= {low}"
        left, right = "(" if self.open_low else "[", ")" if self.open_high else "]"
        return f"in {left}{low}, {_number(self.high)}{right}"

    def problem(self, value: float) -> str | None:
        """What is wrong with ``value`` (``None``: nothing)."""
        bad_low = value <= self.low if self.open_low else value < self.low
        bad_high = value >= self.high if self.open_high else value > self.high
        if math.isfinite(value) and not bad_low and not bad_high:
            return None
        return (
            f"must be a {'whole' if isinstance(value, int) else 'finite'} number {self.describe()}"
        )


def _number(x: float) -> str:
    """``1000000`` rather than ``1e+06``: a bound as one would type it."""
    return str(int(x)) if float(x).is_integer() else f"{x:g}"
