"""One training entry: hetpipe.train and hetpipe run choose the launcher by the plan, and the
API runs every plan the CLI can (several VWs through the parameter servers, one VW, AllReduce)."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

import hetpipe
from hetpipe.planning import profiles_for
from planner.baseline import allreduce_plan
from planner.cluster import parse_cluster
from planner.manual import cpu_cluster, manual_plan, multi_vw_plan
from profiler.errors import ConfigError
from profiler.graph import ModelGraph
from runtime.config import ModelSource, RunConfig
from runtime.results.run_result import RunResult
from runtime.run import default_length, rule_for
from runtime.stage.model import resolve_source


def _graph() -> ModelGraph:
    return ModelGraph.from_spec(resolve_source(ModelSource(ref="mlp"), 8, meta=True))


def test_the_plan_chooses_the_rule() -> None:
    g = _graph()
    two = multi_vw_plan(g, [[2], [2]], "mlp", 8, 1, cluster=cpu_cluster(4))
    assert rule_for(two) == "wsp" and rule_for(two, vw=1) == "local"
    one = manual_plan(g, [2], "mlp", 8, 1)
    assert rule_for(one) == "local"
    bare = multi_vw_plan(g, [[2], [2]], "mlp", 8, 1, cluster=cpu_cluster(4))
    bare = type(bare)(**{**bare.__dict__, "shards": ()})
    with pytest.raises(ConfigError, match="2 VWs but no parameter-server shards"):
        rule_for(bare)
    cluster = parse_cluster(
        {"name": "t", "nodes": [{"name": "A", "gpu": "TITAN V", "count": 2,
                                 "emulate": {"speed": 0.5, "memory": "8MiB"}}]}
    )  # fmt: skip
    ar = allreduce_plan(cluster, "mlp", 8, profiles=profiles_for(cluster, [], "mlp", 8))
    assert rule_for(ar) == "allreduce"
    with pytest.raises(ConfigError, match="drop --vw"):
        rule_for(ar, vw=0)


def test_several_vws_train_40_epochs_unless_told() -> None:
    g = _graph()
    two = multi_vw_plan(g, [[2], [2]], "mlp", 8, 1, cluster=cpu_cluster(4))
    assert default_length(RunConfig(), two, "wsp").epochs == 40
    assert default_length(RunConfig(steps=3), two, "wsp").epochs == 0
    assert default_length(RunConfig(), manual_plan(g, [2], "mlp", 8, 1), "single").epochs == 0


def test_the_api_trains_a_multi_vw_plan_through_the_parameter_servers() -> None:
    """hetpipe.train used to train VW 0 alone, without parameter servers, given such a plan."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    data = TensorDataset(torch.randn(256, 8), torch.randint(0, 4, (256,)))
    g = ModelGraph.from_module(model, (torch.randn(8, 8),))
    plan = multi_vw_plan(g, [[2], [2]], "model", 8, 1, cluster=cpu_cluster(4))
    result = hetpipe.train(model, data, nn.functional.cross_entropy, plan=plan, steps=4)
    assert isinstance(result, RunResult)
    assert len(result.vws) == 2 and all(vw.steps == 4 for vw in result.vws)
    assert set(result.state_dict()) == {n for n, _ in model.named_parameters()}
