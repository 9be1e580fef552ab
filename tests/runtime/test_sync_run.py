"""Backup workers and elastic averaging end to end (gloo, CPU, real processes), against
single-process references of the same algorithms (``planner.backup``, ``planner.easgd``)."""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import Tensor
from torch.func import functional_call

from planner.easgd import elastic_difference, exchanges_after
from planner.manual import multi_vw_plan
from runtime.config import OptimizerConfig, RunConfig, WSPConfig
from runtime.launch.launcher import launch
from runtime.results.run_result import RunResult
from runtime.results.sync import arrival_table, dropped_vw_waves, kth_push_s
from runtime.stage.model import reference_module
from tests.runtime.test_wsp_run import BATCH, LR, SOURCE, _graph, _sources, wsp_reference

pytestmark = pytest.mark.timeout(120)

Weights = dict[str, Tensor]


def _wave(
    module: Any, loss_fn: Any, data: Any, hist: list[Weights], c: int, nm: int
) -> list[float]:
    """One VW's wave ``c`` of plain SGD with exact local staleness (minibatch p on version
    p - Nm), appended to ``hist``; returns the losses."""
    losses = []
    for p in range(c * nm + 1, (c + 1) * nm + 1):
        w = {n: t.clone().requires_grad_() for n, t in hist[max(0, p - nm)].items()}
        x, y = data.batch(p)
        loss = loss_fn(functional_call(module, w, tuple(x)), y)
        grads = dict(zip(w, torch.autograd.grad(loss, list(w.values())), strict=True))
        hist.append({n: hist[-1][n] - LR * grads[n] for n in w})
        losses.append(float(loss.detach()))
    return losses


