"""Elastic averaging SGD over virtual workers, the synchronous variant (seed 001, Sec. 3.4, Alg. 2-3).

One source of truth for the simulator, the parameter-server shards and the single-process
reference. Every VW trains its own replica ``w_i`` with its own optimizer (local staleness
inside the VW as with WSP); every ``tau`` waves it *exchanges* with the shards, and both sides
apply the elastic update with the moving rate ``alpha`` (Zhang et al.'s ``eta * rho``):

    w_i <- w_i - alpha (w_i - c)                 (each VW: :func:`elastic_worker`)
    c   <- c + alpha sum_i (w_i - c)             (the shards: :func:`elastic_centre`)

both computed from the values *before* the exchange. The seed's Sync EASGD replaces the
original round-robin (one worker at a time, ordered by rank) by one reduction per exchange:
every VW sends its flat weights (one message per shard), the shard sums ``w_i - c`` in VW id
order (deterministic, whatever the arrival order) and answers every VW with the old centre.
The centre ``c`` is the model the run exports and evaluates.

Example: 2 VWs, alpha = 0.25, scalars for weights.

>>> elastic_centre(1.0, [3.0, 5.0], 0.25)
2.5
>>> elastic_worker(3.0, 1.0, 0.25), elastic_worker(5.0, 1.0, 0.25)
(2.5, 4.0)
>>> [c for c in range(8) if exchanges_after(c, tau=3)]
[2, 5]
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, TypeVar

__all__ = [
    "check_elastic",
    "elastic_centre",
    "elastic_worker",
    "exchange_index",
    "exchanges_after",
]


class _Vector(Protocol):
    def __add__(self: _V, other: _V, /) -> _V: ...
    def __sub__(self: _V, other: _V, /) -> _V: ...
    def __mul__(self: _V, k: float, /) -> _V: ...


_V = TypeVar("_V", bound=_Vector)


def check_elastic(n_vws: int, tau: int, alpha: float) -> None:
    """Validate the rule's parameters.

    The centre is a moving average only when ``n_vws * alpha <= 1`` (Zhang et al.'s
    ``beta = p * alpha``; they use 0.9): a larger ``alpha`` overshoots and diverges.

    Raises:
        ValueError: ``tau < 1``, ``alpha`` not in ``(0, 1]`` or ``n_vws * alpha > 1``.
    """
    if tau < 1:
        raise ValueError(f"tau (waves between exchanges) must be >= 1, got {tau}")
    if not 0.0 < alpha <= 1.0:
        raise ValueError(f"alpha must be in (0, 1], got {alpha}")
    if n_vws * alpha > 1.0 + 1e-12:
        raise ValueError(
            f"alpha x VWs = {alpha} x {n_vws} > 1: the centre would overshoot; "
            f"use alpha <= {1 / n_vws:.3g}"
        )


def exchanges_after(wave: int, tau: int) -> bool:
    """Whether a VW exchanges with the shards after finishing ``wave`` (0-based)."""
    if tau < 1:
        raise ValueError(f"tau must be >= 1, got {tau}")
    return (wave + 1) % tau == 0


def exchange_index(wave: int, tau: int) -> int:
    """0-based number of the exchange that follows ``wave`` (``exchanges_after`` must hold).

    >>> exchange_index(5, 3)
    1
    """
    if not exchanges_after(wave, tau):
        raise ValueError(f"no exchange after wave {wave} with tau {tau}")
    return (wave + 1) // tau - 1


def elastic_worker(w: _V, centre: _V, alpha: float) -> _V:
    """A VW's weights after an exchange: ``w - alpha (w - centre)`` (``centre`` before it)."""
    return w - (w - centre) * alpha


def elastic_centre(centre: _V, ws: Sequence[_V], alpha: float) -> _V:
    """The centre after an exchange: ``centre + alpha sum_i (w_i - centre)``.

    ``ws`` are the VWs' weights in VW id order; the sum is taken in that order.
    """
    if not ws:
        raise ValueError("an exchange needs at least one VW's weights")
    total = ws[0] - centre
    for w in ws[1:]:
        total = total + (w - centre)
    return centre + total * alpha
