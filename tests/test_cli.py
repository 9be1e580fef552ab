"""The command line exists, describes itself and never shows a traceback for bad input."""

from __future__ import annotations

import subprocess
import sys

import pytest
from typer.testing import CliRunner

from hetpipe.cli import app

COMMANDS = ["profile", "plan", "simulate", "run", "cluster", "timeline"]


def test_top_level_help_lists_every_command() -> None:
    result = CliRunner().invoke(app, ["--help"])
    assert result.exit_code == 0
    for cmd in COMMANDS:
        assert cmd in result.output


@pytest.mark.parametrize("cmd", COMMANDS)
def test_every_command_has_help(cmd: str) -> None:
    result = CliRunner().invoke(app, [cmd, "--help"])
    assert result.exit_code == 0, result.output
    assert "Usage" in result.output


def test_unknown_command_is_a_usage_error() -> None:
    result = CliRunner().invoke(app, ["frobnicate"])
    assert result.exit_code == 2


def test_console_script_and_packages_import() -> None:
    out = subprocess.run(
        [
            sys.executable,
            "-c",
            "import hetpipe, profiler, planner, runtime; print(hetpipe.__version__)",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    assert out.stdout.strip()


def test_the_cli_starts_without_torch_pandas_or_pulp() -> None:
    """`hetpipe --help` and the start of every command load no heavy library: each command
    imports what it needs when it runs (it used to take 4-9 s before printing anything)."""
    code = (
        "import sys, hetpipe, hetpipe.cli; "
        "print(sorted(m for m in ('torch', 'pandas', 'pulp', 'matplotlib') if m in sys.modules))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    assert out.stdout.strip() == "[]"
