"""Plans made on the fly: one planner function, which ``hetpipe run CLUSTER.yaml`` asks
instead of re-deriving the planner's defaults."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
from typer.testing import CliRunner

from planner.manual import balanced_cuts, hand_cut_plan
from planner.on_the_fly import PlanRequest, plan_for_run
from profiler.errors import ConfigError
from profiler.graph import ModelGraph
from profiler.models import resolve_model_for_graph

CLUSTER = Path(__file__).resolve().parents[2] / "examples" / "emulated_cluster.yaml"


def test_a_hand_cut_is_one_vw_of_balanced_stages() -> None:
    graph = ModelGraph.from_spec(resolve_model_for_graph("mlp", 8))
    plan = plan_for_run(None, PlanRequest("mlp", 8, stages=2, precision="bf16"))
    assert plan == replace(hand_cut_plan(graph, "mlp", 8, 0, None, 2), precision="bf16")
    (vw,) = plan.virtual_workers
    assert tuple(st.first_index for st in vw.stages[1:]) == balanced_cuts(graph, 2)


def test_an_on_the_fly_plan_counts_the_remedys_weight_copies() -> None:
    """``hetpipe run CLUSTER.yaml --remedy predict``: ``predict``'s extra weight copies are in
    the memory model, so MODEL fits Nm 2 without it and only Nm 1 with it (as
    tests/planner/test_memory_plan.py plans it by hand)."""
    from hetpipe.planning import profiles_for
    from planner.cluster import load_cluster

    cluster, model = load_cluster(CLUSTER), "mlp(hidden=400,depth=8)"
    profiles = profiles_for(cluster, [], model, 32)
    asked = PlanRequest(model, 32, vws=1, policy="ed", optimizer="sgd")
    none = plan_for_run(cluster, asked, profiles=profiles)
    predict = plan_for_run(cluster, replace(asked, remedy="predict"), profiles=profiles)
    assert (none.nm, none.remedy, predict.nm, predict.remedy) == (2, "none", 1, "predict")


def test_stages_with_several_vws_is_refused_naming_the_flags() -> None:
    with pytest.raises(ConfigError, match=r"^--stages hand-cuts one VW; drop --stages"):
        plan_for_run(None, PlanRequest("mlp", 8, stages=2, vws=2))


@pytest.mark.parametrize(
    ("flags", "asked"),
    [
        (["--vws", "2", "--policy", "hd", "--nm", "2", "--D", "1"],
         PlanRequest("mlp", 16, nm=2, vws=2, policy="hd", D=1)),
        (["--stages", "3"], PlanRequest("mlp", 16, stages=3)),
        (["--sync", "allreduce", "--momentum", "0.9"],
         PlanRequest("mlp", 16, sync="allreduce", optimizer="momentum")),
        (["--sync", "allreduce"], PlanRequest("mlp", 16, sync="allreduce", optimizer="sgd")),
        (["--remedy", "predict"], PlanRequest("mlp", 16, remedy="predict")),
    ],
)  # fmt: skip
def test_hetpipe_run_asks_the_planner_for_a_cluster_file(
    flags: list[str], asked: PlanRequest, monkeypatch: pytest.MonkeyPatch
) -> None:
    from hetpipe.cli import app

    seen: list[PlanRequest] = []

    def planned(cluster: object, request: PlanRequest, *given: object) -> None:
        seen.append(request)
        raise ConfigError("planned")

    monkeypatch.setattr("planner.on_the_fly.plan_for_run", planned)
    res = CliRunner().invoke(app, ["run", str(CLUSTER), "--batch-size", "16", *flags])
    assert res.exit_code == 2 and "planned" in res.output
    assert seen == [asked]
