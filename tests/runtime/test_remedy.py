"""Staleness remedies in a stage's weights, without processes: a no-op at Nm = 1 (bit-equal),
and at Nm > 1 the single-process rule whatever the valid task order."""

from __future__ import annotations

import random

import pytest
import torch
from torch import Tensor, nn
from torch.testing import assert_close

from planner.rules import ALONE_RULE
from planner.staleness import pipemare_lr, predict_scale, remedy_weight_copies, stage_delay
from profiler.errors import ConfigError
from runtime.config import OptimizerConfig
from runtime.stage.weights import VersionedWeights, lr_at, predict_syncing
from runtime.sync.rule import SyncSpec


def _grad(w: Tensor, mb: int) -> Tensor:
    return torch.sin(w * mb) + 0.1 * mb  # depends on the weights used: catches wrong ones


def _drive(
    cfg: OptimizerConfig, nm: int, steps: int, order_seed: int, syncing: tuple[int, int] = (1, 0)
) -> Tensor:
    """Train one stage's weights through ``VersionedWeights`` in a random valid task order."""
    p = nn.Parameter(torch.linspace(-1, 1, 5))
    vw = VersionedWeights({"w": p}, nm, cfg, total_updates=steps, syncing=syncing)
    rng = random.Random(order_seed)
    next_f = next_b = 1
    used: dict[int, Tensor] = {}
    while next_b <= steps:
        can_f = next_f <= steps and next_f - nm < next_b  # B(next_f - nm) done (admission)
        if can_f and (next_b == next_f or rng.random() < 0.5):
            used[next_f] = vw.acquire(next_f)["w"]
            next_f += 1
        else:
            vw.update(next_b, {"w": _grad(used.pop(next_b).detach(), next_b)})
            next_b += 1
    return p.detach().clone()


def _reference(
    cfg: OptimizerConfig, nm: int, steps: int, syncing: tuple[int, int] = (1, 0)
) -> Tensor:
    """Delayed SGD written out: minibatch p's gradient at the version ``v = max(0, p - nm)``,
    predicted ``s`` updates ahead with that version's velocity (``predict``), applied with the
    stage's PipeMare step size (``pipemare``)."""
    w = torch.linspace(-1, 1, 5)
    buf = torch.zeros(5)
    history = [(w.clone(), buf.clone())]
    for mb in range(1, steps + 1):
        v = max(0, mb - nm)
        w_v, vel_v = history[v]
        if cfg.remedy == "predict":
            w_v = w_v - predict_scale(mb, nm, lr_at(cfg, v, steps), *syncing) * vel_v
        g = _grad(w_v, mb)
        lr = lr_at(cfg, mb - 1, steps)
        if cfg.remedy == "pipemare":
            lr = pipemare_lr(lr, mb - 1, stage_delay(nm), cfg.remedy_warmup)
        buf = cfg.momentum * buf + g if (cfg.momentum and mb > 1) else g
        w = w - lr * buf
        history.append((w.clone(), buf.clone()))
    return w


@pytest.mark.parametrize("remedy", ["predict", "pipemare"])
@pytest.mark.parametrize("momentum", [0.0, 0.9])
def test_remedy_is_exactly_a_no_op_at_nm1(remedy: str, momentum: float) -> None:
    base = OptimizerConfig(lr=0.1, momentum=momentum, lr_schedule="cosine")
    with_remedy = OptimizerConfig(
        lr=0.1, momentum=momentum, lr_schedule="cosine", remedy=remedy, remedy_warmup=4
    )
    assert torch.equal(_drive(with_remedy, 1, 10, 0), _drive(base, 1, 10, 0))


@pytest.mark.parametrize("remedy", ["predict", "pipemare"])
@pytest.mark.parametrize("momentum", [0.0, 0.9])
@pytest.mark.parametrize("nm", [2, 3, 5])
@pytest.mark.parametrize("order_seed", [0, 1])
def test_remedy_equals_its_single_process_rule(
    remedy: str, momentum: float, nm: int, order_seed: int
) -> None:
    cfg = OptimizerConfig(lr=0.1, momentum=momentum, remedy=remedy, remedy_warmup=6)
    got = _drive(cfg, nm, 14, order_seed)
    assert_close(got, _reference(cfg, nm, 14), rtol=1e-6, atol=1e-6)
    if remedy == "predict" or nm > 2:  # PipeMare's delay is 1 at Nm = 2: nothing to reschedule
        assert not torch.allclose(
            got, _drive(OptimizerConfig(lr=0.1, momentum=momentum), nm, 14, 0)
        )


@pytest.mark.parametrize("syncing", [(4, 0), (2, 1)])
def test_predict_with_several_vws_is_a_no_op_at_nm1(syncing: tuple[int, int]) -> None:
    cfg = OptimizerConfig(lr=0.1, momentum=0.9, remedy="predict")
    got = _drive(cfg, 1, 10, 0, syncing)
    assert torch.equal(got, _drive(OptimizerConfig(lr=0.1, momentum=0.9), 1, 10, 0))


