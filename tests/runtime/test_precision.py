"""``--precision bf16``: autocast with fp32 master weights, bfloat16 activations across cuts;
the planner's bytes and the resume check follow it."""

from __future__ import annotations

import copy

import pandas as pd
import pytest
import torch
from torch.testing import assert_close

from hetpipe.api import train
from planner.manual import balanced_cuts, manual_plan
from planner.plan import Plan
from profiler.errors import ConfigError, ProfileError
from profiler.graph import ModelGraph
from profiler.table import COLUMNS, Profile, ProfileMeta
from runtime.config import ModelSource, OptimizerConfig
from runtime.data import MinibatchSource
from runtime.persist.run_dir import check_settings, job_settings
from runtime.results.run_result import RunResult
from runtime.stage.comm import cut_specs
from runtime.stage.model import resolve_source

BATCH, STEPS, LR = 4, 6, 0.1


def autocast_loop(
    model: torch.nn.Module, data: MinibatchSource, names: tuple[str, ...], enabled: bool = True
) -> tuple[list[float], dict[str, torch.Tensor]]:
    """One process: forward (the model's own loss) under bfloat16 autocast, fp32 weights and
    optimizer (``enabled=False``: all float32)."""
    model.train()
    opt = torch.optim.SGD(model.parameters(), lr=LR, foreach=True)
    losses = []
    for p in range(1, STEPS + 1):
        inputs, _ = data.batch(p)
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=enabled):
            loss = model(**dict(zip(names, inputs, strict=True))).loss
        loss.backward()
        opt.step()
        losses.append(float(loss.item()))
    return losses, {n: q.detach().clone() for n, q in model.named_parameters()}


@pytest.mark.timeout(120)
def test_bf16_pipeline_trains_and_equals_an_autocast_reference() -> None:
    pytest.importorskip("transformers")
    from tests.runtime.test_hf_models import TokenData, gpt2

    model, data = gpt2(), TokenData(n=BATCH)  # one minibatch, seen again every step
    reference, fp32_reference = copy.deepcopy(model), copy.deepcopy(model)
    cfg = OptimizerConfig(lr=LR)
    result = train(
        model, data, stages=2, nm=1, batch_size=BATCH, steps=STEPS, optimizer=cfg,
        precision="bf16",
    )  # fmt: skip
    assert isinstance(result, RunResult)
    names = ("input_ids", "labels", "attention_mask")
    feed = MinibatchSource(data, BATCH, 0, (), input_names=names)
    losses, params = autocast_loop(reference, feed, names)
    fp32_losses, _ = autocast_loop(fp32_reference, feed, names, enabled=False)
    got = torch.tensor(result.losses)
    assert (got - torch.tensor(losses)).abs().max() < (got - torch.tensor(fp32_losses)).abs().max()
    assert result.losses[-1] < result.losses[0]  # it trains
    # the cut rounds activations to bfloat16 that the reference keeps in float32 (layer norm,
    # residual adds): equal within bfloat16's precision, not bit for bit
    assert_close(torch.tensor(result.losses), torch.tensor(losses), rtol=2e-2, atol=2e-2)
    state = result.state_dict()
    for n, p in params.items():
        assert state[n].dtype == torch.float32  # fp32 master weights
        assert_close(state[n], p, rtol=2e-2, atol=2e-2)


def test_floats_cross_cuts_in_bf16_ints_unchanged() -> None:
    graph = ModelGraph.from_spec(resolve_source(ModelSource(ref="mlp"), 4, meta=True))
    cut = balanced_cuts(graph, 2)[0]
    fp32, bf16 = cut_specs(graph, cut), cut_specs(graph, cut, "bf16")
    assert [s.dtype for s in fp32] == [torch.float32] * len(fp32)
    assert [s.dtype for s in bf16] == [torch.bfloat16] * len(bf16)


def _profile(dtype: str = "float32") -> Profile:
    table = pd.DataFrame(
        [
            {"layer": "x", "op": "placeholder", "inputs": "", "act_bytes": 400},
            {
                "layer": "fc",
                "op": "Linear",
                "inputs": "x",
                "act_bytes": 800,
                "saved_bytes": 400,
                "param_bytes": 1000,
            },
            {"layer": "output", "op": "output", "inputs": "fc"},
        ]
    )
    for col, kind in COLUMNS.items():
        table[col] = table[col].fillna("" if kind == "str" else 0) if col in table else 0
    return Profile(table.astype(COLUMNS), ProfileMeta("m", "cpu", 4, dtype=dtype))


def test_a_float32_profile_planned_in_bf16_halves_bytes_and_adds_the_weight_copy() -> None:
    bf16 = _profile().at_precision("bf16")
    assert bf16.meta.dtype == "bfloat16"
    assert bf16.table["act_bytes"].tolist() == [200, 400, 0]
    assert bf16.table["saved_bytes"].tolist() == [0, 200 + 500, 0]
    assert _profile().at_precision("fp32") is not None
    with pytest.raises(ProfileError, match="--precision fp32"):
        _profile("bfloat16").at_precision("fp32")


def test_the_plan_records_precision_and_resume_checks_it() -> None:
    graph = ModelGraph.from_spec(resolve_source(ModelSource(ref="mlp"), 4, meta=True))
    plan = manual_plan(graph, balanced_cuts(graph, 2), "mlp", 4, 1)
    from dataclasses import replace

    bf = replace(plan, precision="bf16")
    assert Plan.from_dict(bf.to_dict()).precision == "bf16"
    assert Plan.from_dict(plan.to_dict()).precision == "fp32"
    opt = OptimizerConfig()
    then = dict(job_settings("mlp", "{}", 1, 0, 0, 0.2, "d", opt, 10, "bf16"))
    check_settings("resume", then, job_settings("mlp", "{}", 1, 0, 0, 0.2, "d", opt, 10, "bf16"))
    with pytest.raises(ConfigError, match=r"precision is float32 .* bfloat16 .*--precision"):
        check_settings("resume", then, job_settings("mlp", "{}", 1, 0, 0, 0.2, "d", opt, 10))
