"""``hetpipe plan --objective time``: plan the candidates, rank them, show the table."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from functools import partial
from typing import TYPE_CHECKING

from rich.markup import escape
from rich.table import Table

from hetpipe._common import console
from planner.plan import Plan
from planner.rules import layout
from profiler.errors import ConfigError, shown

if TYPE_CHECKING:
    from rich.console import Console

    from planner.auto_search import Candidate
    from planner.efficiency import EfficiencyInputs
    from planner.objective import Ranked
    from planner.planner import PlanOptions
    from runtime.config import OptimizerConfig

__all__ = [
    "D_CANDIDATES",
    "NM_CANDIDATES",
    "Calibration",
    "choose_for_time",
    "d_values",
    "efficiency_inputs",
    "nm_values",
    "other_allocations",
    "render_objective",
    "with_objective",
]

NM_CANDIDATES = 8
"""Largest Nm ``--objective time`` compares (beyond it the staleness cost only grows)."""

AUTO_ALLOCATIONS = 3
"""Most allocations of policy ``auto``'s table that ``--objective time`` compares."""

D_CANDIDATES = (0, 1, 2)
"""The WSP thresholds ``--objective time`` compares when neither ``-D`` nor ``--d-values`` is
given: ``D = 0`` (a stage's update waits for its pull), ``1`` (it no longer waits: the most
throughput ``D`` buys when VWs run at one pace) and ``2`` (room for VWs of uneven pace); each
step adds ``(n - 1) Nm / 2`` foreign updates of delay (:func:`planner.efficiency.mean_delay`)."""


def d_values(text: str, staleness: int | None, objective: str) -> tuple[int, ...]:
    """The WSP thresholds ``--objective time`` compares: ``--d-values`` (``text``, whole
    numbers >= 0 separated by commas or spaces), else ``-D`` alone when given (``staleness``),
    else :data:`D_CANDIDATES`.

    Example:
        >>> d_values("", None, "time"), d_values("", 3, "time"), d_values("2, 0 2", None, "time")
        ((0, 1, 2), (3,), (0, 2))

    Raises:
        ConfigError: a value that is not a whole number >= 0, ``--d-values`` with ``-D`` or
            without ``--objective time`` (one line naming the flag, the value and the fix).
    """
    given = text.replace(",", " ").split()
    if not given:
        return D_CANDIDATES if staleness is None else (staleness,)
    flag = f"--d-values {shown(text, 40)}"
    if objective != "time":
        raise ConfigError(f"{flag} sets the D values --objective time compares; add "
                          "--objective time, or drop --d-values")  # fmt: skip
    if staleness is not None:
        raise ConfigError(f"{flag} and -D {staleness} both set D; give one of them")
    bad = next((v for v in given if not v.isdecimal()), None)
    if bad is not None:
        raise ConfigError(
            f"{flag}: {shown(bad, 20)} is not a whole number >= 0; give thresholds such as 0,1,2"
        )
    return tuple(sorted({int(v) for v in given}))


def nm_values(plan: Plan, cap: int | None = None) -> list[int]:
    """``1 .. min(smallest nm_max, NM_CANDIDATES, cap)``, and the throughput plan's own Nm
    (``cap``: the user's ``--nm``).

    Example:
        >>> from types import SimpleNamespace as NS
        >>> plan = NS(nm=3, virtual_workers=[NS(nm_max=12), NS(nm_max=5)])
        >>> nm_values(plan), nm_values(plan, cap=2)
        ([1, 2, 3, 4, 5], [1, 2])
    """
    top = min((vw.nm_max for vw in plan.virtual_workers), default=1)
    top = min(top, NM_CANDIDATES, cap or NM_CANDIDATES)
    return sorted({*range(1, max(1, top) + 1), min(plan.nm, cap or plan.nm)})


