"""Staleness remedies: how a stage's update compensates for delayed gradients, as pure rules.

With ``Nm`` minibatches in flight, minibatch ``p`` runs on every stage with the weights
``w0 + u1 + ... + u(p-Nm)`` (:func:`planner.wsp.local_version`, weight stashing) and its own
update lands on the master after ``u(p-1)``: its gradient misses :func:`staleness` updates.
Each remedy is chosen per run (``hetpipe run --remedy``) and is exactly a no-op at ``Nm = 1``:

- ``none``: the delayed gradient is applied as it is (PipeDream, HetPipe);
- ``predict``: weight prediction (SpecTrain, Chen et al. 2018; XPipe, Guan et al. 2019;
  PipeOptim): the forward of minibatch ``p`` runs on the weights predicted ``s`` updates
  ahead by the optimizer's own rule, ``w_hat = w - s * lr * v`` (``v``: SGD's momentum
  buffer, the last gradient for plain SGD), and its backward on the same ``w_hat`` (stashed);
  :func:`predict_steps` is ``s``: the local staleness and, with several VWs under WSP, the
  other VWs' updates not pulled yet (:func:`foreign_staleness`); :func:`predict_scale` is
  the factor ``s * lr``;
- ``pipemare``: PipeMare's learning-rate rescheduling (Yang et al., MLSys 2021, T1): each
  stage's step size is ``lr * tau ** -(1 - min(1, k / K))`` at update ``k``, i.e. divided by
  the stage's delay ``tau`` at the start and back to ``lr`` after ``K`` warm-up updates
  (:func:`pipemare_lr`). Its discrepancy correction (T2) has nothing to correct here: weight
  stashing already gives the backward the forward's weights.

Example:
    >>> [staleness(p, 3) for p in range(1, 6)]
    [0, 1, 2, 2, 2]
    >>> [predict_steps(p, 3) for p in range(1, 6)]
    [0, 0, 0, 2, 2]
    >>> pipemare_lr(0.1, 0, delay=4, warmup=8), pipemare_lr(0.1, 8, delay=4, warmup=8)
    (0.025, 0.1)
"""

from __future__ import annotations

from planner.wsp import local_version, required_global_clock

__all__ = [
    "REMEDIES",
    "check_remedy",
    "foreign_staleness",
    "pipemare_lr",
    "predict_scale",
    "predict_steps",
    "remedies_for",
    "remedy_weight_copies",
    "stage_delay",
    "staleness",
]

REMEDIES = ("none", "predict", "pipemare")
"""Every remedy a run may choose (``none``: the default, no compensation)."""

COVERS_FOREIGN = frozenset({"predict"})
"""Remedies that also compensate the other VWs' updates a gradient misses (``predict``
extrapolates over the whole delay, :func:`predict_steps`); the others act on the local
delay only (PipeMare's rescheduling follows the stage's own delay)."""


def remedies_for(optimizer: str) -> tuple[str, ...]:
    """The remedies of :data:`REMEDIES` a run with ``optimizer`` (``sgd``, ``momentum``,
    ``adam``) can apply: all but ``predict`` with Adam (the prediction follows SGD's velocity;
    the runtime refuses it).

    >>> remedies_for("momentum"), remedies_for("adam")
    (('none', 'predict', 'pipemare'), ('none', 'pipemare'))
    """
    return tuple(r for r in REMEDIES if not (optimizer == "adam" and r == "predict"))


def check_remedy(name: str) -> str:
    """``name`` if it is a remedy of :data:`REMEDIES`.

    Raises:
        ValueError: an unknown remedy (the message lists the known ones).
    """
    if name not in REMEDIES:
        raise ValueError(f"remedy {name!r} is unknown: use one of {', '.join(REMEDIES)}")
    return name


def staleness(mb: int, nm: int) -> int:
    """Updates applied between the forward of minibatch ``mb`` and its own update.

    Its weights hold ``local_version(mb, nm)`` updates and its update follows ``mb - 1``:
    ``min(mb - 1, nm - 1)``, the same on every stage (weight stashing, 1F1B admission).
    """
    return mb - 1 - local_version(mb, nm)


def stage_delay(nm: int) -> int:
    """The steady-state delay ``tau`` of every stage (PipeMare's ``tau_i``): ``nm - 1``."""
    return staleness(nm, nm)


