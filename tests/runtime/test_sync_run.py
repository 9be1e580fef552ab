"""Backup workers and elastic averaging end to end (gloo, CPU, real processes), against
single-process references of the same algorithms (``planner.backup``, ``planner.easgd``)."""

from __future__ import annotations

import dataclasses
import itertools
from collections import Counter
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import Tensor
from torch.func import functional_call

from planner.easgd import elastic_difference, exchanges_after, waves_at
from planner.manual import multi_vw_plan
from profiler.errors import HetPipeRuntimeError
from runtime.config import OptimizerConfig, RunConfig
from runtime.faults import ShardFault, StageFault
from runtime.launch.launcher import launch
from runtime.persist.snapshot import committed_clocks
from runtime.results.run_result import RunResult
from runtime.results.sync import arrival_table, dropped_vw_waves, kth_push_s
from runtime.stage.model import reference_module
from tests.runtime._spec import spec
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
    pulled: Callable[[int, int, int], int],
    number: Callable[[int, int], int] = lambda k, d: d,
    data_waves: Sequence[int] = (),
    stage_of: Callable[[str], int] = lambda name: 0,
) -> tuple[Weights, list[list[float]]]:
    """Single-process backup workers (D = 0): wave ``c`` adds the deltas of the VWs
    ``counted(c)`` in VW id order; after its data wave ``d`` VW ``k`` goes on from the global
    weights of clock ``pulled(k, d, s)`` (the clock stage ``s``'s pull returned: ``c + 1``, or
    more for a VW so late that later waves closed without it; a parameter is in stage
    ``stage_of(name)``) with its data wave ``d + 1``, pushed as
    wave ``number(k, d + 1)`` (a VW that jumped skips numbers; one numbered ``waves`` or more
    is trained, not pushed). VW ``k`` trains ``data_waves[k]`` data waves (default ``waves``)."""
    module, names, loss_fn = reference_module(SOURCE, BATCH, 0)
    w0 = {n: p.detach().clone() for n, p in module.named_parameters()}
    data = _sources(n_vws, 0, "backup")  # each VW its slice of every global minibatch
    todo = list(data_waves) or [waves] * n_vws
    glob_at = [w0]  # global weights at each clock
    hist: list[list[Weights]] = [[w0] for _ in range(n_vws)]
    losses: list[list[float]] = [[] for _ in range(n_vws)]
    deltas: list[dict[int, Weights]] = [{} for _ in range(waves)]
    while any(len(h) <= todo[k] * nm for k, h in enumerate(hist)):
        ready = [
            k
            for k in range(n_vws)
            if len(hist[k]) <= todo[k] * nm
            and (
                len(hist[k]) == 1
                or max(pulled(k, len(hist[k]) // nm - 1, stage_of(names[n])) for n in w0)
                < len(glob_at)
            )
        ]
        assert ready, "the pulled clocks are not consistent with the counted VWs"
        for k in ready:
            d = len(hist[k]) // nm
            if d > 0:  # the pull at the end of data wave d - 1 replaces the wave-end version
                hist[k][-1] = {n: glob_at[pulled(k, d - 1, stage_of(names[n]))][n] for n in w0}
            start = hist[k][-1]
            losses[k] += _wave(module, loss_fn, data[k], hist[k], d, nm)
            if number(k, d) < waves:
                deltas[number(k, d)][k] = {n: hist[k][-1][n] - start[n] for n in w0}
        c = len(glob_at) - 1
        while c < waves and all(k in deltas[c] for k in counted(c)):
            glob = glob_at[c]
            for k in sorted(counted(c)):
                glob = {n: glob[n] + deltas[c][k][n] for n in glob}
            glob_at.append(glob)
            c += 1
    assert len(glob_at) == waves + 1, "some wave never closed"
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


def _run(
    plan: Any,
    steps: int,
    rule: str,
    cfg: dict[str, Any] | None = None,
    return_state: bool = False,
    **params: float,
) -> RunResult:
    plan = dataclasses.replace(plan, sync=rule, sync_params=tuple(sorted(params.items())))
    run = RunConfig(steps=steps, timeout_s=15.0, emulate=False, return_state=return_state)
    return launch(plan, SOURCE, spec(OptimizerConfig(lr=LR), run, **cfg or {}))


def _same(state: Weights, ref: Weights) -> None:
    assert set(state) == set(ref)
    for n, t in ref.items():
        torch.testing.assert_close(state[n], t, rtol=1e-5, atol=1e-6)


def _fed_reference(result: RunResult, waves: int) -> tuple[Weights, list[list[float]]]:
    """:func:`backup_reference` fed what a run of one-stage VWs (one shard, ``Nm = 2``) did:
    who each wave counted, each VW's wave numbers (a late VW jumps to the clock: its next data
    wave is pushed under a later number), the clock each pull got (one pull after each push)
    and the data waves each VW trained (a VW that jumped to the end finishes the wave in
    progress, unpushed)."""
    stages = [v.stages[0] for v in result.vws]
    numbers = [[w for w, _ in s.pushes] for s in stages]  # each data wave's wave number
    clocks = [s.clocks for s in stages]  # the start, then one pull after every push
    assert all(len(cl) == len(ns) + 1 for cl, ns in zip(clocks, numbers, strict=True)), clocks
    data_waves = [s.steps // 2 for s in stages]
    for k, ns in enumerate(numbers):
        assert data_waves[k] == len(ns) + (ns[-1] < waves - 1), (data_waves, numbers)
    applied = {(e.vw, e.wave) for st in result.states for e in st.ledger}
    return backup_reference(
        len(stages), 2, waves,
        lambda c: sorted(k for k, w in applied if w == c),
        lambda k, d, s: clocks[k][d + 1][1],
        lambda k, d: numbers[k][d] if d < len(numbers[k]) else waves,
        data_waves,
    )  # fmt: skip


def test_backup_b1_equals_the_reference_given_who_was_first(tmp_path: Path) -> None:
    """3 VWs, 1 backup: whatever the arrival order, each wave holds the first 2 VWs, every other
    push was acknowledged DROPPED, and the weights and every VW's losses equal the reference fed
    who was first, which clock each pull got and the number each data wave was pushed as (a
    VW left behind jumps to the clock; the reference once numbered waves by data position and
    failed when such a VW was counted later, off by up to 1.7e-4)."""
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
    # the VW left out of a wave either pushed it and was dropped, or had jumped past it (a late
    # VW continues at the clock): every wave has one, counted once
    left_out = {(k, c) for c, vws in by_wave.items() for k in range(3) if k not in vws}
    pushed_vw = {(k, w) for k, _, w in pushed}
    skipped = {(k, c) for k, c in left_out if (k, c) not in pushed_vw}
    assert len(left_out) == waves
    assert dropped_vw_waves(result.vws) + len(skipped) == waves
    assert len(kth_push_s(result.vws)) == (3 if len(skipped) < waves else 0)
    table = arrival_table(result.vws)  # seed 003's Fig. 4: each wave's push time of each VW
    assert len(table) == waves and all(len(row) == 3 for row in table), table
    assert {(k, c) for c, row in enumerate(table) for k, t in enumerate(row) if t is None} == (
        skipped
    ), table
    clocks = [v.stages[0].clocks for v in result.vws]  # (needed, got) of each pull, in order
    assert all(cl[0] == (0, 0) and all(g >= n for n, g in cl) for cl in clocks), clocks
    ref, losses = _fed_reference(result, waves)
    _same(result.state_dict(), ref)
    for k in range(3):  # a VW that jumped trained fewer data waves: the reference too
        torch.testing.assert_close(result.vws[k].losses, losses[k], rtol=1e-5, atol=1e-6)
    assert "backup b=1" in str(result.table().title)


@pytest.mark.parametrize("lag_s", [0.0, 0.3], ids=["shards-in-step", "shard-1-lags"])
def test_a_late_vw_continues_at_the_clock_and_its_later_pushes_count(
    tmp_path: Path, lag_s: float
) -> None:
    """3 VWs, 1 backup, 6 waves. VW 2 sleeps 1 s in its data wave 1 while VWs 0 and 1 close
    waves 1-3 without it, then sleep 4 s in their wave 4. VW 2's push of wave 1 is dropped,
    its pull returns clock 4 and it continues at wave 4 (its data goes on): that push and
    later ones are applied, where before it stayed a wave behind, dropped every time. Two
    shards count the same VWs in every wave (shard 0 decides); the ledgers are exact and the
    weights equal the reference fed who was first and the jumps. With shard 1 applying each
    decided wave 0.3 s late, VW 2's pull finds the shards at different clocks and pulls again
    until they agree: the weights are one clock's (a CI run under load once mixed them)."""
    plan = multi_vw_plan(_graph(), [(), (), ()], "mlp", BATCH, nm=2, D=0, n_shards=2)
    delays = ((2, 3, 1.0), (0, 9, 4.0), (1, 9, 4.0))
    cfg = dict(
        stage_fault=StageFault(stage=0, at_mb=0, delays=delays),
        shard_fault=ShardFault(1, lag_s=lag_s) if lag_s else None,
    )
    waves = 6
    result = _run(plan, 2 * waves, "backup", cfg, backups=1)
    stages = [v.stages[0] for v in result.vws]
    numbers = [[w for w, _ in s.pushes] for s in stages]  # each data wave's wave number
    dropped = {(k, w) for k, s in enumerate(stages) for _, w in s.dropped}
    ns = numbers[2]
    jump = next(d for d in range(len(ns) - 1) if ns[d + 1] > ns[d] + 1)  # VW 2 skipped waves
    ledgers = [Counter((e.vw, e.wave) for e in st.ledger) for st in result.states]
    assert len(ledgers) == 2 and ledgers[0] == ledgers[1]  # the same VWs at both shards
    applied = ledgers[0]
    assert all(n == 1 for n in applied.values()) and all(st.clock == waves for st in result.states)
    assert (2, ns[jump]) in dropped and any((2, w) in applied for w in ns[jump + 1 :])
    pushed = {(k, w) for k, ns in enumerate(numbers) for w in ns}
    assert dropped == pushed - set(applied) and not dropped & set(applied)
    assert all(len(ns) == len(set(ns)) and max(ns) < waves for ns in numbers)
    ref, losses = _fed_reference(result, waves)
    _same(result.state_dict(), ref)
    for k in range(3):
        torch.testing.assert_close(result.vws[k].losses, losses[k], rtol=1e-5, atol=1e-6)


def test_the_stages_of_a_late_vw_jump_together() -> None:
    """VWs of 2 stages, 2 shards: each stage pulls at its own time, yet every stage of a VW
    numbers its waves the same (the jump agreed through the store), each VW-wave is applied
    at all its stages or none, and the run ends at its clock (nothing hangs)."""
    plan = multi_vw_plan(_graph(), [(4,), (4,), (4,)], "mlp", BATCH, nm=2, D=0, n_shards=2)
    delays = ((2, 3, 1.0), (0, 9, 3.0), (1, 9, 3.0))
    cfg = dict(stage_fault=StageFault(stage=1, at_mb=0, delays=delays))
    waves = 6
    result = _run(plan, 2 * waves, "backup", cfg, backups=1, return_state=True)
    for v in result.vws:
        first, second = ([w for w, _ in s.pushes] for s in v.stages)
        assert first == second and v.stages[0].steps == v.stages[1].steps
    assert any(
        b > a + 1 for a, b in itertools.pairwise(w for w, _ in result.vws[2].stages[0].pushes)
    )
    for st in result.states:
        assert st.clock == waves
        per = Counter((e.vw, e.wave) for e in st.ledger)
        assert all(n == 2 for n in per.values())  # both stages of a counted VW, once each
    applied = {(e.vw, e.wave) for e in result.states[0].ledger}
    assert applied == {(e.vw, e.wave) for e in result.states[1].ledger}
    # the reference, each stage's parameters from the clock that stage pulled (its last pull
    # after the push of wave c: need c + 1, or the agreed jump J when its reply was older)
    numbers = [[w for w, _ in v.stages[0].pushes] for v in result.vws]
    nxt = [[*ns[1:], waves] for ns in numbers]

    def pulled(k: int, d: int, s: int) -> int:
        wanted = (numbers[k][d] + 1, nxt[k][d])
        return max(g for n, g in result.vws[k].stages[s].clocks if n in wanted)

    stage_names = [set(s.state) for s in result.vws[0].stages]
    ref, _ = backup_reference(
        3, 2, waves,
        lambda c: sorted(k for k, w in applied if w == c),
        pulled,
        lambda k, d: numbers[k][d] if d < len(numbers[k]) else waves,
        [v.stages[0].steps // 2 for v in result.vws],
        lambda name: 0 if name in stage_names[0] else 1,
    )  # fmt: skip
    _same(result.state_dict(), ref)


def test_backup_without_backups_is_wsp_d0(tmp_path: Path) -> None:
    """b = 0 is WSP at D = 0 on the same data (backup's: each VW its slice of every global
    minibatch, so what a dropped push loses is a different sample every epoch)."""
    plan = multi_vw_plan(_graph(), [(4,), (6,)], "mlp", BATCH, nm=2, D=0, n_shards=2)
    result = _run(plan, 8, "backup", backups=0)
    ref, _ = wsp_reference(2, 2, 4, rule="backup")
    _same(result.state_dict(), ref)
    assert dropped_vw_waves(result.vws) == 0
    other, _ = wsp_reference(2, 2, 4)  # WSP's own data (a shard per VW) gives other weights
    assert any(not torch.allclose(other[n], t) for n, t in ref.items())


def test_under_backup_the_vws_share_every_global_minibatch_and_wsp_does_not() -> None:
    """Backup's data rule: in every minibatch the VWs' samples are disjoint slices of one
    global minibatch of the whole split, and over an epoch every sample is trained once by
    some VW; a late VW (always the same one on a heterogeneous cluster) thus loses different
    samples every epoch. WSP's VWs keep their own shards."""
    n = 3
    backup, wsp = _sources(n, 0, "backup"), _sources(n, 0, "wsp")
    per_epoch = backup[0].steps_per_epoch
    for e in range(2):
        seen: list[int] = []
        for p in range(e * per_epoch + 1, (e + 1) * per_epoch + 1):
            idx = [backup[k].indices(p) for k in range(n)]
            assert all(len(i) == BATCH for i in idx)
            seen += [i for ix in idx for i in ix]
        assert len(seen) == len(set(seen)) == per_epoch * n * BATCH
    late_first, late_second = (
        {i for p in range(e * per_epoch + 1, e * per_epoch + 4) for i in backup[2].indices(p)}
        for e in (0, 1)
    )
    assert late_first != late_second  # the late VW's samples change from epoch to epoch
    shards = [set(w.dataset.indices) for w in wsp]  # type: ignore[attr-defined]
    assert not shards[0] & shards[1] and not shards[1] & shards[2]


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


def test_easgd_snapshots_and_resumes_exactly(tmp_path: Path) -> None:
    """EASGD writes snapshots (the centre at the shards, each stage's own weights, optimizer
    and RNG state) at exchange clocks; a run killed mid-way and resumed equals the
    uninterrupted one bit for bit (Nm = 1, D = 0: no stashed versions, fixed summation
    order), with SGD momentum so that a lost optimizer state would show."""
    plan = multi_vw_plan(_graph(), [(4,), (6,)], "mlp", BATCH, nm=1, D=0, n_shards=2)
    plan = dataclasses.replace(plan, sync="easgd", sync_params=(("alpha", 0.25), ("tau", 2.0)))
    opt = OptimizerConfig(lr=LR, momentum=0.5)

    def run(out: Path) -> RunConfig:
        return RunConfig(steps=8, timeout_s=15.0, emulate=False, out_dir=out)

    whole = launch(plan, SOURCE, spec(opt, run(tmp_path / "whole")))
    out = tmp_path / "cut"
    with pytest.raises(HetPipeRuntimeError):
        launch(plan, SOURCE, spec(opt, run(out), checkpoint_every=1, stage_fault=StageFault(0, 7)))  # fmt: skip
    clocks = committed_clocks(out / "checkpoints")  # exchanges after waves 1, 3, 5: clocks 1-3
    assert clocks and clocks[-1] <= 3  # (the kill races the shards' last writes)
    resumed = launch(plan, SOURCE, spec(opt, run(out), checkpoint_every=1, resume=True))
    start = waves_at(clocks[-1], 2)
    assert [vw.steps for vw in resumed.vws] == [8 - start] * 2
    ref = whole.state_dict()
    for name, t in resumed.state_dict().items():
        assert torch.equal(t, ref[name]), name
    for k in range(2):  # and each VW's losses after the resume
        assert resumed.vws[k].losses == whole.vws[k].losses[start:]


def test_easgd_stops_on_a_time_limit_at_one_agreed_wave() -> None:
    """EASGD under ``--time-limit``: every VW stops at the same wave, on an exchange
    (:func:`planner.easgd.stop_waves`: WSP's stop wave let a VW run past it under load, since
    EASGD's VWs wait for each other only at exchanges), the shards at the same exchange
    count, and the exported centre equals the single-process reference of that many waves."""
    plan = multi_vw_plan(_graph(), [(4,), (6,)], "mlp", BATCH, nm=2, D=0, n_shards=2)
    plan = dataclasses.replace(plan, sync="easgd", sync_params=(("alpha", 0.25), ("tau", 2.0)))
    run = RunConfig(time_limit_s=2.0, timeout_s=15.0, emulate=False, return_state=True)
    result = launch(plan, SOURCE, spec(OptimizerConfig(lr=LR), run))
    steps = {s.steps for v in result.vws for s in v.stages}
    (trained,) = steps  # one agreed stop for every stage of every VW
    assert trained > 0 and trained % 2 == 0
    waves = trained // 2
    assert waves >= 2 and waves % 2 == 0  # at least one exchange; it ends on an exchange
    assert {s.clock for s in result.states} == {waves_at_exchanges(waves, 2)}
    ref, _ = easgd_reference(2, 2, waves, 2, 0.25)
    _same(result.state_dict(), ref)


def waves_at_exchanges(waves: int, tau: int) -> int:
    """Exchanges made in ``waves`` waves (one after every ``tau``-th)."""
    return sum(1 for c in range(waves) if exchanges_after(c, tau))
