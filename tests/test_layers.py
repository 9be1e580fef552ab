"""The one-way imports of docs/architecture.md, read from the source with ``ast`` (nothing imported).

Packages: ``profiler`` <- ``planner`` <- ``runtime`` <- ``hetpipe``, never back. Inside the
runtime the entry points sit above the launcher and the launcher above everything else
(stages, shards, rules, results, ...), so no lower layer imports a higher one: a module that
imports from a layer which imports it "climbs back up". The runtime reads the plan and the
shared rules, never what plans or the simulator (``planner.sim``); the planner never
measures a model.
Every import counts: at the top, inside a function, or under ``TYPE_CHECKING``.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import REPO

PACKAGES = ("profiler", "planner", "runtime", "hetpipe")  # lowest first

# Runtime layers, highest first: a module may import its own layer or a later one only.
RUNTIME_LAYERS = (
    ("runtime.__main__",),
    ("runtime.run",),
    ("runtime.launch",),
)


# What the runtime may read of the planner: the plan (the contract) and the pure parts both
# sides share (docs/architecture.md's table); nothing that plans, nothing of the simulator.
PLANNER_FOR_RUNTIME = (
    "planner.plan",
    "planner.plan_file",
    "planner.plan_check",
    "planner.cluster",  # the plan embeds its cluster: links and their time formula
    "planner.predict",  # ring_link: the link a ring all-reduce crosses, priced alike
    "planner.schedule",
    "planner.wsp",
    "planner.sync",
    "planner.rules",  # the rule registry: each rule's declaration, read by both sides
    "planner.ranges",  # option ranges the run options table shares with the planner's
    "planner.backup",
    "planner.easgd",
    "planner.staleness",
    "planner.nonfinite",
    "planner.straggle",
    "planner.pacing",
    "planner.offload",
    "planner.throughput",
    "planner.draw",
)

# Modules that run a model to measure it: the profiler's, called by the front ends only.
MEASURING = ("profiler.measure", "profiler.timing", "profiler.cpu_profile")


def _module(path: Path, root: Path) -> str:
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(root: Path, package: str) -> Iterator[tuple[str, str, int]]:
    """``(importing module, imported module, line)`` of every absolute import in ``package``."""
    for path in sorted((root / package).rglob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
        mod = _module(path, root)
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                yield mod, node.module, node.lineno
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    yield mod, alias.name, node.lineno


def _within(mod: str, prefix: str) -> bool:
    return mod == prefix or mod.startswith(prefix + ".")


def _layer(mod: str) -> int:
    """The runtime layer of ``mod`` (0: the top); every other runtime module is the lowest."""
    for i, prefixes in enumerate(RUNTIME_LAYERS):
        if any(_within(mod, p) for p in prefixes):
            return i
    return len(RUNTIME_LAYERS)


def upward_imports(root: Path) -> list[str]:
    """Imports from a lower package into a higher one (e.g. ``planner`` importing ``runtime``)."""
    rank = {p: i for i, p in enumerate(PACKAGES)}
    out = []
    for package in PACKAGES:
        for mod, target, line in imports(root, package):
            top = target.split(".")[0]
            if top in rank and rank[top] > rank[package]:
                out.append(f"{mod}:{line} imports {target}")
    return out


def climbing_imports(root: Path) -> list[str]:
    """Runtime imports that climb back up a layer (e.g. ``runtime.sync`` importing the launcher)."""
    return [
        f"{mod}:{line} imports {target}"
        for mod, target, line in imports(root, "runtime")
        if _within(target, "runtime") and _layer(target) < _layer(mod)
    ]


def test_packages_import_one_way() -> None:
    assert upward_imports(REPO) == []


def test_no_runtime_import_climbs_back_up() -> None:
    assert climbing_imports(REPO) == []


def test_runtime_never_reads_the_simulator() -> None:
    found = [
        f"{mod}:{line} imports {target}"
        for mod, target, line in imports(REPO, "runtime")
        if _within(target, "planner.sim")
    ]
    assert found == []


def test_the_runtime_reads_the_plan_and_shared_rules_only() -> None:
    """The runtime never plans: of the planner it imports the plan and the shared pure parts."""
    found = [
        f"{mod}:{line} imports {target}"
        for mod, target, line in imports(REPO, "runtime")
        if _within(target, "planner") and not any(_within(target, m) for m in PLANNER_FOR_RUNTIME)
    ]
    assert found == []


def test_planner_never_measures() -> None:
    found = [
        f"{mod}:{line} imports {target}"
        for mod, target, line in imports(REPO, "planner")
        if any(_within(target, m) for m in MEASURING)
    ]
    assert found == []


@pytest.mark.parametrize(
    ("source", "climbs"),
    [
        ("from runtime.launch.stop import LazyStop\n", True),
        ("def f():\n    from runtime.run import run_plan\n", True),
        ("from runtime.stage.device import cuda_index\n", False),
    ],
)
def test_a_climbing_import_is_found(tmp_path: Path, source: str, climbs: bool) -> None:
    """The check itself: a stage module importing the launcher or the entry point is caught."""
    (tmp_path / "runtime" / "stage").mkdir(parents=True)
    (tmp_path / "runtime" / "stage" / "worker.py").write_text(source, encoding="utf-8")
    assert bool(climbing_imports(tmp_path)) is climbs
