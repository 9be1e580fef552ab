"""Many VWs through the WSP parameter servers, end to end (gloo, CPU, real processes).

Every run checks the ledger (each (vw, stage, wave) applied exactly once) and the recorded
clock trace (distance <= D + 1); results are compared with single-process references of the
same algorithm.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import Tensor, nn
from torch.func import functional_call

from planner.manual import multi_vw_plan
from planner.sync import data_slice
from profiler.errors import HetPipeRuntimeError
from profiler.graph import ModelGraph
from runtime.config import ModelSource, OptimizerConfig, RunConfig
from runtime.data import MinibatchSource, default_dataset
from runtime.faults import ShardFault, StageFault
from runtime.launch.launcher import launch
from runtime.launch.wsp import vw_training_data
from runtime.persist.snapshot import committed_clocks
from runtime.results.run_result import RunResult
from runtime.spec import DataConfig
from runtime.stage.model import reference_module, resolve_source
from tests.runtime._spec import spec

pytestmark = pytest.mark.timeout(120)

SOURCE = ModelSource(ref="mlp")
BATCH = 16
LR = 0.05


def _graph() -> ModelGraph:
    return ModelGraph.from_spec(resolve_source(SOURCE, BATCH, meta=True))


def _sources(n_vws: int, seed: int = 0, rule: str = "wsp") -> list[MinibatchSource]:
    """Each VW's minibatches under ``rule``'s data rule (its shard, or its global slices)."""
    model = resolve_source(SOURCE, BATCH, meta=True)
    ds = default_dataset("mlp", model.inputs, model.targets, BATCH)
    sets, _, _ = vw_training_data(rule, ds, n_vws, DataConfig().test_fraction, seed)
    shape = tuple(model.targets.shape)
    return [
        MinibatchSource(s, BATCH, seed, shape, slice_of=data_slice(rule, k, n_vws))
        for k, s in enumerate(sets)
    ]


def wsp_reference(
    n_vws: int,
    nm: int,
    waves: int,
    seed: int = 0,
    momentum: float = 0.0,
    rule: str = "wsp",
    skipped: frozenset[tuple[int, int]] = frozenset(),
) -> tuple[dict[str, Tensor], list[list[float]]]:
    """Single-process WSP with D = 0 and each VW's own SGD (with momentum): each VW's minibatch
    p runs on its version p - Nm; at each wave end every VW pushes its wave delta, the global
    weights add them in VW order, and every VW continues from the global weights. Each VW's
    data follows ``rule``'s data rule; the update of VW ``k``'s minibatch ``p`` is skipped
    (no step, the optimizer state as it was) for every ``(k, p)`` in ``skipped``."""
    module, names, loss_fn = reference_module(SOURCE, BATCH, seed)
    w0 = {n: p.detach().clone() for n, p in module.named_parameters()}
    data = _sources(n_vws, seed, rule)
    glob = {n: t.clone() for n, t in w0.items()}
    history: list[list[dict[str, Tensor]]] = [[w0] for _ in range(n_vws)]
    losses: list[list[float]] = [[] for _ in range(n_vws)]
    bufs: list[dict[str, Tensor]] = [{} for _ in range(n_vws)]
    for c in range(waves):
        deltas = []
        for k in range(n_vws):
            start = history[k][-1]
            for p in range(c * nm + 1, (c + 1) * nm + 1):
                version = history[k][max(0, p - nm)]
                w = {n: t.clone().requires_grad_() for n, t in version.items()}
                x, y = data[k].batch(p)
                loss = loss_fn(functional_call(module, w, tuple(x)), y)
                grads = torch.autograd.grad(loss, list(w.values()))
                master, buf = history[k][-1], bufs[k]
                losses[k].append(float(loss.detach()))
                if (k, p) in skipped:  # --on-nonfinite skip: the weights stay as they were
                    history[k].append(dict(master))
                    continue
                for n, g in zip(w, grads, strict=True):  # torch.optim.SGD's momentum rule
                    buf[n] = g.clone() if n not in buf else buf[n].mul(momentum).add(g)
                step = buf if momentum else dict(zip(w, grads, strict=True))
                history[k].append({n: master[n].add(step[n], alpha=-LR) for n in w})
            deltas.append({n: history[k][-1][n] - start[n] for n in w0})
        for d in deltas:
            glob = {n: glob[n] + d[n] for n in glob}
        for k in range(n_vws):
            history[k][-1] = {n: t.clone() for n, t in glob.items()}
    return {names[n]: t for n, t in glob.items()}, losses


def _check_invariants(result: RunResult, n_stages: list[int], waves: int, first: int = 0) -> None:
    """Ledger: every client's every wave applied exactly once; clock distance <= D + 1."""
    for state, shard in zip(result.states, result.specs, strict=True):
        tags = Counter((e.vw, e.stage, e.wave) for e in state.ledger)
        assert all(n == 1 for n in tags.values()), f"shard {shard.id}: a tag applied twice"
        expected = {(c.vw, c.stage, w) for c in shard.clients for w in range(first, waves)}
        assert set(tags) >= expected, f"shard {shard.id}: updates missing"
        assert state.clock == waves
    assert result.traces and all(result.traces)
    assert result.max_clock_distance <= result.D + 1


