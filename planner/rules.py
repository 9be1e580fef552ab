"""The synchronisation rules' registry, planner side: one entry per rule declares everything
the planner, the simulator and the command line need to know of it (pure, no processes).

An entry (:class:`SyncRule`) names the rule, its parameters (:class:`RuleParam`: default,
:class:`planner.ranges.Range`, help; the CLI makes ``--<name>`` of each), its check against a
plan, how it treats ``D``, what each VW trains on, its wave player
(:mod:`planner.sim.waves`) and how the launcher lays it out. The process side is
:data:`runtime.sync.registry.PARTS`, keyed by the same names (a test checks they agree).

Adding a rule: its pure logic in ``planner/<rule>.py``, its process side in
``runtime/sync/<rule>.py``, and one line in :data:`BUILTIN` here and in
:data:`runtime.sync.registry.PARTS`. A rule outside this repository (a plug-in, or a test's
toy rule) lives in a module named by ``$HETPIPE_RULES`` (comma-separated module names) that
defines ``RULE`` (a :class:`SyncRule`) and ``PARTS`` (a
:class:`runtime.sync.registry.RuleParts`); started processes inherit the variable.

>>> get_rule("backup").defaults
(('backups', 1.0),)
>>> get_rule("easgd").label((("alpha", 0.1), ("tau", 4.0)), D=0)
'EASGD tau=4 alpha=0.1'
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Literal

from planner.backup import backup_delays, check_backups
from planner.easgd import check_easgd, waves_per_exchange
from planner.ranges import Range
from planner.sim.waves import Player, play_backup, play_easgd, play_wsp
from profiler.errors import ConfigError

__all__ = [
    "ALONE_RULE",
    "BUILTIN",
    "DEFAULT_RULE",
    "PLUGINS_ENV",
    "Layout",
    "RuleParam",
    "SyncParams",
    "SyncRule",
    "TimeDelays",
    "every_vw",
    "get_rule",
    "layout",
    "plugin_modules",
    "rules",
    "time_ranked",
]

SyncParams = tuple[tuple[str, float], ...]
"""A rule's parameters: sorted ``(name, value)`` pairs (frozen, hashable, pickles anywhere)."""

Layout = Literal["shards", "ddp", "alone"]
"""How the launcher lays a rule out: VW pipelines and parameter-server shards, one rank per
device of the AllReduce baseline, or one VW alone."""

TimeDelays = Callable[[Mapping[str, float], int, int], tuple[int, int]]
"""``(params, n_vws, D) -> (syncing, D)``, for ``--objective time``
(:func:`planner.objective.choice_of`): the VWs whose updates a wave sums and the threshold the
update delays are counted at (:func:`planner.efficiency.mean_delay`)."""

DEFAULT_RULE = "wsp"
"""The rule of a plan that names none, and of ``hetpipe plan`` and ``run`` planning on the fly:
HetPipe's own (the rule every other is compared with on whole waves)."""

ALONE_RULE = "local"
"""The rule one VW trains by alone (``hetpipe run --vw``, or one VW and no shards): nothing to
synchronise (:func:`planner.sync.effective_rule`)."""

PLUGINS_ENV = "HETPIPE_RULES"
"""The environment variable naming the modules of rules from outside the registry."""


@dataclass(frozen=True)
class RuleParam:
    """One parameter of a rule (``Plan.sync_params``; on the command line ``--<name>``).

    Attributes:
        name: its name in ``sync_params`` and its flag (``backups``: ``--backups``).
        default: its value when not given.
        help: one line for ``--help`` (the CLI prefixes ``--sync <rule>:``).
        range: the values it takes before the plan is known (the rule's ``check`` sees the
            plan).
        whole: a whole number (an ``int`` flag; a plan's value must be whole).
    """

    name: str
    default: float
    help: str
    range: Range
    whole: bool = False


def _no_check(params: Mapping[str, float], n_vws: int) -> None:
    """A rule whose parameters need nothing of the plan."""


def every_vw(params: Mapping[str, float], n_vws: int, D: int) -> tuple[int, int]:
    """A wave sums every VW's update, its delays bounded by the plan's ``D`` (:data:`TimeDelays`).

    >>> every_vw({}, 4, 2)
    (4, 2)
    """
    return n_vws, D


