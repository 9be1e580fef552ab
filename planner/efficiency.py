"""Statistical efficiency of a plan: progress per sample relative to sequential SGD, as pure rules.

A plan's *goodput* is its throughput times its statistical efficiency (Pollux, Qiao et al.,
OSDI'21): samples per second, discounted by how much less each sample moves the model than
it would under sequential SGD at the plan's minibatch ``b``. Two effects, multiplied:

- **Batch.** An update over ``B`` samples (AllReduce over ``n`` devices: ``B = n b``) makes
  less progress per sample than ``B / b`` sequential updates. With the gradient noise scale
  ``phi`` (McCandlish et al. 2018, "An Empirical Model of Large-Batch Training": ``B_simple
  = tr(Sigma) / |G|^2``), Pollux's efficiency relative to batch ``b`` is
  ``(phi + b) / (phi + B)`` (:func:`batch_efficiency`): 1 at ``B = b``, ``b / B`` when the
  gradient is noise-free (``phi = 0``: a bigger batch buys nothing), 1 when noise dominates.
- **Delay.** A gradient computed on weights that miss ``tau`` updates (HetPipe: ``Nm - 1``
  of its own VW, plus the other VWs' updates its wave has not pulled) moves the model as if
  its step were smaller: a delay of ``tau`` divides the stable step size by about
  ``1 + tau`` (gradient descent ``w' = w - lr L w_{-tau}`` on a quadratic of curvature ``L``
  is stable for ``lr L`` below 2 at ``tau = 0``, 1 at ``tau = 1``, 0.62 at ``tau = 2`` and
  about ``pi / (2 tau + 1)`` for large ``tau``), so progress per sample falls as
  ``1 / (1 + c tau)`` (:func:`delay_efficiency`), where ``c`` (about 1 near that bound, small
  far below it) says how close to it the user's step size runs. ``c`` is measured, per remedy
  (a remedy that removes most of the delay has a small ``c``): either on the user's own data
  (``--calibrate-efficiency``, :mod:`hetpipe.calibrate`: sequential vs delayed SGD) or from
  the defaults below, fitted to the figures of ``docs/convergence.md``.

The delay of a candidate (:func:`mean_delay`): ``Nm - 1`` local updates, plus, with ``n`` VWs
under WSP (threshold ``D``), the other VWs' updates of the wave in progress and, on average,
half of the ``D`` waves a VW may run ahead: ``(n - 1) Nm (1 + D / 2)`` foreign updates.
PipeMare acts on the local delay only, so ``1 / (1 + c_remedy tau_local + c_none
tau_foreign)``; weight prediction extrapolates over the whole delay, the other VWs' updates
included (:data:`planner.staleness.COVERS_FOREIGN`), so ``1 / (1 + c_predict (tau_local +
tau_foreign))``. AllReduce has no delay.

Limits: ``phi`` grows during training (McCandlish); the model takes one value. Pollux assumes
the learning rate is scaled with the batch (AdaScale); without it a big batch does worse. The
delay penalty is fitted on short runs of small models; a run whose step size is past the
delayed-SGD bound diverges, which no finite factor describes.

Example:
    >>> e = EfficiencyInputs(noise_scale=64.0, delay_cost={"none": 0.5}, source="example")
    >>> efficiency(Setting(batch=32, base_batch=32), e)
    1.0
    >>> round(efficiency(Setting(batch=128, base_batch=32), e), 3)
    0.5
    >>> efficiency(Setting(batch=32, base_batch=32, local_delay=2.0), e)
    0.5
    >>> p = EfficiencyInputs(64.0, {"none": 0.5, "predict": 0.1}, "example")
    >>> round(efficiency(Setting(32, 32, local_delay=2.0, foreign_delay=3.0, remedy="predict"), p), 3)
    0.667
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from planner.staleness import COVERS_FOREIGN, remedies_for

__all__ = [
    "DEFAULT_NOISE_SCALE",
    "MEASURED_TO_TARGET",
    "EfficiencyInputs",
    "Setting",
    "batch_efficiency",
    "default_inputs",
    "delay_efficiency",
    "efficiency",
    "fit_delay_cost",
    "mean_delay",
    "simple_noise_scale",
]

DEFAULT_NOISE_SCALE = 218.0
"""Gradient noise scale ``phi`` (samples) when no data is given: the built-in ``mlp`` on
scikit-learn's digits at its initial weights (``hetpipe plan --model mlp --objective time
--calibrate-efficiency builtin``, batch 32 and 128: 217 with ``--optimizer momentum``, 220
with ``sgd``; 2026-11-27). Another model's differs (McCandlish et al. report tens to millions,
growing as training goes on): calibrate on your data (``--calibrate-efficiency``)."""

MEASURED_TO_TARGET: Mapping[str, Mapping[str, Sequence[tuple[int, int]]]] = {
    "momentum": {
        "none": ((1, 12902), (2, 20813)),
        "predict": ((1, 8141), (2, 11443)),
        "pipemare": ((1, 12902), (2, 22886)),
    },
    "sgd": {
        "none": ((1, 13517), (2, 14976), (3, 18586)),
        "predict": ((1, 13517), (2, 15360), (3, 17050)),
        "pipemare": ((1, 13517), (2, 15667), (3, 20198)),
    },
}
"""Samples to 90 % test accuracy at delay ``tau`` (``Nm - 1``), per optimizer and remedy:
``docs/convergence.md``, "Staleness remedies" (digits + mlp, batch 32, 5 seeds; momentum 0.9
lr 0.02, sequential 7,219; plain SGD lr 0.1, sequential 11,520). Momentum at Nm 4 is left out:
most seeds never reached 90 % (a censored count)."""

SEQUENTIAL_TO_TARGET = {"momentum": 7219, "sgd": 11520}
"""Samples sequential SGD needed in the runs of :data:`MEASURED_TO_TARGET`."""


@dataclass(frozen=True)
class EfficiencyInputs:
    """What the efficiency model needs to know about the training job.

    Attributes:
        noise_scale: gradient noise scale ``phi`` (samples; ``B_simple`` of McCandlish et al.).
        delay_cost: ``c`` of :func:`delay_efficiency` per remedy (``none``, ``predict``,
            ``pipemare``); a remedy missing here is not a candidate.
        source: where the values come from (shown in the table and recorded in the plan).
        calibration: how a calibration trained (``optimizer``, ``lr``, ``momentum`` or
            ``betas`` and ``eps``, ``weight_decay``, ``seed``, ``lr_mode`` tuned or fixed,
            ``lr_grid``, ``lr_of`` each setting); empty for the defaults.
    """

    noise_scale: float
    delay_cost: Mapping[str, float] = field(default_factory=dict)
    source: str = ""
    calibration: Mapping[str, object] = field(default_factory=dict)

    def to_dict(self) -> dict[str, object]:
        """Plain data for the plan file."""
        return {
            "noise_scale": self.noise_scale,
            "delay_cost": dict(self.delay_cost),
            "source": self.source,
            **({"calibration": dict(self.calibration)} if self.calibration else {}),
        }


@dataclass(frozen=True)
class Setting:
    """What a candidate plan does to the optimisation.

    Attributes:
        batch: samples per update of the model (AllReduce: every device's minibatch).
        base_batch: the plan's minibatch ``b``, the batch of the sequential SGD compared with.
        local_delay: updates of its own VW a gradient's weights miss (``Nm - 1``).
        foreign_delay: mean updates of the other VWs they miss (:func:`mean_delay`).
        remedy: staleness remedy (``none``, ``predict``, ``pipemare``), on the local delay.
    """

    batch: int
    base_batch: int
    local_delay: float = 0.0
    foreign_delay: float = 0.0
    remedy: str = "none"


def batch_efficiency(batch: int, base_batch: int, noise_scale: float) -> float:
    """Pollux's progress per sample at ``batch`` relative to ``base_batch``: ``(phi + b0) /
    (phi + B)``.

    Example:
        >>> batch_efficiency(32, 32, 100.0), batch_efficiency(64, 32, 0.0)
        (1.0, 0.5)
    """
    return (noise_scale + base_batch) / (noise_scale + batch)


def delay_efficiency(delay: float, cost: float) -> float:
    """Progress per sample of gradients ``delay`` updates stale: ``1 / (1 + c tau)``.

    Example:
        >>> delay_efficiency(0.0, 0.9), delay_efficiency(3.0, 1.0)
        (1.0, 0.25)
    """
    return 1.0 / (1.0 + cost * delay)


def mean_delay(nm: int, n_vws: int, D: int) -> tuple[float, float]:
    """Mean updates missing from a gradient's weights under WSP, ``(local, foreign)`` (the
    module docstring).

    Example:
        >>> mean_delay(1, 1, 0), mean_delay(3, 1, 4), mean_delay(2, 2, 0), mean_delay(2, 2, 2)
        ((0.0, 0.0), (2.0, 0.0), (1.0, 2.0), (1.0, 4.0))
    """
    foreign = (n_vws - 1) * nm * (1.0 + D / 2.0) if n_vws > 1 else 0.0
    return float(nm - 1), foreign


def efficiency(setting: Setting, inputs: EfficiencyInputs) -> float:
    """Progress per sample of ``setting`` relative to sequential SGD at its base batch (in
    ``(0, 1]``).

    Raises:
        KeyError: no delay cost for the setting's remedy (only when it has a delay).
    """
    e = batch_efficiency(setting.batch, setting.base_batch, inputs.noise_scale)
    slow = 0.0
    if setting.local_delay > 0:
        slow += inputs.delay_cost[setting.remedy] * setting.local_delay
    if setting.foreign_delay > 0:
        covered = setting.remedy in COVERS_FOREIGN
        slow += inputs.delay_cost[setting.remedy if covered else "none"] * setting.foreign_delay
    return e * delay_efficiency(slow, 1.0)


def fit_delay_cost(sequential: float, delayed: Sequence[tuple[float, float]]) -> float:
    """Least-squares ``c`` of ``samples(tau) / samples(0) = 1 + c tau`` through the origin.

    Args:
        sequential: samples sequential SGD needs to the target.
        delayed: ``(tau, samples)`` pairs, ``tau > 0``.

    Example:
        >>> fit_delay_cost(100.0, [(1.0, 150.0), (2.0, 200.0)])
        0.5
    """
    num = sum(tau * (s / sequential - 1.0) for tau, s in delayed)
    den = sum(tau * tau for tau, _ in delayed)
    return max(0.0, num / den) if den > 0 else 0.0


def default_inputs(optimizer: str) -> EfficiencyInputs:
    """The defaults for a plan's ``--optimizer`` (``sgd``, ``momentum``, ``adam``): delay costs
    fitted to :data:`MEASURED_TO_TARGET` (``adam``: momentum's, without ``predict``, which the
    runtime refuses with Adam) and :data:`DEFAULT_NOISE_SCALE`."""
    kind = "sgd" if optimizer == "sgd" else "momentum"
    label = "plain SGD" if kind == "sgd" else "momentum SGD"
    costs = {
        remedy: round(fit_delay_cost(SEQUENTIAL_TO_TARGET[kind], points), 3)
        for remedy, points in MEASURED_TO_TARGET[kind].items()
        if remedy in remedies_for(optimizer)
    }
    return EfficiencyInputs(
        DEFAULT_NOISE_SCALE,
        costs,
        f"default (no data): phi of mlp/digits, delay costs of docs/convergence.md ({label})",
    )


def simple_noise_scale(small: int, big: int, sq_small: float, sq_big: float) -> float:
    """McCandlish et al.'s ``B_simple = tr(Sigma) / |G|^2`` from the mean squared norms of
    minibatch gradients at two batch sizes (their Appendix A.1): ``E|g_B|^2 = |G|^2 +
    tr(Sigma) / B``, solved for both unknowns. ``inf`` when the estimate of ``|G|^2`` is not
    positive (noise dominates at these sizes), ``0`` when the noise estimate is not.

    Example:
        >>> round(simple_noise_scale(10, 40, sq_small=1.0 + 50 / 10, sq_big=1.0 + 50 / 40), 6)
        50.0
    """
    grad_sq = (big * sq_big - small * sq_small) / (big - small)
    trace = (sq_small - sq_big) / (1.0 / small - 1.0 / big)
    if grad_sq <= 0:
        return float("inf")
    return max(0.0, trace / grad_sq)
