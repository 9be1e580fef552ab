"""The torchrun-compatible entry point (``python -m runtime``) trains a plan's VW."""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from planner.manual import balanced_cuts, manual_plan
from profiler.graph import ModelGraph
from runtime.config import ModelSource
from runtime.stage.model import resolve_source


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _run_one_host(nproc: int, plan_path: Path, *args: str, timeout_s: float = 150.0) -> None:
    """``torchrun --nnodes 1 --nproc-per-node nproc -m runtime plan_path *args``; must succeed."""
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node",
        str(nproc), "--master-addr", "127.0.0.1", "--master-port", str(_free_port()),
        "-m", "runtime", str(plan_path), *args,
    ]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]


@pytest.mark.slow
def test_torchrun_entry_trains_every_stage(tmp_path: Path) -> None:
    graph = ModelGraph.from_spec(resolve_source(ModelSource(ref="mlp"), 8, meta=True))
    plan_path = manual_plan(graph, balanced_cuts(graph, 2), "mlp", 8, 2).save(
        tmp_path / "plan.yaml"
    )
    out = tmp_path / "out"
    _run_one_host(2, plan_path, "--steps", "6", "--timeout", "20", "--out", str(out))
    results = [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(2)]
    assert [r.steps for r in results] == [6, 6]
    assert len(results[1].losses) == 6
    import json  # one VW alone ends like hetpipe run --vw 0: its summary, by rank 0

    summary = json.loads((out / "summary.json").read_text())
    assert summary["sync"] == "local" and (out / "weights.pt").exists()


@pytest.mark.slow
def test_torchrun_two_hosts_run_the_plans_roles_and_end_like_hetpipe_run(tmp_path: Path) -> None:
    # 2 shards + two 2-stage VWs across hosts A and B = 6 ranks: two torchrun agents ("hosts",
    # --host A / --host B) of 3 ranks each, meeting through a c10d rendezvous on localhost
    import json
    import re

    from runtime.config import OptimizerConfig, RunConfig
    from runtime.launch.launcher import launch
    from tests.runtime._two_hosts import two_host_plan

    plan = two_host_plan(hosts=("hostA", "hostB"))
    plan_path = plan.save(tmp_path / "plan.json")
    out = tmp_path / "out"
    port = _free_port()
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "3",
        "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--max-restarts", "0",
        "-m", "runtime", str(plan_path), "--steps", "6", "--timeout", "30", "--out", str(out),
        "--no-emulate",
    ]  # fmt: skip
    hosts = [
        subprocess.Popen(
            [*cmd, "--host", h], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        for h in "AB"
    ]
    try:
        logs = [h.communicate(timeout=150) for h in hosts]
    finally:
        for h in hosts:
            if h.poll() is None:
                h.kill()
                h.wait()
    assert [h.returncode for h in hosts] == [0, 0], "\n".join(e[-2000:] for _, e in logs)
    for (_, err), node in zip(logs, "AB", strict=True):  # each agent ran its host's roles
        ran = {int(k) for k in re.findall(r"host host[AB]: rank \d+ runs role (\d+)", err)}
        assert ran == ({0, 2, 4} if node == "A" else {1, 3, 5}), err[-2000:]
    summary = json.loads((out / "summary.json").read_text())  # written once, by rank 0
    assert summary["test_accuracy"] == summary["test_accuracy"]  # not NaN: it was tested
    printed = "".join(o for o, _ in logs)
    assert printed.count("accuracy") == 1 and "weights.pt" in printed  # one summary
    weights = torch.load(out / "weights.pt", weights_only=True)
    run = RunConfig(steps=6, timeout_s=30.0, emulate=False)
    local = launch(plan, ModelSource(ref="mlp"), OptimizerConfig(lr=0.05), run)
    ref = local.state_dict()
    assert weights.keys() == ref.keys()
    for name, t in weights.items():  # D = 0: deterministic, equal to one host
        assert torch.equal(t, ref[name]), name


@pytest.mark.slow
def test_torchrun_time_limit_stops_every_vw_at_one_agreed_wave(tmp_path: Path) -> None:
    """--time-limit under torchrun: the VWs agree on the stop wave through the process group's
    store (no shared file), so every VW trains the same number of whole waves."""
    from planner.manual import multi_vw_plan
    from runtime.__main__ import collect_wsp

    graph = ModelGraph.from_spec(resolve_source(ModelSource(ref="mlp"), 16, meta=True))
    plan = multi_vw_plan(graph, [(4,), (6,)], "mlp", 16, nm=2, D=1, n_shards=1)
    plan_path = plan.save(tmp_path / "plan.json")
    out = tmp_path / "out"
    _run_one_host(5, plan_path, "--time-limit", "2", "--timeout", "30", "--out", str(out))
    result = collect_wsp(plan, out)
    steps = {v.steps for v in result.vws}
    assert len(steps) == 1, steps  # one agreed wave for every VW
    (n,) = steps
    assert n >= 2 and n % 2 == 0  # whole waves of Nm = 2, and it did train
    assert all(state.clock == n // 2 for state in result.states)


def test_the_torchrun_entry_has_hetpipe_runs_options_and_defaults() -> None:
    """`python -m runtime` (torchrun) and `hetpipe run` take every run option with the same
    default and turn them into the same configs (the torchrun entry used to time out after
    60 s instead of 30, never checkpoint, and lack --on-failure)."""
    import inspect

    from hetpipe.commands.run import run
    from runtime.__main__ import _args
    from runtime.options import OPTIONS, configs

    parsed = vars(_args(["plan.yaml"]))
    defaults = inspect.signature(run).parameters
    assert {n: parsed[n] for n in OPTIONS} == {n: defaults[n].default for n in OPTIONS}
    assert len(OPTIONS) >= 18 and "on_failure" in OPTIONS
    flags = vars(_args(["p.yaml", "--on-failure", "restart", "--max-restarts", "2", "--D", "1",
                        "--no-emulate", "--weight-decay", "0.1"]))  # fmt: skip
    opt, run_cfg, wsp = configs(flags)
    assert (wsp.max_restarts, wsp.D, run_cfg.emulate, opt.weight_decay) == (2, 1, False, 0.1)


def test_a_torchrun_rank_gets_the_job_hetpipe_run_would_give_it(tmp_path: Path) -> None:
    """Same options -> same job: a rank's job is the one-host launcher's (plan defaults such
    as its precision filled in the same way), only the rendezvous differs."""
    import dataclasses

    from runtime.__main__ import _args, _rank_job
    from runtime.launch.launcher import prepare
    from runtime.options import configs
    from runtime.run import settle

    graph = ModelGraph.from_spec(resolve_source(ModelSource(ref="mlp"), 8, meta=True))
    plan = dataclasses.replace(
        manual_plan(graph, balanced_cuts(graph, 2), "mlp", 8, 2), precision="bf16"
    )
    args = _args(["plan.yaml", "--steps", "3", "--lr", "0.1", "--no-emulate"])
    job = _rank_job(args, plan, rank=1, world=2)
    opt, run, cfg = configs(vars(args))
    run = settle(run, plan, "local")
    prep = prepare(plan, ModelSource(ref="mlp"), opt, run, cfg, None, None, "local", 0, "env://")
    assert job == prep.stages[1] and job.run.precision == "bf16" and job.optimizer.lr == 0.1
