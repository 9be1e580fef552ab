"""Two hosts over a real network: two Linux network namespaces joined by a veth pair
(``scripts/two_hosts.sh``, addresses in 198.18.0.0/24), one torchrun agent in each. A rank
killed on host B is restarted by torchrun (``--max-restarts 1``) from the newest snapshot and
the run ends bit-identical (D = 0) to the same plan trained on one host."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from runtime.config import ModelSource, OptimizerConfig, RunConfig
from runtime.persist.snapshot import committed_clocks
from tests.runtime._spec import spec
from tests.runtime._two_hosts import two_host_plan

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "two_hosts.sh"
NM, WAVES, EVERY = 2, 12, 2

pytestmark = [
    pytest.mark.slow,
    pytest.mark.timeout(300),
    pytest.mark.skipif(
        sys.platform != "linux" or os.geteuid() != 0 or shutil.which("ip") is None,
        reason="network namespaces need Linux, root and iproute2 (ip)",
    ),
]


def _host_b_workers() -> dict[int, int]:
    """``RANK`` -> pid of the workers of the agent in namespace B (``GLOO_SOCKET_IFNAME=hpb*``)."""
    out = {}
    for d in Path("/proc").iterdir():
        try:
            env = (d / "environ").read_bytes().split(b"\0") if d.name.isdigit() else []
        except OSError:
            continue
        if any(kv.startswith(b"GLOO_SOCKET_IFNAME=hpb") for kv in env):
            for kv in env:
                if kv.startswith(b"RANK="):
                    out[int(kv[5:])] = int(d.name)
    return out


def _wait_for(what: str, cond, timeout_s: float) -> None:  # type: ignore[no-untyped-def]
    end = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > end:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


def test_two_namespaces_train_the_plan_and_survive_a_lost_rank(tmp_path: Path) -> None:
    from runtime.launch.launcher import launch

    plan = two_host_plan(nm=NM)  # hosts 198.18.0.1 (A) and 198.18.0.2 (B)
    plan_path = plan.save(tmp_path / "plan.json")
    out = tmp_path / "out"
    env = {**os.environ, "PYTHON": sys.executable, "MAX_RESTARTS": "1"}
    cmd = [str(SCRIPT), "3", "3", str(plan_path), "--steps", str(NM * WAVES),
           "--checkpoint-every", str(EVERY), "--timeout", "30", "--no-emulate", "--out", str(out)]  # fmt: skip
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        ckpts = out / "checkpoints"
        _wait_for(
            "the first snapshot",
            lambda: proc.poll() is not None or bool(committed_clocks(ckpts)),
            150,
        )
        if proc.poll() == 77:
            pytest.skip("network namespaces cannot be made here")
        workers = _host_b_workers()
        assert len(workers) == 3, workers
        os.kill(max(workers.values()), signal.SIGKILL)  # a rank on host B
        killed_after = max(committed_clocks(ckpts))
        _, stderr = proc.communicate(timeout=200)
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)  # the script's trap removes its namespaces
            proc.communicate(timeout=30)
    assert proc.returncode == 0, stderr[-3000:]
    assert killed_after < WAVES, "the kill came after the run ended"
    assert "runs role" in stderr and "host 198.18.0.2" in stderr
    summary = json.loads((out / "summary.json").read_text())
    assert any("torchrun restarted" in r for r in summary["restarts"]), summary["restarts"]
    weights = torch.load(out / "weights.pt", weights_only=True)
    run = RunConfig(steps=NM * WAVES, timeout_s=30.0, emulate=False)
    ref = launch(plan, ModelSource(ref="mlp"), spec(OptimizerConfig(lr=0.05), run)).state_dict()
    for name, t in weights.items():  # D = 0: the hosts and the restart changed no bit
        assert torch.equal(t, ref[name]), name
