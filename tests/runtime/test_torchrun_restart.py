"""A real torchrun elastic restart: a worker SIGKILLed mid-run, torchrun (``--max-restarts 1``)
restarts the worker group, which resumes from the newest committed snapshot without
``--resume`` and ends bit-identical to an uninterrupted one-host run (D = 0), every update
applied exactly once."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from planner.manual import multi_vw_plan
from profiler.graph import ModelGraph
from runtime.config import ModelSource, OptimizerConfig, RunConfig
from runtime.persist.snapshot import committed_clocks
from runtime.stage.model import resolve_source
from tests.runtime._spec import spec

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]

NM, WAVES, EVERY = 3, 15, 2


def _workers(agent: int) -> dict[int, int]:
    """The torchrun agent's worker processes: ``RANK`` -> pid (from ``/proc``)."""
    out = {}
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
            env = (d / "environ").read_bytes().split(b"\0") if ppid == agent else []
        except (OSError, ValueError, IndexError):
            continue
        for kv in env:
            if kv.startswith(b"RANK="):
                out[int(kv[5:])] = int(d.name)
    return out


def _wait_for(what: str, cond, timeout_s: float) -> None:  # type: ignore[no-untyped-def]
    end = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > end:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)


@pytest.mark.skipif(
    not torch.distributed.is_available() or not Path("/proc/self/environ").exists(),
    reason="torchrun needs torch.distributed; finding its workers needs Linux /proc",
)
def test_torchrun_restarts_the_group_which_resumes_exactly(tmp_path: Path) -> None:
    from runtime.__main__ import collect_wsp
    from runtime.launch.launcher import launch

    source = ModelSource(ref="mlp")
    graph = ModelGraph.from_spec(resolve_source(source, 16, meta=True))
    plan = multi_vw_plan(graph, [(4,)], "mlp", 16, nm=NM, D=0, n_shards=1)  # 3 ranks
    plan_path = plan.save(tmp_path / "plan.json")
    out = tmp_path / "out"
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", "3",
        "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--max-restarts", "1",
        "--monitor-interval", "0.1", "-m", "runtime", str(plan_path), "--steps", str(NM * WAVES),
        "--checkpoint-every", str(EVERY), "--timeout", "20", "--no-emulate", "--out", str(out),
    ]  # fmt: skip
    agent = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        ckpts = out / "checkpoints"
        _wait_for("the first snapshot", lambda: bool(committed_clocks(ckpts)), 90)
        victim = _workers(agent.pid).get(2)  # the last stage
        assert victim is not None, "no worker with RANK=2"
        os.kill(victim, signal.SIGKILL)
        killed_after = max(committed_clocks(ckpts))
        _, err = agent.communicate(timeout=150)
    finally:
        if agent.poll() is None:
            agent.kill()
            agent.wait()
    assert agent.returncode == 0, err[-3000:]
    assert killed_after < WAVES, "the kill came after the run ended"
    result = collect_wsp(plan, out)
    # the restarted group trained only the waves after its snapshot (it did resume)
    assert all(v.steps <= NM * (WAVES - killed_after) for v in result.vws)
    for state in result.states:  # every (vw, stage, wave) applied exactly once
        tags = [(e.vw, e.stage, e.wave) for e in state.ledger]
        assert len(tags) == len(set(tags)) == 2 * WAVES and state.clock == WAVES
    run = RunConfig(steps=NM * WAVES, timeout_s=30.0, emulate=False)
    local = launch(plan, source, spec(OptimizerConfig(lr=0.05), run))
    ref = local.state_dict()
    for name, t in result.state_dict().items():  # D = 0: the restart changed no bit
        assert torch.equal(t, ref[name]), name
