"""scripts/gpu_check: the no-CUDA exit and the report it writes (the GPU steps themselves run
on a GPU; ``--cpu-dry-run`` runs them all on CPU in a few minutes, too slow for CI)."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch

from tests.conftest import REPO

SCRIPT = REPO / "scripts" / "gpu_check.py"


def _script() -> ModuleType:
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["gpu_check"] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


@pytest.mark.skipif(torch.cuda.is_available(), reason="this host has CUDA")
def test_without_cuda_it_says_so_and_exits_0(tmp_path: Path) -> None:
    env = {"OUT": str(tmp_path), "PATH": "/usr/bin:/bin"}
    proc = subprocess.run(
        [sys.executable, str(SCRIPT)], capture_output=True, text=True, timeout=120, env=env
    )
    assert proc.returncode == 0
    assert "no CUDA device here" in proc.stdout
    assert not list(tmp_path.iterdir())  # nothing measured, nothing written


@pytest.mark.skipif(shutil.which("nvidia-smi") is not None, reason="this host has a GPU")
def test_the_shell_script_without_a_gpu_builds_nothing() -> None:
    proc = subprocess.run(
        ["bash", str(REPO / "scripts" / "gpu_check.sh")], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0 and "nothing checked" in proc.stdout


def test_dry_run_report_records_each_step_and_a_failure(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    gc = _script()

    def step_boom(rep: object) -> None:
        raise RuntimeError("boom")

    monkeypatch.setattr(gc, "STEPS", (gc.step_env, gc.step_pytest, step_boom))
    monkeypatch.setenv("OUT", str(tmp_path))
    assert gc.main(["--cpu-dry-run"]) == 1  # a failed step fails the check; the rest still ran
    doc = json.loads((tmp_path / "gpu_check.json").read_text())
    assert doc["failed"] == ["step_boom"]
    assert doc["env"]["device"] == "cpu (dry run)"
    assert doc["pytest_cuda"] == {"skipped": "dry run"}
    assert doc["sizes"]["device"] == "cpu"
    summary = (tmp_path / "summary.txt").read_text().splitlines()
    assert summary[0].startswith("env: torch") and "FAILED" in summary[-1]


@pytest.mark.slow
def test_cpu_dry_run_runs_every_step(tmp_path: Path) -> None:
    """The whole script on CPU with tiny sizes (about a minute): every step passes and the
    pipeline trains equal to all-keep under every offload placement."""
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--cpu-dry-run"], capture_output=True, text=True,
        timeout=600, env={**os.environ, "OUT": str(tmp_path)},
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    doc = json.loads((tmp_path / "gpu_check.json").read_text())
    assert doc["failed"] == []
    assert all(r["equal_to_keep"] for r in doc["offload"])
    assert [(r["stages"], r["precision"]) for r in doc["train_hf"]] == [(2, "fp32"), (3, "bf16")]
    for r in doc["train_hf"]:
        tol = 1e-4 if r["precision"] == "fp32" else 5e-2
        assert r["first_loss"] == pytest.approx(r["plain_first_loss"], abs=tol)
    assert doc["throughput"]["vw_samples_per_s"] > 0