@dataclass(frozen=True)
class Calibration:
    """``hetpipe plan``'s calibration options (:mod:`hetpipe.calibrate`).

    Attributes:
        data: ``--calibrate-efficiency`` (``builtin``, ``synthetic`` or ``pkg.mod:factory``;
            ``None``: the defaults, no calibration).
        lr: ``--lr``, the run's learning rate (``None``: the run's default).
        momentum: ``--momentum`` (``None``: 0.9 for ``--optimizer momentum``, 0 for ``sgd``;
            ``adam`` has none).
        lr_mode: ``--calibrate-lr``: ``tuned`` (each setting at its best of a grid below
            ``lr``) or ``fixed`` (every setting at ``lr``).
        seed: ``--seed``, the run's (``None``: the run's default, 0): the model's initial
            weights, a ``--data`` factory's ``seed=`` and the torch RNG (dropout).
        weight_decay: ``--weight-decay``, the run's (``None``: the run's default, 0).
    """

    data: str | None = None
    lr: float | None = None
    momentum: float | None = None
    lr_mode: str = "tuned"
    seed: int | None = None
    weight_decay: float | None = None

    def check(self, optimizer: str) -> None:
        """Refuse calibration options without calibration, and momentum plain SGD or Adam
        cannot have.

        Raises:
            ConfigError: one line naming the flag, the value and the fix.
        """
        mode = None if self.lr_mode == "tuned" else self.lr_mode
        given = {"--lr": self.lr, "--momentum": self.momentum, "--calibrate-lr": mode,
                 "--seed": self.seed, "--weight-decay": self.weight_decay}  # fmt: skip
        for flag, value in given.items():
            if value is not None and not self.data:
                raise ConfigError(
                    f"{flag} {shown(value)} sets how the efficiency calibration trains; add "
                    f"--calibrate-efficiency DATA, or drop {flag}"
                )
        if self.momentum and optimizer == "sgd":
            raise ConfigError(
                f"--momentum {self.momentum:g} with --optimizer sgd: plain SGD keeps no velocity; "
                "give --optimizer momentum, or drop --momentum"
            )
        if self.momentum is not None and optimizer == "adam":
            raise ConfigError(
                f"--momentum {self.momentum:g} with --optimizer adam: Adam's moments follow its "
                "betas, not SGD's momentum; drop --momentum, or give --optimizer momentum"
            )

    def optimizer(self, optimizer: str) -> OptimizerConfig:
        """The run's optimizer for ``hetpipe plan --optimizer`` (``sgd``, ``momentum``,
        ``adam``): the stages' settings (:class:`runtime.config.OptimizerConfig`, the run's
        defaults where no flag sets them) at :attr:`lr` with :attr:`momentum` and
        :attr:`weight_decay`.

        Example:
            >>> Calibration("builtin", lr=0.02).optimizer("momentum").momentum
            0.9
            >>> adam = Calibration("builtin").optimizer("adam")
            >>> adam.name, adam.lr, adam.momentum, adam.betas
            ('adam', 0.05, 0.0, (0.9, 0.999))
        """
        from runtime.config import OptimizerConfig
        from runtime.options import OPTIONS

        default = 0.9 if optimizer == "momentum" else 0.0
        decay = OPTIONS["weight_decay"].default if self.weight_decay is None else self.weight_decay
        return OptimizerConfig(
            "adam" if optimizer == "adam" else "sgd",
            lr=OPTIONS["lr"].default if self.lr is None else self.lr,
            momentum=default if self.momentum is None else self.momentum,
            weight_decay=decay,
        )


def efficiency_inputs(
    calibration: Calibration,
    model: str | None,
    batch: int,
    optimizer: str,
    progress: Callable[[str], None] | None = None,
) -> EfficiencyInputs:
    """The efficiency model's inputs: measured on ``calibration.data`` (``builtin``: the model's
    own data, ``synthetic`` or ``pkg.mod:factory``; :mod:`hetpipe.calibrate`, told
    ``progress``), else the defaults for ``optimizer``
    (:func:`planner.efficiency.default_inputs`).

    Raises:
        ConfigError: calibration without ``--model``, or data it cannot use (one line).
    """
    from planner.efficiency import default_inputs

    data = calibration.data
    if not data:
        return default_inputs(optimizer)
    if model is None:  # hetpipe plan refuses it before planning
        raise ConfigError("--calibrate-efficiency needs --model; give it")
    from hetpipe.calibrate import Recipe, calibrate, seeded_model
    from runtime.data_source import named_data, run_data
    from runtime.options import OPTIONS

    seed = OPTIONS["seed"].default if calibration.seed is None else calibration.seed
    spec = seeded_model(model, batch, seed)
    given = named_data("" if data == "builtin" else data, model, batch, seed)
    train = run_data(given, model, spec, batch, spec.loss).train
    recipe = Recipe(calibration.optimizer(optimizer), calibration.lr_mode == "tuned", seed=seed)
    return calibrate(train, spec, batch, recipe, progress)


