"""A tied parameter through the WSP parameter servers: GPT-2's ``wte``/``lm_head`` over
2 VWs x 2 stages equals a single-process WSP reference, the two copies of each VW bit-equal."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import Tensor, nn
from torch.func import functional_call
from torch.testing import assert_close

from hetpipe.api import _module_source, train
from planner.manual import multi_vw_plan
from profiler.graph import ModelGraph
from runtime.config import OptimizerConfig
from runtime.data import MinibatchSource
from runtime.launch.wsp import split_data
from runtime.results.run_result import RunResult
from runtime.stage.model import reference_module, resolve_source
from tests.runtime.test_hf_models import TokenData, gpt2

pytestmark = pytest.mark.timeout(120)

BATCH, LR, TIED = 4, 0.1, "transformer.wte.weight"


def wsp_reference(
    model: nn.Module, data: TokenData, n_vws: int, nm: int, waves: int
) -> tuple[dict[str, Tensor], list[list[float]], list[dict[str, Tensor]]]:
    """Single-process WSP with D = 0, plain SGD, keyword inputs and the model's own loss:
    each VW's minibatch p runs on its version p - Nm; at each wave end the global weights add
    every VW's wave delta (VW order) and every VW continues from them.

    Returns:
        The global weights, each VW's losses, each VW's own weights after its last update.
    """
    source = _module_source(model, data, None, BATCH)
    module, names, loss_fn = reference_module(source, BATCH, 0)
    graph = ModelGraph.from_spec(resolve_source(source, BATCH, meta=False))
    shards, _ = split_data(data, n_vws, 0.2, 0)
    feeds = [MinibatchSource(s, BATCH, 0, (), input_names=graph.input_names) for s in shards]
    w0 = {n: p.detach().clone() for n, p in module.named_parameters()}
    glob = dict(w0)
    history = [[w0] for _ in range(n_vws)]
    losses: list[list[float]] = [[] for _ in range(n_vws)]
    for c in range(waves):
        deltas = []
        for k in range(n_vws):
            start = history[k][-1]
            for p in range(c * nm + 1, (c + 1) * nm + 1):
                w = {n: t.clone().requires_grad_() for n, t in history[k][max(0, p - nm)].items()}
                x, y = feeds[k].batch(p)
                loss = loss_fn(functional_call(module, w, tuple(x)), y)
                grads = torch.autograd.grad(loss, list(w.values()))
                master = history[k][-1]
                step = dict(zip(w, grads, strict=True))
                history[k].append({n: master[n].add(step[n], alpha=-LR) for n in w})
                losses[k].append(float(loss.detach()))
            deltas.append({n: history[k][-1][n] - start[n] for n in w0})
        for d in deltas:
            glob = {n: glob[n] + d[n] for n in glob}
        if c < waves - 1:  # the last wave's pull is not folded: no minibatch needs it
            for k in range(n_vws):
                history[k][-1] = {n: t.clone() for n, t in glob.items()}
    own = [{names[n]: t for n, t in history[k][-1].items()} for k in range(n_vws)]
    return {names[n]: t for n, t in glob.items()}, losses, own


@pytest.mark.parametrize("nm", [2])
def test_two_vws_tied_gpt2_equal_the_wsp_reference(nm: int) -> None:
    model, data = gpt2(), TokenData()
    reference = copy.deepcopy(model)
    source = _module_source(model, data, None, BATCH)
    graph = ModelGraph.from_spec(resolve_source(source, BATCH, meta=False))
    cut = len(graph.layers) // 2
    plan = multi_vw_plan(graph, [(cut,), (cut,)], "gpt2", BATCH, nm=nm, D=0, n_shards=2)
    waves = 3
    result = train(
        model, data, plan=plan, staleness=0, nm=nm, steps=waves * nm, optimizer=OptimizerConfig(lr=LR),
        emulate=False, timeout=20.0,
    )  # fmt: skip
    assert isinstance(result, RunResult)
    ref, losses, own = wsp_reference(reference, data, 2, nm, waves)
    for k in range(2):
        assert_close(result.vws[k].losses, losses[k], rtol=1e-5, atol=1e-5)
    state = result.state_dict()
    for n, t in ref.items():
        assert_close(state[n], t, rtol=1e-5, atol=1e-5)
    for k in range(2):
        copies = [st.state[TIED] for st in result.vws[k].stages if TIED in st.state]
        assert len(copies) == 2
        assert torch.equal(copies[0], copies[1])  # the VW's two copies are bit-equal
        assert_close(copies[0], own[k][TIED], rtol=1e-5, atol=1e-5)
