"""One virtual worker trained by real processes equals a single-process reference.

Nm = 1 must match a plain PyTorch loop; Nm > 1 a loop whose updates land Nm minibatches late
(exact local staleness). Losses of every minibatch and the final weights are compared.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from torch.testing import assert_close

from planner.manual import balanced_cuts, manual_plan
from profiler.graph import ModelGraph
from runtime.config import ModelSource, OptimizerConfig, RunConfig
from runtime.data import MinibatchSource, default_dataset
from runtime.launch.launcher import launch
from runtime.stage.model import original_names, reference_module, resolve_source
from tests.runtime._spec import spec
from tests.runtime.reference import delayed_loop, plain_loop

RTOL = ATOL = 1e-5


def _run_and_reference(
    ref: str,
    batch_size: int,
    n_stages: int,
    nm: int,
    steps: int,
    cfg: OptimizerConfig,
    schedule: str = "hetpipe",
) -> None:
    source = ModelSource(ref=ref)
    model = resolve_source(source, batch_size, meta=True)
    graph = ModelGraph.from_spec(model)
    cuts = balanced_cuts(graph, n_stages)
    plan = replace(manual_plan(graph, cuts, ref, batch_size, nm), schedule=schedule)
    result = launch(
        plan, source, spec(cfg, RunConfig(steps=steps, seed=3, return_state=True, timeout_s=30))
    )

    module, names, loss_fn = reference_module(source, batch_size, seed=3)
    real = resolve_source(source, batch_size, meta=False)  # the stages' sample: its value ranges
    data = MinibatchSource(
        default_dataset(ref, real.inputs, real.targets, batch_size),
        batch_size,
        3,
        tuple(model.targets.shape),
    )
    if nm == 1:
        losses, params = plain_loop(module, data, loss_fn, cfg, steps)
    else:
        losses, params = delayed_loop(module, data, loss_fn, cfg, steps, nm)
    assert result.steps == steps
    assert result.remedy == cfg.remedy  # summary.json says which remedy trained
    assert len(result.losses) == steps
    assert_close(torch.tensor(result.losses), torch.tensor(losses), rtol=RTOL, atol=ATOL)
    state = result.state_dict()
    # the buffers too (batch-norm statistics: the reference's forwards ran in the same order)
    buffers = original_names(graph, module, buffers=True)
    expected = {names[n]: p for n, p in params.items()}
    expected |= {buffers[n]: b for n, b in module.named_buffers()}
    assert set(state) == set(expected)
    for n, p in expected.items():
        assert_close(state[n], p, rtol=RTOL, atol=ATOL, msg=f"{n} differs")
    assert max(s.max_in_flight for s in result.stages) <= nm
    assert result.stages[-1].max_in_flight == 1
    if schedule == "flush":  # stage 0 admits a wave once the previous one drained
        order = [(kind, mb) for kind, mb, _, _ in result.stages[0].task_log]
        for p in range(nm + 1, steps + 1):
            drained = (p - 1) // nm * nm
            assert order.index((order[0][0], p)) > order.index(("B", drained)), order


def test_mlp_three_stages_nm1_equals_plain_loop() -> None:
    _run_and_reference("mlp", 16, 3, 1, 8, OptimizerConfig(lr=0.1, momentum=0.9, weight_decay=1e-4))


@pytest.mark.parametrize(("nm", "schedule"), [(2, "flush"), (4, "hetpipe")])
def test_mlp_four_stages_delayed_updates(nm: int, schedule: str) -> None:
    """The flushing schedule changes when minibatches enter, not which weights they see."""
    cfg = OptimizerConfig(name="adam", lr=1e-3, lr_schedule="cosine")
    _run_and_reference("mlp", 8, 4, nm, 10, cfg, schedule)


@pytest.mark.parametrize(
    "cfg",
    [
        OptimizerConfig(lr=0.1, momentum=0.9, remedy="predict"),
        OptimizerConfig(lr=0.1, remedy="predict", lr_schedule="cosine"),
        OptimizerConfig(lr=0.1, momentum=0.9, remedy="pipemare", remedy_warmup=5),
    ],
    ids=["predict-momentum", "predict-plain", "pipemare"],
)
def test_mlp_three_stages_nm3_with_remedy(cfg: OptimizerConfig) -> None:
    """A staleness remedy in the stages equals the delayed loop with the same rule."""
    _run_and_reference("mlp", 8, 3, 3, 9, cfg)


def test_residual_cnn_two_stages_nm2() -> None:
    _run_and_reference(
        "resnet",
        4,
        2,
        2,
        6,
        OptimizerConfig(lr=0.05, momentum=0.9, lr_schedule="step", step_size=3),
    )


def test_transformer_two_stages_nm1_equals_plain_loop() -> None:
    _run_and_reference("transformer", 2, 2, 1, 5, OptimizerConfig(lr=0.05))


def test_pipeline_fills_nm_in_flight() -> None:
    """With Nm = 3 and 3 stages the first stage really holds 3 minibatches at some point."""
    source = ModelSource(ref="mlp")
    model = resolve_source(source, 8, meta=True)
    graph = ModelGraph.from_spec(model)
    plan = manual_plan(graph, balanced_cuts(graph, 3), "mlp", 8, 3)
    result = launch(plan, source, spec(None, RunConfig(steps=12, timeout_s=30)))
    assert result.stages[0].max_in_flight == 3
    assert [s.steps for s in result.stages] == [12, 12, 12]


def test_single_stage_nm1_equals_plain_loop() -> None:
    _run_and_reference("mlp", 16, 1, 1, 6, OptimizerConfig(lr=0.1))


def test_time_limit_stops_every_stage_at_the_same_minibatch() -> None:
    source = ModelSource(ref="mlp")
    graph = ModelGraph.from_spec(resolve_source(source, 8, meta=True))
    plan = manual_plan(graph, balanced_cuts(graph, 2), "mlp", 8, 2)
    result = launch(plan, source, spec(None, RunConfig(time_limit_s=1.0, timeout_s=30)))
    steps = [s.steps for s in result.stages]
    assert steps[0] >= 1 and len(set(steps)) == 1
    assert len(result.losses) == steps[0]