@pytest.mark.parametrize("momentum", [0.0, 0.9])
@pytest.mark.parametrize("nm", [2, 3])
@pytest.mark.parametrize("syncing", [(4, 0), (2, 1)])
def test_predict_counts_the_other_vws_updates(
    momentum: float, nm: int, syncing: tuple[int, int]
) -> None:
    """With several VWs the prediction reaches over the others' updates not pulled yet: the
    single-process rule with :func:`planner.staleness.predict_steps`' whole count, not the
    one-VW prediction."""
    cfg = OptimizerConfig(lr=0.02, momentum=momentum, remedy="predict")  # s ~ 10: a small lr
    got = _drive(cfg, nm, 14, 1, syncing)
    assert_close(got, _reference(cfg, nm, 14, syncing), rtol=1e-6, atol=1e-6)
    assert not torch.allclose(got, _drive(cfg, nm, 14, 1))


def test_predict_syncing_is_the_rules_delay_count() -> None:
    wsp = SyncSpec(rule="wsp", D=2)
    assert predict_syncing(wsp, 4) == (4, 2)
    assert predict_syncing(SyncSpec(rule="backup", params=(("backups", 1.0),)), 4) == (3, 0)
    assert predict_syncing(SyncSpec(rule="easgd", D=0), 4) == (1, 0)  # no delay count
    assert predict_syncing(SyncSpec(rule=ALONE_RULE), 1) == (1, 0)
    assert predict_syncing(SyncSpec(rule="allreduce"), 4) == (1, 0)


def test_predict_keeps_at_most_nm_versions() -> None:
    """Every in-flight minibatch runs on its own predicted copy: Nm copies besides the master
    (one more than weight stashing alone, whose newest version is the master itself)."""
    cfg = OptimizerConfig(lr=0.1, momentum=0.9, remedy="predict")
    p = nn.Parameter(torch.zeros(3))
    vw = VersionedWeights({"w": p}, 3, cfg)
    for mb in range(1, 4):
        vw.acquire(mb)
    for mb in range(1, 9):
        vw.update(mb, {"w": torch.ones(3)})
        vw.acquire(mb + 3)
        assert vw.stashed_versions <= 3
    assert vw.stashed_versions == 3


def test_bad_remedies_are_one_line_config_errors() -> None:
    with pytest.raises(ConfigError, match="remedy 'later' is unknown: use one of none, predict"):
        OptimizerConfig(remedy="later")
    with pytest.raises(ConfigError, match="--remedy predict follows SGD's update rule, not adam"):
        OptimizerConfig(name="adam", remedy="predict")


def test_train_takes_the_remedy() -> None:
    import hetpipe

    # checked by the options table, as hetpipe run checks --remedy
    with pytest.raises(ConfigError, match=r"^--remedy 'later': use one of none, predict, pipemare"):
        hetpipe.train("mlp", steps=1, remedy="later")


@pytest.mark.parametrize("nm", [1, 2, 3, 4])
@pytest.mark.parametrize("syncing", [(4, 0), (2, 3)])
def test_several_vws_keep_what_the_planner_counts(nm: int, syncing: tuple[int, int]) -> None:
    """Predicting over the other VWs' updates keeps no more copies than one VW's prediction
    (:func:`planner.staleness.remedy_weight_copies`, which does not know the VWs)."""
    from tests.runtime.test_remedy_memory import _peak_copies

    p = {"w": nn.Parameter(torch.randn(64))}
    cfg = OptimizerConfig(lr=0.1, momentum=0.9, remedy="predict")
    vw = VersionedWeights(p, nm, cfg, syncing=syncing)
    peak, updated = 0, 0
    for mb in range(1, 13):
        vw.acquire(mb)
        storages = {t.data_ptr() for version in vw._versions.values() for t in version.values()}
        peak = max(peak, len(storages | {p["w"].data_ptr()}))
        if mb - updated >= nm:
            updated += 1
            vw.update(updated, {"w": torch.randn(64)})
    assert peak == _peak_copies(nm, "predict", 0.9) == nm + remedy_weight_copies("predict", nm, 1)


def test_the_launcher_gives_each_stage_the_vws_it_predicts_over() -> None:
    from planner.manual import cpu_cluster, multi_vw_plan
    from profiler.graph import ModelGraph
    from runtime.config import ModelSource, RunConfig
    from runtime.launch.jobs import Attempt, Prepared
    from runtime.launch.launcher import prepare
    from runtime.spec import RunSpec
    from runtime.stage.model import resolve_source

    source = ModelSource(ref="mlp")
    graph = ModelGraph.from_spec(resolve_source(source, 8, meta=True))
    plan = multi_vw_plan(graph, [[2], [2]], "mlp", 8, 2, cluster=cpu_cluster(4), D=1)
    for spec, want in [(RunSpec(RunConfig(steps=2)), (2, 1)), (RunSpec(RunConfig(), vw=0), (1, 0))]:
        prep = prepare(plan, source, spec, None, Attempt("file:///nonexistent"))
        assert isinstance(prep, Prepared)
        assert {j.ctx.syncing for j in prep.stages} == {want}


def test_the_several_vw_reference_with_one_vw_is_the_one_vw_reference() -> None:
    from benchmarks.remedy_convergence import self_check
    from runtime.data import DigitsDataset
    from runtime.results.evaluation import split_dataset

    train_set, test = split_dataset(DigitsDataset(), 0.2, seed=0)
    self_check(train_set, test, 8)  # raises on a difference
