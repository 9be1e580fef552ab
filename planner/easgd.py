"""Elastic averaging SGD over virtual workers, the synchronous variant (seed 001, Sec. 3.4, Alg. 2-3).

One source of truth for the simulator, the parameter-server shards and the single-process
reference. Every VW trains its own replica ``w_i`` with its own optimizer (local staleness
inside the VW as with WSP); every ``tau`` waves it *exchanges* with the shards, and both sides
apply the elastic update with the moving rate ``alpha`` (Zhang et al.'s ``eta * rho``):

    w_i <- w_i - alpha (w_i - c)                 (each VW: :func:`elastic_worker`)
    c   <- c + alpha sum_i (w_i - c)             (the shards: :func:`elastic_centre`)

both computed from the values *before* the exchange. Both are one quantity, the *elastic
difference* ``d_i = alpha (w_i - c)`` (:func:`elastic_difference`): the VW subtracts it, the
centre adds the sum over VWs. The seed's Sync EASGD replaces the original round-robin (one
worker at a time, ordered by rank) by one reduction per exchange; over the parameter-server
shards exchange ``k`` is:

1. the VW pulls the centre ``c_k`` (one flat message per shard; it holds exchanges
   ``0 .. k-1`` of every VW, exactly like a WSP pull of global clock ``k``);
2. it computes ``d_i``, subtracts it from its weights and pushes it (one flat message per
   shard) as its "update" of wave ``k``;
3. the shard adds the VWs' ``d_i`` in ``(vw, stage)`` order once all arrived: ``c_{k+1}``. This is
   the shard's WSP rule with ``D = 0`` on exchanges, so it needs no new shard logic and the
   result does not depend on arrival order.

A VW waits at exchange ``k`` only for the others' exchange ``k - 1`` (``tau`` waves earlier): the
same arithmetic as the barrier of the seed's Algorithm 2, less waiting. The centre is the
model the run exports and evaluates.

Example: 2 VWs, alpha = 0.25, scalars for weights.

>>> elastic_centre(1.0, [3.0, 5.0], 0.25)
2.5
>>> elastic_worker(3.0, 1.0, 0.25), elastic_worker(5.0, 1.0, 0.25)
(2.5, 4.0)
>>> [c for c in range(8) if exchanges_after(c, tau=3)]
[2, 5]
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Protocol, TypeVar

__all__ = [
    "check_easgd",
    "check_elastic",
    "elastic_centre",
    "elastic_difference",
    "elastic_worker",
    "exchange_index",
    "exchanges_after",
    "stop_waves",
    "waves_at",
    "waves_per_exchange",
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


def check_easgd(params: Mapping[str, float], n_vws: int) -> None:
    """The rule's check against a plan (:attr:`planner.rules.SyncRule.check`).

    Raises:
        ValueError: :func:`check_elastic`'s message.
    """
    check_elastic(n_vws, int(params["tau"]), params["alpha"])


def waves_per_exchange(params: Mapping[str, float]) -> int:
    """Waves one tick of the centre's clock covers: ``tau`` (the shards count exchanges)."""
    return int(params.get("tau", 1.0))


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


def waves_at(exchanges: int, tau: int) -> int:
    """Waves every VW has run when the centre holds ``exchanges`` exchanges (its clock, the
    clock of an EASGD snapshot): a resumed run starts at that wave.

    >>> waves_at(3, 4)
    12
    """
    if tau < 1 or exchanges < 0:
        raise ValueError(f"need tau >= 1 and exchanges >= 0, got {tau}, {exchanges}")
    return exchanges * tau


def stop_waves(admitted: int, nm: int, tau: int) -> int:
    """Waves every VW runs when a VW that has admitted ``admitted`` minibatches must stop (a
    time limit; the EASGD counterpart of :func:`planner.wsp.stop_wave`).

    The proposer has made at most ``e = admitted // nm // tau`` exchanges. Exchange ``k``
    (after ``(k + 1) tau`` waves) pulls the centre of every VW's exchange ``k - 1``, so another
    VW can complete exchange ``e`` and block at exchange ``e + 1``, after ``(e + 2) tau`` waves,
    with up to ``Nm - 1`` minibatches of the next wave admitted (local staleness). The stop
    must lie beyond that and on an exchange, so that no VW waits for an exchange that never
    comes and no trained wave is left out of the centre: ``(e + 3) tau`` waves.

    >>> stop_waves(0, 2, 1), stop_waves(9, 2, 2)
    (3, 10)
    """
    if nm < 1 or tau < 1 or admitted < 0:
        raise ValueError(f"need nm, tau >= 1 and admitted >= 0, got {nm}, {tau}, {admitted}")
    return (admitted // nm // tau + 3) * tau


def elastic_difference(w: _V, centre: _V, alpha: float) -> _V:
    """``d = alpha (w - centre)``: what the VW subtracts and the centre adds (summed)."""
    return (w - centre) * alpha


def elastic_worker(w: _V, centre: _V, alpha: float) -> _V:
    """A VW's weights after an exchange: ``w - alpha (w - centre)`` (``centre`` before it)."""
    return w - elastic_difference(w, centre, alpha)


def elastic_centre(centre: _V, ws: Sequence[_V], alpha: float) -> _V:
    """The centre after an exchange: ``centre + alpha sum_i (w_i - centre)``.

    ``ws`` are the VWs' weights in VW id order; the sum is taken in that order.
    """
    if not ws:
        raise ValueError("an exchange needs at least one VW's weights")
    total = elastic_difference(ws[0], centre, alpha)
    for w in ws[1:]:
        total = total + elastic_difference(w, centre, alpha)
    return centre + total