def _one_wave(params: Mapping[str, float]) -> int:
    """A rule whose shards' clock counts waves."""
    return 1


@dataclass(frozen=True)
class SyncRule:
    """One synchronisation rule as the planner, the simulator and the CLI see it.

    Attributes:
        name: what ``Plan.sync`` says (``wsp``).
        doc: one line for error messages.
        summary: its ``--sync`` help (``backup (synchronous SGD with --backups backup VWs)``).
        title: how a summary or a table names a run of it (``{D}`` and each parameter are
            filled in: ``backup b={backups}``).
        params: the parameters it takes.
        data: what each VW trains on: ``"shard"``, its own disjoint shard of the training
            split; ``"global"``, its slice of every global minibatch of the whole split
            (:func:`planner.sync.data_slice`): a rule that drops some VWs' work must.
        keeps_D: the plan's WSP threshold ``D`` applies (else the rule runs at ``D = 0``).
        evicts: a failed VW can leave its clock (``--on-failure continue`` / ``restart``).
        no_time_limit: why ``--time-limit`` is refused (empty: VWs agree on a stop wave).
        selectable: ``--sync`` takes it (``local`` is what one VW alone trains by).
        layout: how the launcher lays it out (:data:`Layout`; ``shards``: the VWs
            synchronise through parameter-server shards, :attr:`uses_shards`).
        drops: some VWs' pushes of a wave can be dropped (a summary counts them and shows
            the k-th push delays).
        check: ``(params, n_vws)``: raise ``ValueError`` when the plan cannot take them.
        play: its wave player for the simulator (``None``: not played on waves).
        waves_per_clock: ``(params) -> waves`` one tick of the shards' clock covers.
        time_delays: how ``--objective time`` counts its update delays (:data:`TimeDelays`);
            ``None``: no efficiency model, ``--objective time`` refuses it (the ``ddp``
            layout has no delay and is always ranked as the AllReduce baseline).
        simulated: the simulator's pipeline play (:mod:`planner.sim.simulator`) predicts its
            runs, so ``hetpipe run`` compares a run's stages with it.
    """

    name: str
    doc: str
    summary: str
    title: str
    params: tuple[RuleParam, ...] = ()
    data: Literal["shard", "global"] = "shard"
    keeps_D: bool = True
    evicts: bool = False
    no_time_limit: str = ""
    selectable: bool = True
    layout: Layout = "shards"
    drops: bool = False
    check: Callable[[Mapping[str, float], int], None] = _no_check
    play: Player | None = None
    waves_per_clock: Callable[[Mapping[str, float]], int] = _one_wave
    time_delays: TimeDelays | None = None
    simulated: bool = False

    @property
    def uses_shards(self) -> bool:
        """The VWs synchronise through parameter-server shards (the launcher starts them; the
        plan must place some)."""
        return self.layout == "shards"

    @property
    def defaults(self) -> SyncParams:
        """Every parameter with its default, sorted by name."""
        return tuple(sorted((p.name, p.default) for p in self.params))

    def label(self, params: SyncParams, D: int) -> str:
        """:attr:`title` filled in with ``D`` and ``params`` (whole ones as integers)."""
        whole = {p.name for p in self.params if p.whole}
        values = {k: int(v) if k in whole else float(v) for k, v in (*self.defaults, *params)}
        return self.title.format(D=D, **{k: f"{v:g}" for k, v in values.items()})