def backup_reference(
    n_vws: int,
    nm: int,
    waves: int,
    counted: Callable[[int], Sequence[int]],
    pulled: Callable[[int, int], int],
) -> tuple[Weights, list[list[float]]]:
    """Single-process backup workers (D = 0): wave ``c`` adds the deltas of the VWs
    ``counted(c)`` in VW id order; after its wave ``c`` VW ``k`` goes on from the global weights
    of clock ``pulled(k, c)`` (the current clock when its pull was answered: ``c + 1``, or more
    for a VW so late that later waves closed without it)."""
    module, names, loss_fn = reference_module(SOURCE, BATCH, 0)
    w0 = {n: p.detach().clone() for n, p in module.named_parameters()}
    data = _sources(n_vws, 0)
    glob_at = [w0]  # global weights at each clock
    hist: list[list[Weights]] = [[w0] for _ in range(n_vws)]
    losses: list[list[float]] = [[] for _ in range(n_vws)]
    deltas: list[dict[int, Weights]] = [{} for _ in range(waves)]
    while any(len(h) <= waves * nm for h in hist):
        ready = [k for k in range(n_vws) if len(hist[k]) <= waves * nm]
        ready = [
            k
            for k in ready
            if len(hist[k]) == 1 or pulled(k, len(hist[k]) // nm - 1) < len(glob_at)
        ]
        assert ready, "the pulled clocks are not consistent with the counted VWs"
        for k in ready:
            c = len(hist[k]) // nm
            if c > 0:  # the pull at the end of wave c - 1 replaces the wave-end version
                hist[k][-1] = glob_at[pulled(k, c - 1)]
            start = hist[k][-1]
            losses[k] += _wave(module, loss_fn, data[k], hist[k], c, nm)
            deltas[c][k] = {n: hist[k][-1][n] - start[n] for n in w0}
        c = len(glob_at) - 1
        while c < waves and all(k in deltas[c] for k in counted(c)):
            glob = glob_at[c]
            for k in sorted(counted(c)):
                glob = {n: glob[n] + deltas[c][k][n] for n in glob}
            glob_at.append(glob)
            c += 1
    return {names[n]: t for n, t in glob_at[waves].items()}, losses


def easgd_reference(
    n_vws: int, nm: int, waves: int, tau: int, alpha: float
) -> tuple[Weights, list[list[float]]]:
    """Single-process elastic averaging: own weights per VW; after every tau-th wave each VW
    subtracts alpha (w - c) and the centre adds the sum (VW id order). Returns the centre."""
    module, names, loss_fn = reference_module(SOURCE, BATCH, 0)
    w0 = {n: p.detach().clone() for n, p in module.named_parameters()}
    data = _sources(n_vws, 0)
    centre = dict(w0)
    hist: list[list[Weights]] = [[w0] for _ in range(n_vws)]
    losses: list[list[float]] = [[] for _ in range(n_vws)]
    for c in range(waves):
        for k in range(n_vws):
            losses[k] += _wave(module, loss_fn, data[k], hist[k], c, nm)
        if exchanges_after(c, tau):
            ds = [{n: elastic_difference(h[-1][n], centre[n], alpha) for n in w0} for h in hist]
            for k in range(n_vws):
                hist[k][-1] = {n: hist[k][-1][n] - ds[k][n] for n in w0}
            for d in ds:
                centre = {n: centre[n] + d[n] for n in centre}
    return {names[n]: t for n, t in centre.items()}, losses


def _run(plan: Any, steps: int, rule: str, **params: float) -> RunResult:
    plan = dataclasses.replace(plan, sync=rule, sync_params=tuple(sorted(params.items())))
    run = RunConfig(steps=steps, timeout_s=15.0, emulate=False)
    return launch(plan, SOURCE, OptimizerConfig(lr=LR), run, WSPConfig())


def _same(state: Weights, ref: Weights) -> None:
    assert set(state) == set(ref)
    for n, t in ref.items():
        torch.testing.assert_close(state[n], t, rtol=1e-5, atol=1e-6)


def test_backup_b1_equals_the_reference_given_who_was_first(tmp_path: Path) -> None:
    """3 VWs, 1 backup: whatever the arrival order, each wave holds the first 2 VWs, every other
    push was acknowledged DROPPED, and the weights and every VW's losses equal the reference fed
    who was first and which clock each pull got."""
    plan = multi_vw_plan(_graph(), [(), (), ()], "mlp", BATCH, nm=2, D=0, n_shards=1)
    waves = 4
    result = _run(plan, 2 * waves, "backup", backups=1)
    (state,) = result.states
    by_wave: dict[int, set[int]] = {}
    tags = Counter((e.vw, e.stage, e.wave) for e in state.ledger)
    assert all(n == 1 for n in tags.values())
    for vw, _, wave in tags:
        by_wave.setdefault(wave, set()).add(vw)
    assert state.clock == waves and all(len(by_wave[c]) == 2 for c in range(waves))
    # a VW applied in a wave has all its stages applied; every other push was acknowledged DROPPED
    stages = [len(v.stages) for v in result.vws]
    for c, vws in by_wave.items():
        assert sum(stages[k] for k in vws) == sum(1 for t in tags if t[2] == c)
    dropped = {
        (k, s.stage, w) for k, v in enumerate(result.vws) for s in v.stages for _, w in s.dropped
    }
    pushed = {
        (k, s.stage, w) for k, v in enumerate(result.vws) for s in v.stages for w, _ in s.pushes
    }
    assert dropped == pushed - set(tags) and not dropped & set(tags)
    assert dropped_vw_waves(result.vws) == waves  # one VW per wave
    assert len(kth_push_s(result.vws)) == 3
    table = arrival_table(result.vws)  # seed 003's Fig. 4: each wave's push time of each VW
    assert len(table) == waves and all(len(row) == 3 for row in table), table
    assert all(t is not None for row in table for t in row), table
    clocks = [v.stages[0].clocks for v in result.vws]  # (needed, got) of each pull, in order
    assert all(cl[0] == (0, 0) and all(g >= n for n, g in cl) for cl in clocks), clocks

    def got(k: int, c: int) -> int:
        # the clock VW k's weights came from for wave c + 1: its pull for it, or, when it had
        # pulled that clock already (a VW left behind by the backups skips the pull), the last
        # pull before it
        return max(g for n, g in clocks[k] if n <= c + 1)

    ref, losses = backup_reference(3, 2, waves, lambda c: sorted(by_wave[c]), got)
    _same(result.state_dict(), ref)
    for k in range(3):
        torch.testing.assert_close(result.vws[k].losses, losses[k], rtol=1e-5, atol=1e-6)
    assert "backup b=1" in str(result.table().title)


def test_backup_without_backups_is_wsp_d0(tmp_path: Path) -> None:
    plan = multi_vw_plan(_graph(), [(4,), (6,)], "mlp", BATCH, nm=2, D=0, n_shards=2)
    result = _run(plan, 8, "backup", backups=0)
    ref, _ = wsp_reference(2, 2, 4)
    _same(result.state_dict(), ref)
    assert dropped_vw_waves(result.vws) == 0


def test_easgd_equals_the_reference_with_pipelines(tmp_path: Path) -> None:
    """2 VWs of 2 stages each (Nm = 2, local staleness inside them), 2 shards, tau = 2: the
    exported centre and every VW's losses equal the single-process elastic averaging."""
    plan = multi_vw_plan(_graph(), [(4,), (6,)], "mlp", BATCH, nm=2, D=0, n_shards=2)
    result = _run(plan, 12, "easgd", tau=2, alpha=0.25)
    ref, losses = easgd_reference(2, 2, 6, 2, 0.25)
    _same(result.state_dict(), ref)
    for k in range(2):
        torch.testing.assert_close(result.vws[k].losses, losses[k], rtol=1e-5, atol=1e-6)
    assert all(s.clock == 3 for s in result.states)  # 3 exchanges of 6 waves
    assert "EASGD tau=2 alpha=0.25" in str(result.table().title)