def choose_for_time(
    fastest: Plan,
    make: Callable[..., Plan],
    options: PlanOptions,
    rule: Callable[[Plan], Plan],
    allreduce: Callable[[], Plan],
    inputs: EfficiencyInputs,
    target_samples: float,
    others: Sequence[tuple[str, int]] = (),
    nm_cap: int | None = None,
    d_candidates: Sequence[int] = (0,),
) -> tuple[Plan, list[Ranked]]:
    """The plan ``--objective time`` picks (:func:`planner.objective.plan_for_time`) among
    ``fastest``'s allocation at every Nm of :func:`nm_values`, remedy and ``D``, and AllReduce.

    Args:
        fastest: the throughput plan (its policy and VW count are kept).
        make: :func:`planner.planner.make_plan` with the cluster, profiles and the user's
            options bound; called with ``policy``, ``nm``, ``num_vws``, ``options`` and ``D``.
        options: the user's planner options (Nm is then exact and the remedy's memory counted).
        rule: applies the user's synchronisation rule to a plan.
        allreduce: the AllReduce baseline's plan.
        inputs: the efficiency model's inputs (:func:`efficiency_inputs`).
        target_samples: samples sequential SGD needs to the target (0: relative times).
        others: more allocations to compare, ``(policy, VW count)`` (:func:`other_allocations`).
        nm_cap: the user's ``--nm``: no candidate has more in flight.
        d_candidates: the WSP thresholds compared (:func:`d_values`).
    """
    from planner.objective import plan_for_time

    policy, vws = fastest.policy.removeprefix("auto:"), len(fastest.virtual_workers)

    def replan(policy: str, vws: int, nm: int, memory: str, D: int) -> Plan:  # exactly Nm nm
        opts = replace(options, nm_choice="max", remedy=memory)
        return rule(make(policy=policy, nm=nm, num_vws=vws, options=opts, D=D))

    allocations = [(partial(replan, policy, vws), nm_values(fastest, nm_cap))]
    top = min(NM_CANDIDATES, nm_cap or NM_CANDIDATES)
    for other in others:
        if other != (policy, vws):
            allocations.append((partial(replan, *other), list(range(1, top + 1))))
    return plan_for_time(allocations, allreduce, inputs, target_samples, d_candidates)


def other_allocations(
    rows: Sequence[Candidate], vws_given: bool, limit: int = AUTO_ALLOCATIONS
) -> list[tuple[str, int]]:
    """The allocations ``--objective time`` compares beside the throughput plan's: those
    policy ``auto`` solved (``rows``, best prediction first, as ``(policy, VW count)``, at most
    ``limit``) and, unless the user gave ``--vws``, one VW of every device (``ed``, 1: no other
    VW's updates to miss).

    Example:
        >>> from planner.auto_search import Candidate
        >>> rows = [Candidate("np", ("VV", "RR"), 9.0, 5.0, 2, 0.1, "planned"),
        ...         Candidate("hd", ("VR",) * 2, 9.0, 7.0, 2, 0.1, "chosen"),
        ...         Candidate("ed", ("V", "R", "G", "Q"), 9.0, 0.0, 0, 0.0, "cannot win")]
        >>> other_allocations(rows, vws_given=False)
        [('hd', 2), ('np', 2), ('ed', 1)]
        >>> other_allocations(rows, vws_given=True, limit=1)
        [('hd', 2)]
    """
    solved = sorted(
        (r for r in rows if r.status in ("planned", "chosen")), key=lambda r: -r.throughput
    )
    out = list(dict.fromkeys((r.policy, len(r.signatures)) for r in solved))[:limit]
    if not vws_given and ("ed", 1) not in out:
        out.append(("ed", 1))
    return out


def _time(r: Ranked) -> str:
    return "-" if math.isinf(r.relative_time) else f"x{r.relative_time:.2f}"


def render_objective(
    ranked: list[Ranked], inputs: EfficiencyInputs, target: float, out: Console = console
) -> None:
    """The candidates by predicted time to target (both factors shown), the pick marked; the
    efficiency inputs' source; AllReduce's win or the remedy to run with, in one line (on
    ``out``: stderr under ``--json``)."""
    title = "objective time: candidates by predicted time to target (throughput x efficiency)"
    table = Table(title=title)
    cols = ["candidate", "D", "samples/s", "efficiency", "goodput/s", "time vs best"]
    for col in [*cols, *(["seconds"] if target > 0 else []), ""]:
        table.add_column(col, justify="left" if col == "candidate" else "right", no_wrap=True,
                         min_width=len(col) if col == "D" else None)  # fmt: skip
    for k, r in enumerate(ranked):
        table.add_row(
            escape(r.choice.label),
            "-" if layout(r.choice.sync) == "ddp" else str(r.choice.D),
            f"{r.choice.throughput:.1f}",
            f"{r.efficiency:.3f}",
            f"{r.goodput:.1f}",
            _time(r),
            *([f"{r.seconds:.1f}" if r.seconds else "-"] if target > 0 else []),
            "chosen" if k == 0 else "",
            style="bold" if k == 0 else None,
        )
    out.print(table)
    costs = ", ".join(f"{k} {v:g}" for k, v in inputs.delay_cost.items())
    out.print(
        f"[dim]efficiency inputs: noise scale {inputs.noise_scale:g} samples, delay cost per "
        f"update {costs}; {escape(inputs.source)}[/]"
    )
    best = ranked[0].choice
    if layout(best.sync) == "ddp":
        out.print(
            f"AllReduce on {best.vws} devices is predicted faster to the target than every "
            "HetPipe plan: the plan is the AllReduce plan"
        )
    elif best.remedy != "none":
        out.print(f"run it with --remedy {best.remedy} (recorded in the plan)")


def with_objective(plan: Plan, objective: str, remedy: str) -> Plan:
    """The throughput plan with its objective recorded (``--objective throughput``)."""
    return replace(plan, objective={"objective": objective}, remedy=remedy)
