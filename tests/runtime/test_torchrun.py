"""The torchrun-compatible entry point (``python -m runtime``) trains a plan's VW."""

from __future__ import annotations

import json
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
from tests.runtime._spec import spec


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
    local = launch(plan, ModelSource(ref="mlp"), spec(OptimizerConfig(lr=0.05), run))
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
    from runtime.options import OPTIONS, run_spec
    from runtime.spec import OnFailure

    parsed = vars(_args(["plan.yaml"]))
    defaults = inspect.signature(run).parameters
    assert {n: parsed[n] for n in OPTIONS} == {n: defaults[n].default for n in OPTIONS}
    assert len(OPTIONS) >= 18 and "on_failure" in OPTIONS
    flags = vars(_args(["p.yaml", "--on-failure", "restart", "--max-restarts", "2", "--D", "1",
                        "--no-emulate", "--weight-decay", "0.1"]))  # fmt: skip
    got = run_spec(flags)
    assert (got.failure.on_failure, got.failure.budget, got.sync.D) == (OnFailure.RESTART, 2, 1)
    assert (got.run.emulate, got.optimizer.weight_decay) == (False, 0.1)


def test_a_torchrun_rank_gets_the_job_hetpipe_run_would_give_it(tmp_path: Path) -> None:
    """Same options -> same job: a rank's job is the one-host launcher's (plan defaults such
    as its precision filled in the same way), only the rendezvous differs."""
    import dataclasses

    from runtime.__main__ import _args, _rank_job
    from runtime.launch.jobs import Attempt
    from runtime.launch.launcher import prepare
    from runtime.options import run_spec
    from runtime.run import settle

    graph = ModelGraph.from_spec(resolve_source(ModelSource(ref="mlp"), 8, meta=True))
    plan = dataclasses.replace(
        manual_plan(graph, balanced_cuts(graph, 2), "mlp", 8, 2), precision="bf16"
    )
    args = _args(["plan.yaml", "--steps", "3", "--lr", "0.1", "--no-emulate"])
    job = _rank_job(args, plan, rank=1, world=2)
    spec = settle(run_spec(vars(args)), plan)
    prep = prepare(plan, ModelSource(ref="mlp"), spec, None, Attempt("env://"))
    assert job == prep.stages[1] and job.run.precision == "bf16" and job.optimizer.lr == 0.1


FACTORY = """
import torch
from torch import nn
from torch.utils.data import TensorDataset


def model(batch_size=8):
    net = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 3))  # 3 classes
    return net, (torch.randn(batch_size, 4), torch.randint(0, 3, (batch_size,)))


def data():
    g = torch.Generator().manual_seed(7)
    y = torch.randint(0, 3, (64,), generator=g)
    return TensorDataset(torch.eye(3, 4)[y] * 3.0 + torch.randn(64, 4, generator=g), y), None
"""


def _factory_plan(tmp_path: Path) -> Path:
    """``tridata.py`` (a factory model and its ``data``) in ``tmp_path``, and a 2-stage plan."""
    import importlib

    (tmp_path / "tridata.py").write_text(FACTORY)
    sys.path.insert(0, str(tmp_path))
    importlib.invalidate_caches()
    try:
        graph = ModelGraph.from_spec(resolve_source(ModelSource(ref="tridata:model"), 8, meta=True))
    finally:
        sys.path.remove(str(tmp_path))
    plan = manual_plan(graph, balanced_cuts(graph, 2), "tridata:model", 8, 1)
    return plan.save(tmp_path / "plan.json")


def test_torchrun_refuses_a_factory_model_without_data_like_hetpipe_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No --data for a pkg.mod:factory model: hetpipe run's one line, not synthetic data."""
    from planner.plan_file import load_plan
    from profiler.errors import ConfigError
    from runtime.__main__ import _args, _rank_job

    plan_path = _factory_plan(tmp_path)
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ConfigError, match="no data of its own: give --data"):
        _rank_job(_args([str(plan_path)]), load_plan(plan_path), rank=0, world=2)


@pytest.mark.slow
def test_torchrun_trains_on_the_data_factory_like_one_host(tmp_path: Path) -> None:
    """``python -m runtime plan --data pkg.mod:factory`` trains on the factory's samples: the
    same losses as the one-host launcher given the same data (the entry used to ignore it)."""
    import os

    from runtime.config import OptimizerConfig, RunConfig
    from runtime.data_source import load_data
    from runtime.launch.launcher import launch

    plan_path = _factory_plan(tmp_path)
    out = tmp_path / "out"
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", "2",
        "--master-addr", "127.0.0.1", "--master-port", str(_free_port()), "-m", "runtime",
        str(plan_path), "--data", "tridata:data", "--steps", "4", "--no-emulate",
        "--timeout", "20", "--out", str(out),
    ]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), *sys.path])}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=150, check=False,
                          cwd=tmp_path, env=env)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    last = torch.load(out / "rank1.pt", weights_only=False)
    sys.path.insert(0, str(tmp_path))
    try:
        from planner.plan_file import load_plan

        ref = launch(load_plan(plan_path), ModelSource(ref="tridata:model"), spec(OptimizerConfig(), RunConfig(steps=4, emulate=False)), load_data("tridata:data"))  # fmt: skip
    finally:
        sys.path.remove(str(tmp_path))
    assert len(last.losses) == 4
    summary = json.loads((out / "summary.json").read_text())  # rank 0's, as hetpipe run's
    assert summary["data"].startswith("tridata:data (train 64")
    torch.testing.assert_close(
        torch.tensor(last.losses), torch.tensor(ref.vws[0].stages[-1].losses), rtol=1e-5, atol=1e-6
    )
