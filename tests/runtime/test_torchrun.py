"""The torchrun-compatible entry point (``python -m runtime``) trains a plan's VW."""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from profiler.graph import ModelGraph
from runtime.config import ModelSource
from runtime.model import resolve_source
from runtime.plans import balanced_cuts, manual_plan


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.slow
def test_torchrun_entry_trains_every_stage(tmp_path: Path) -> None:
    graph = ModelGraph.from_spec(resolve_source(ModelSource(ref="mlp"), 8, meta=True))
    plan_path = manual_plan(graph, balanced_cuts(graph, 2), "mlp", 8, 2).save(
        tmp_path / "plan.yaml"
    )
    out = tmp_path / "out"
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", "2",
        "--master-addr", "127.0.0.1", "--master-port", str(_free_port()),
        "-m", "runtime", str(plan_path), "--steps", "6", "--timeout", "20", "--out", str(out),
    ]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr[-2000:]
    results = [torch.load(out / f"stage{r}.pt", weights_only=False) for r in range(2)]
    assert [r.steps for r in results] == [6, 6]
    assert len(results[1].losses) == 6
