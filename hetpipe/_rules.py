"""The synchronisation-rule options of ``hetpipe plan``, ``run`` and ``simulate``, generated
from the rule registry (:mod:`planner.rules`): ``--sync``'s help and one ``--<param>`` per
rule parameter, with the parameter's help and range; a rule's option given with another rule
is refused, naming the rule it belongs to.

A command takes them by being wrapped in :class:`with_rule_options` and declaring
``rule_values`` (the values given, by parameter name; ``None``: not given).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from typing import Annotated, Any

import typer

from planner.plan import Plan
from planner.rules import BUILTIN, RuleParam, get_rule, rules
from planner.sync import with_rule
from profiler.errors import ConfigError
from runtime.options import check_number

__all__ = ["RuleValues", "apply_rule", "rule_params", "sync_help", "with_rule_options"]

RuleValues = Mapping[str, float | None]
"""The rule options as given on the command line, by parameter name (``None``: not given)."""

_PREFIX = "rule_"
"""The Python name of a generated option: ``rule_<param>`` (never clashes with a command's)."""


def sync_help() -> str:
    """``--sync``'s help: every built-in rule ``--sync`` takes, as its registry entry summarises
    it (read when the command module is imported, so without ``$HETPIPE_RULES`` plug-ins: an
    unknown ``--sync`` names every rule)."""
    return " | ".join(r.summary for r in BUILTIN.values() if r.selectable)


def _params() -> dict[str, tuple[RuleParam, tuple[str, ...]]]:
    """Every rule parameter by name (the first rule's declaration), with the rules taking it.
    A broken ``$HETPIPE_RULES`` gives the built-in ones here: typer asks before the command
    runs, and the command says what is wrong in one line (:func:`rule_params`)."""
    try:
        known = rules()
    except ConfigError:
        known = BUILTIN
    out: dict[str, tuple[RuleParam, tuple[str, ...]]] = {}
    for rule in known.values():
        for p in rule.params:
            first, owners = out.get(p.name, (p, ()))
            out[p.name] = (first, (*owners, rule.name))
    return out


def _option(p: RuleParam, owners: tuple[str, ...]) -> inspect.Parameter:
    """The typer option of parameter ``p``: ``--<name>``, an int for a whole one."""
    kind = int if p.whole else float
    default = f"{p.default:g}"
    help_ = f"--sync {' / '.join(owners)}: {p.help} (default {default})"
    return inspect.Parameter(
        _PREFIX + p.name,
        inspect.Parameter.KEYWORD_ONLY,
        default=None,
        annotation=Annotated[kind | None, typer.Option(f"--{p.name}", help=help_)],
    )


class with_rule_options:  # a decorator: named like one
    """A command taking every rule parameter of the registry as an option.

    Typer reads a command's options from its signature; this one's is the command's (without
    ``rule_values``) plus one keyword option per rule parameter, computed when typer asks
    (so a rule of ``$HETPIPE_RULES`` gets its flags too). Calling it passes those values to
    the command as ``rule_values``.
    """

    def __init__(self, command: Callable[..., None]) -> None:
        self._command = command
        self.__name__ = getattr(command, "__name__", "command")
        self.__qualname__ = getattr(command, "__qualname__", self.__name__)
        self.__doc__ = command.__doc__
        self.__module__ = command.__module__

    @property
    def __signature__(self) -> inspect.Signature:
        """The command's options and the rule parameters' (see the class doc)."""
        own = inspect.signature(self._command, eval_str=True)
        kept = [p for p in own.parameters.values() if p.name != "rule_values"]
        extra = [_option(p, owners) for p, owners in _params().values()]
        return own.replace(parameters=[*kept, *extra])

    @property
    def __annotations__(self) -> dict[str, Any]:  # type: ignore[override]
        """The annotations of :attr:`__signature__` (typer reads both)."""
        sig = self.__signature__
        return {p.name: p.annotation for p in sig.parameters.values()}

    @property
    def __globals__(self) -> dict[str, Any]:
        """The command's module globals (for annotations typer resolves)."""
        return inspect.unwrap(self._command).__globals__  # type: ignore[no-any-return]

    def __call__(self, *args: Any, **kwargs: Any) -> None:
        values = {k[len(_PREFIX) :]: kwargs.pop(k) for k in list(kwargs) if k.startswith(_PREFIX)}
        self._command(*args, rule_values=values, **kwargs)


def rule_params(sync: str, given: RuleValues) -> dict[str, float]:
    """The rule parameters given on the command line, checked against rule ``sync``'s
    declaration (:class:`planner.rules.RuleParam`).

    Raises:
        ConfigError: an unknown rule, a parameter of another rule, or a value out of range.
    """
    known = rules()
    selectable = [name for name, r in known.items() if r.selectable]
    if sync not in selectable:
        raise ConfigError(f"--sync {sync!r}: use one of {', '.join(selectable)}")
    mine = {p.name: p for p in known[sync].params}
    declared = _params()
    for name, value in given.items():
        if value is not None and name not in mine:
            owners = " or ".join(declared[name][1]) if name in declared else "no rule"
            raise ConfigError(f"--{name} applies to --sync {owners}, not --sync {sync}")
    for name, value in given.items():
        if value is not None:
            check_number(f"--{name}", value, mine[name].range)
    return {k: float(v) for k, v in given.items() if v is not None}


def apply_rule(plan: Plan, sync: str | None, params: dict[str, float]) -> Plan:
    """``plan`` synchronised by rule ``sync`` through its shards (:func:`planner.sync.with_rule`);
    unchanged for ``None`` (the plan's own rule) or a rule the launcher lays out otherwise (the
    AllReduce baseline's plan is made by its own planner)."""
    if sync is None or get_rule(sync).layout != "shards":
        return plan
    return with_rule(plan, sync, params)