def _run(plan: Any, tmp_path: Path, steps: int, **kw: Any) -> RunResult:
    run = RunConfig(steps=steps, timeout_s=15.0, emulate=False, out_dir=kw.pop("out", None))
    cfg = dict(**kw)
    return launch(plan, SOURCE, spec(OptimizerConfig(lr=LR), run, **cfg))


def test_one_vw_nm1_d0_equals_single_process_sgd(tmp_path: Path) -> None:
    plan = multi_vw_plan(_graph(), [(4,)], "mlp", BATCH, nm=1, D=0, n_shards=2)
    result = _run(plan, tmp_path, steps=6)
    ref, losses = wsp_reference(1, 1, 6)
    state = result.state_dict()
    for n, t in ref.items():
        torch.testing.assert_close(state[n], t, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(result.vws[0].losses, losses[0], rtol=1e-5, atol=1e-6)
    _check_invariants(result, [2], 6)


def test_two_vws_d0_equal_the_reference_and_prove_exactly_once(tmp_path: Path) -> None:
    # different partitions per VW, 2 shards: every update crosses shard and stage boundaries
    plan = multi_vw_plan(_graph(), [(4,), (6,)], "mlp", BATCH, nm=2, D=0, n_shards=2)
    result = _run(plan, tmp_path, steps=8)
    ref, losses = wsp_reference(2, 2, 4)
    state = result.state_dict()
    assert set(state) == set(ref)
    for n, t in ref.items():
        torch.testing.assert_close(state[n], t, rtol=1e-5, atol=1e-6)
    for k in range(2):
        torch.testing.assert_close(result.vws[k].losses, losses[k], rtol=1e-5, atol=1e-6)
    _check_invariants(result, [2, 2], 4)
    assert result.max_clock_distance == 1  # BSP with pipelining: the bound D + 1 is reached


def test_staleness_bound_holds_with_d2_and_unequal_vws(tmp_path: Path) -> None:
    # VW 1 has three stages (slower round trips): VW 0 runs ahead as far as D allows
    plan = multi_vw_plan(_graph(), [(6,), (2, 4)], "mlp", BATCH, nm=1, D=2, n_shards=1)
    result = _run(plan, tmp_path, steps=12)
    _check_invariants(result, [2, 3], 12)
    for events in result.traces:
        for e in events:
            assert e.distance <= 3
    for vw in result.vws:  # every pull delivered at least the clock WSP requires
        for st in vw.stages:
            assert st.clocks[0] == (0, 0)  # the initial pull
            assert all(got >= need for need, got in st.clocks)
            needs = [need for need, _ in st.clocks[1:]]
            assert needs == sorted(set(needs)) and all(n >= 1 for n in needs)
            # D = 2, Nm = 1: after wave c the next minibatch c + 2 needs clock c - 1
            assert max(needs) <= 12 - 2


def test_time_limit_stops_every_vw_at_the_same_wave(tmp_path: Path) -> None:
    # unequal VWs (2 and 3 stages) with D = 1: the faster one's time runs out first, the slower
    # one must still finish the agreed waves, and the shards end at exactly that clock
    plan = multi_vw_plan(_graph(), [(6,), (2, 4)], "mlp", BATCH, nm=2, D=1, n_shards=2)
    run = RunConfig(steps=100_000, time_limit_s=1.5, timeout_s=15.0, emulate=False)
    result = launch(plan, SOURCE, spec(OptimizerConfig(lr=LR), run))
    steps = {vw.steps for vw in result.vws}
    assert len(steps) == 1, f"VWs ran different numbers of minibatches: {steps}"
    (n,) = steps
    assert 0 < n < 100_000 and n % 2 == 0
    for vw in result.vws:
        assert all(st.steps == n for st in vw.stages)
    _check_invariants(result, [2, 3], n // 2)


def _kill_then_resume(plan: Any, out: Path, steps: int) -> tuple[str, RunResult]:
    run = RunConfig(steps=steps, timeout_s=15.0, emulate=False, out_dir=out)
    opt = OptimizerConfig(lr=LR, momentum=0.5)  # stage-side optimizer state is checkpointed too
    with pytest.raises(HetPipeRuntimeError) as err:
        launch(plan, SOURCE, spec(opt, run, checkpoint_every=2, resume_hint="hetpipe run X",
                                  stage_fault=StageFault(1, 7)))  # fmt: skip
    resumed = launch(plan, SOURCE, spec(opt, run, checkpoint_every=2, resume=True))
    return str(err.value), resumed


def test_kill_mid_run_then_resume(tmp_path: Path) -> None:
    plan = multi_vw_plan(_graph(), [(4,), (6,)], "mlp", BATCH, nm=1, D=0, n_shards=2)
    out = tmp_path / "run"
    message, resumed = _kill_then_resume(plan, out, steps=10)
    assert "killed by signal SIGKILL" in message and "stage 1" in message
    assert f"hetpipe run X --resume {out / 'checkpoints'}" in message
    ref, _ = wsp_reference(2, 1, 10, momentum=0.5)
    state = resumed.state_dict()
    for n, t in ref.items():  # D = 0: the resumed run equals an uninterrupted one
        torch.testing.assert_close(state[n], t, rtol=1e-5, atol=1e-6)
    assert min(s.clock for s in resumed.states) == 10
    assert (out / "weights.pt").exists()
    exported = torch.load(out / "weights.pt", weights_only=True)
    model = resolve_source(SOURCE, BATCH, meta=False).module
    model.load_state_dict(exported)  # one ordinary state_dict of the original module
    assert isinstance(model, nn.Module)


def test_killed_shard_stops_the_run_naming_it(tmp_path: Path) -> None:
    plan = multi_vw_plan(_graph(), [(4,), (6,)], "mlp", BATCH, nm=1, D=0, n_shards=2)
    run = RunConfig(steps=100_000, timeout_s=15.0, emulate=False)
    with pytest.raises(HetPipeRuntimeError) as err:
        cfg = dict(shard_fault=ShardFault(1, 3.0))
        launch(plan, SOURCE, spec(OptimizerConfig(lr=LR), run, **cfg))
    message = str(err.value)
    assert message.startswith("rank 1 (shard 1 |"), message
    assert "killed by signal SIGKILL" in message


def test_cli_runs_a_multi_vw_plan_file(tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from hetpipe.cli import app

    plan = multi_vw_plan(_graph(), [(4,), (6,)], "mlp", BATCH, nm=2, D=1, n_shards=2)
    path = plan.save(tmp_path / "plan.yaml")
    out = tmp_path / "run"
    args = ["run", str(path), "--steps", "6", "--out", str(out), "--no-progress", "--no-emulate"]
    args += ["--checkpoint-every", "1"]
    res = CliRunner().invoke(app, args, env={"COLUMNS": "200"})
    assert res.exit_code == 0, res.output
    assert "2 VWs through 2 parameter-server shards (WSP, D=1)" in res.output
    assert "test accuracy" in res.output and "waiting s" in res.output
    assert (out / "weights.pt").exists() and (out / "vw1" / "metrics.csv").exists()
    assert committed_clocks(out / "checkpoints") == [2, 3]  # the newest two are kept
