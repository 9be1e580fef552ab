"""The command line exists, describes itself and never shows a traceback for bad input."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

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


_QUIET_RUN = """
import torch
from torch import nn
from torch.utils.data import Dataset
import hetpipe

class Net(nn.Module):  # called with keywords: captured by torch.export, not fx
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(8, 16), nn.Linear(16, 4)
    def forward(self, x, labels):
        return {"loss": nn.functional.cross_entropy(self.b(torch.relu(self.a(x))), labels)}

class Data(Dataset):
    def __len__(self): return 32
    def __getitem__(self, i): return {"x": torch.ones(8) * i / 32, "labels": torch.tensor(i % 4)}

if __name__ == "__main__":
    torch.manual_seed(0)
    r = hetpipe.train(Net(), Data(), stages=2, nm=2, batch_size=4, steps=3)
    print("losses", len(r.losses))
"""


def test_a_run_prints_no_warning_of_torch_or_tqdm_internals(tmp_path: Path) -> None:
    """An exported model through two stage processes ends without the launcher printing
    ``leaked semaphore objects`` (tqdm's multiprocessing lock, opened by torch.fx in every
    rank) or torch's own ``LeafSpec`` deprecation (its pickling of pytree specs)."""
    script = tmp_path / "quiet_run.py"
    script.write_text(_QUIET_RUN, encoding="utf-8")
    env = {**os.environ, "HETPIPE_CACHE_DIR": "off", "PYTHONWARNINGS": "default"}
    out = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=240, env=env,
        cwd=tmp_path,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    assert "losses 3" in out.stdout
    assert "LeafSpec" not in out.stderr
    cluster = Path(__file__).resolve().parents[1] / "examples" / "emulated_cluster.yaml"
    args = ["run", str(cluster), "--vws", "1", "--policy", "ed", "--steps", "3"]
    out = subprocess.run(
        [sys.executable, "-m", "hetpipe", *args, "--out", str(tmp_path / "o")],
        capture_output=True, text=True, timeout=240, env=env, cwd=tmp_path,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    assert "leaked semaphore" not in out.stderr


@pytest.mark.parametrize("cmd", [["run", "--steps", "1", "--no-progress"], ["plan"]])
def test_a_model_too_large_for_any_host_is_one_line_before_allocating(cmd: list[str]) -> None:
    """512 TB of weights, counted on the meta device: refused before anything is allocated."""
    root = Path(__file__).resolve().parents[1]
    ref = "mlp(hidden=1000000000000,depth=1)"
    args = [cmd[0], str(root / "examples" / "emulated_cluster.yaml"), "--model", ref, *cmd[1:]]
    res = CliRunner().invoke(app, args)
    assert res.exit_code == 2, res.output
    lines = res.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: model {ref!r} needs "), res.output
    assert "bytes of weights but this host has" in lines[0] and "--profiles" in lines[0]