def foreign_staleness(mb: int, nm: int, D: int) -> int:
    """Updates of each *other* VW that minibatch ``mb``'s weights miss under WSP.

    Its weights hold every VW's waves ``0 .. G - 1`` (``G``:
    :func:`planner.wsp.required_global_clock`, what a pull at exactly that clock gives) and its
    update lands after the other VWs' minibatches ``1 .. mb - 1``: ``mb - 1 - G * nm``. An
    upper bound when a pull returns a newer clock (possible at ``D > 0`` only).

    Example:
        >>> [foreign_staleness(p, 3, 0) for p in range(1, 10)]
        [0, 1, 2, 3, 4, 2, 3, 4, 2]
        >>> [foreign_staleness(p, 1, 0) for p in range(1, 5)]
        [0, 0, 0, 0]
    """
    return mb - 1 - required_global_clock(mb, nm, D) * nm


def predict_steps(mb: int, nm: int, vws: int = 1, D: int = 0) -> int:
    """Updates ahead the forward of minibatch ``mb`` predicts its weights (``predict``).

    :func:`staleness` plus, with ``vws`` VWs under WSP, ``vws - 1`` times
    :func:`foreign_staleness` (every VW moves the global weights about as fast as this one:
    all the updates its gradient misses, counted in its own steps); ``0`` on the initial
    weights (version 0), which have no velocity to extrapolate with (the first ``nm``
    minibatches run on ``w0`` as without remedy); ``0`` at ``nm = 1``, where the master
    itself serves the forward (no copy is kept: the foreign delay there is ``D`` at most).

    Example:
        >>> [predict_steps(p, 3, vws=4) for p in range(4, 10)]
        [11, 14, 8, 11, 14, 8]
    """
    if nm == 1 or local_version(mb, nm) < 1:
        return 0
    return staleness(mb, nm) + (vws - 1) * foreign_staleness(mb, nm, D)


def predict_scale(mb: int, nm: int, lr: float, vws: int = 1, D: int = 0) -> float:
    """The factor ``s * lr`` of the prediction ``w_hat = w - s * lr * v`` for minibatch ``mb``
    (``s``: :func:`predict_steps`).

    Example:
        >>> predict_scale(5, 3, 0.5), predict_scale(5, 1, 0.5), predict_scale(5, 1, 0.5, vws=4)
        (1.0, 0.0, 0.0)
    """
    return predict_steps(mb, nm, vws, D) * lr


def pipemare_lr(lr: float, update: int, delay: int, warmup: int) -> float:
    """PipeMare's step size of a stage with delay ``delay`` at its ``update``-th update (0-based).

    ``lr * delay ** -(1 - min(1, update / warmup))``: ``lr / delay`` at the first update,
    ``lr`` from update ``warmup`` on; ``lr`` itself when ``delay <= 1`` (``Nm <= 2``) or
    ``warmup <= 0``.

    Example:
        >>> pipemare_lr(0.1, 4, delay=4, warmup=8)
        0.05
    """
    if delay <= 1 or warmup <= 0:
        return lr
    power = 1.0 - min(1.0, update / warmup)
    return lr * float(delay) ** -power


def remedy_weight_copies(remedy: str, nm: int, optimizer_factor: float) -> int:
    """Parameter-sized copies a stage keeps under ``remedy`` beyond the master, its gradient,
    the optimizer state and the ``Nm - 1`` stashed versions (what the planner's memory model
    must add).

    ``predict`` (:class:`runtime.stage.weights.VersionedWeights`): at ``Nm >= 2`` the version
    the newest minibatch runs on is a predicted copy instead of the master's storage (``Nm``
    versions beside the master, not ``Nm - 1``); without a momentum buffer (plain SGD,
    ``optimizer_factor != 1``) the last applied gradient is kept as the velocity, at every Nm.
    ``none`` and ``pipemare`` keep nothing more. The VWs do not change it: predicting over
    the other VWs' updates reuses the same copy, and ``Nm = 1`` predicts nothing.

    Example:
        >>> [remedy_weight_copies("predict", nm, 1.0) for nm in (1, 2, 4)]
        [0, 1, 1]
        >>> remedy_weight_copies("predict", 1, 0.0), remedy_weight_copies("predict", 3, 0.0)
        (1, 2)
        >>> remedy_weight_copies("pipemare", 4, 1.0)
        0
    """
    if check_remedy(remedy) != "predict":
        return 0
    return int(nm >= 2) + int(optimizer_factor != 1.0)
