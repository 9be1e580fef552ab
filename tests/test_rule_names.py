"""No rule is dispatched on by name outside its own modules (issue #26), read with ``ast``.

A rule is one vertical slice declared in one registry entry (:mod:`planner.rules`,
:mod:`runtime.sync.registry`): what the CLI, the simulator and the launcher must know of it is
a field of that entry (``layout``, ``time_delays``, ``simulated``, ...), so code elsewhere
never compares a rule name (``sync == "allreduce"``, ``rule in ("wsp", "local")``) and a new
rule declares everything once. Placement ``local`` and ``--baseline allreduce`` are not rules.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

from planner.rules import BUILTIN
from tests.conftest import REPO

RULE_NAMES = frozenset(BUILTIN)

# The rules' own modules: the registries, the rules' pure logic and their process side.
OWN = (
    "planner/rules.py",
    "planner/sync.py",
    "runtime/sync/",
    *(f"planner/{n}.py" for n in RULE_NAMES),
)

# Compared names that are not rules although they share a rule's name.
NOT_RULES = frozenset({"placement", "baseline"})


def _named(node: ast.expr) -> str:
    """The last name of ``x``, ``a.x`` or ``a.x()`` (empty for anything else)."""
    if isinstance(node, ast.Call):
        node = node.func
    if isinstance(node, ast.Attribute):
        return node.attr
    return node.id if isinstance(node, ast.Name) else ""


def _rule_literals(node: ast.expr) -> set[str]:
    """The rule names ``node`` spells: a string, or a tuple/list/set of strings."""
    items = node.elts if isinstance(node, ast.Tuple | ast.List | ast.Set) else [node]
    return {
        e.value
        for e in items
        if isinstance(e, ast.Constant) and isinstance(e.value, str) and e.value in RULE_NAMES
    }


def rule_comparisons(source: str) -> Iterator[tuple[int, str]]:
    """``(line, names)`` of every comparison of a rule-name literal in ``source``.

    >>> list(rule_comparisons('if plan.sync == "allreduce": pass'))
    [(1, 'allreduce')]
    >>> list(rule_comparisons('if plan.placement == "local": pass'))
    []
    """
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Compare):
            continue
        operands = [node.left, *node.comparators]
        if any(_named(o) in NOT_RULES for o in operands):
            continue
        names = set().union(*(_rule_literals(o) for o in operands))
        if names:
            yield node.lineno, ",".join(sorted(names))


def _modules() -> Iterator[Path]:
    for package in ("hetpipe", "planner", "runtime"):
        for path in sorted((REPO / package).rglob("*.py")):
            rel = path.relative_to(REPO).as_posix()
            if not rel.startswith(OWN):
                yield path


@pytest.mark.parametrize(
    "source",
    [
        'if plan.sync == "allreduce": pass',
        'ok = rule_for(plan, vw) in ("wsp", "local")',
        'bad = sync in ["allreduce", "easgd"]',
        'x = "backup" != best.sync',
    ],
)
def test_the_check_sees_a_rule_compared_by_name(source: str) -> None:
    assert list(rule_comparisons(source)), source


def test_the_check_lets_placement_and_baseline_be() -> None:
    source = 'a = plan.placement == "local"\nb = baseline in (None, "allreduce")\nc = x == "ddp"'
    assert list(rule_comparisons(source)) == []


def test_no_rule_name_is_compared_outside_the_rules_modules() -> None:
    found = [
        f"{path.relative_to(REPO)}:{line}: {names}"
        for path in _modules()
        for line, names in rule_comparisons(path.read_text(encoding="utf-8"))
    ]
    hint = "read a field of planner.rules.get_rule(name) instead"
    assert found == [], f"{hint}: {'; '.join(found)}"