BUILTIN: Mapping[str, SyncRule] = MappingProxyType(
    {
        "wsp": SyncRule(
            "wsp",
            "Wave Synchronous Parallel through the shards (paper Sec. 5; threshold Plan.D)",
            "wsp (parameter servers, threshold D)",
            "WSP D={D}",
            evicts=True,
            play=play_wsp,
            time_delays=every_vw,
            simulated=True,
        ),
        "backup": SyncRule(
            "backup",
            "synchronous SGD with backup workers: a wave closes at the first VWs - backups "
            "pushes, the rest are dropped (planner.backup)",
            "backup (synchronous SGD with --backups backup VWs)",
            "backup b={backups}",
            params=(RuleParam("backups", 1.0, "VWs a wave does not wait for", Range(0), True),),
            data="global",  # the dropped pushes are a different random sample every epoch
            keeps_D=False,
            no_time_limit="a VW that skipped waves cannot agree on a stop wave yet",
            drops=True,
            check=check_backups,
            play=play_backup,
            time_delays=backup_delays,
        ),
        "easgd": SyncRule(
            "easgd",
            "elastic averaging: each VW its own weights, pulled towards the centre every tau "
            "waves with moving rate alpha (planner.easgd)",
            "easgd (elastic averaging every --tau waves, rate --alpha)",
            "EASGD tau={tau} alpha={alpha}",
            params=(
                RuleParam(
                    "alpha",
                    0.1,
                    "moving rate, VWs x alpha <= 1",
                    Range(0, 1, open_low=True, open_high=False),
                ),
                RuleParam("tau", 1.0, "waves between exchanges with the centre", Range(1), True),
            ),
            keeps_D=False,
            check=check_easgd,
            play=play_easgd,
            waves_per_clock=waves_per_exchange,
        ),
        "allreduce": SyncRule(
            "allreduce",
            "BSP data parallelism: gradients averaged over every VW after every minibatch",
            "allreduce (the DDP baseline)",
            "allreduce (BSP)",
            data="global",
            layout="ddp",
        ),
        "local": SyncRule(
            "local",
            "one VW alone: nothing to synchronise",
            "local (one VW alone)",
            "WSP D={D}",  # a summary of VWs trained one by one reads like WSP
            selectable=False,
            layout="alone",
            simulated=True,
        ),
    }
)
"""The rules of this repository, by name (one entry each)."""


def plugin_modules() -> tuple[str, ...]:
    """The module names in ``$HETPIPE_RULES`` (comma-separated; empty: none)."""
    return tuple(m.strip() for m in os.environ.get(PLUGINS_ENV, "").split(",") if m.strip())


def plugin(module: str, attr: str) -> object:
    """``module.attr`` of a rule plug-in named by ``$HETPIPE_RULES``.

    Raises:
        ConfigError: the module cannot be imported or lacks ``attr``.
    """
    try:
        mod = importlib.import_module(module)
    except ImportError as exc:
        raise ConfigError(
            f"{PLUGINS_ENV}: cannot import rule module {module!r} ({exc}); fix the name or "
            f"unset {PLUGINS_ENV}"
        ) from None
    if not hasattr(mod, attr):
        raise ConfigError(f"{PLUGINS_ENV}: rule module {module!r} defines no {attr}; add it")
    return getattr(mod, attr)


def rules(extra: tuple[str, ...] = ()) -> Mapping[str, SyncRule]:
    """Every rule by name: :data:`BUILTIN` and the plug-ins of ``$HETPIPE_RULES`` and
    ``extra`` (module names a process was given: :attr:`runtime.sync.rule.SyncSpec.plugins`).

    Raises:
        ConfigError: a plug-in that is not a :class:`SyncRule` or reuses a name.
    """
    out = dict(BUILTIN)
    for module in dict.fromkeys((*plugin_modules(), *extra)):
        rule = plugin(module, "RULE")
        if not isinstance(rule, SyncRule):
            raise ConfigError(f"{PLUGINS_ENV}: {module}.RULE is not a planner.rules.SyncRule")
        if rule.name in out:
            raise ConfigError(f"{PLUGINS_ENV}: {module}.RULE reuses the rule name {rule.name!r}")
        out[rule.name] = rule
    return MappingProxyType(out)


def get_rule(name: str, extra: tuple[str, ...] = ()) -> SyncRule:
    """The rule called ``name`` (``extra``: as :func:`rules`).

    Raises:
        ConfigError: no rule has that name (the known ones are listed).
    """
    known = rules(extra)
    if name not in known:
        raise ConfigError(
            f"synchronisation rule {str(name)[:40]!r} is unknown; use one of {', '.join(known)}"
        )
    return known[name]


def layout(name: str) -> Layout:
    """How the launcher lays rule ``name`` out (:attr:`SyncRule.layout`).

    Raises:
        ConfigError: no rule has that name.
    """
    return get_rule(name).layout


def time_ranked() -> tuple[str, ...]:
    """The rules ``--objective time`` ranks against the AllReduce baseline (those declaring
    :attr:`SyncRule.time_delays`; ``--sync`` takes them).

    >>> time_ranked()[:2]
    ('wsp', 'backup')
    """
    return tuple(r.name for r in rules().values() if r.selectable and r.time_delays is not None)
