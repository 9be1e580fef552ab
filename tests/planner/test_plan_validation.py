"""Plan validation: impossible plans are refused on load with one line naming the field."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from hetpipe.cli import app
from planner.cluster import parse_cluster
from planner.plan import GpuSlot, Plan, Prediction, ShardPlan, StagePlan, VirtualWorker
from planner.plan_check import check_plan_layers, validate_plan
from planner.plan_file import load_plan
from profiler.errors import ConfigError, PlanError

LAYERS = [f"l{i}" for i in range(6)]


def _stage(gpu: int, first: int, last: int) -> StagePlan:
    return StagePlan(
        gpu=gpu,
        first_layer=LAYERS[first],
        last_layer=LAYERS[last],
        first_index=first,
        last_index=last,
        fwd_ms=1.0,
        bwd_ms=2.0,
        recv_fwd_ms=0.1,
        recv_bwd_ms=0.1,
        recv_bytes=1000,
        send_bytes=1000,
        param_bytes=4000,
        in_flight=2,
        memory_bytes=2**20,
        capacity_bytes=2**30,
    )


def good_plan() -> Plan:
    """Two VWs of two T4s (nodes A and B), six layers cut after layer 2, one shard per node."""
    cluster = parse_cluster(
        {"nodes": [{"name": "A", "gpu": "T4", "count": 2}, {"name": "B", "gpu": "T4", "count": 2}]}
    )
    mem = cluster.nodes[0].memory_bytes
    vws = tuple(
        VirtualWorker(
            id=k,
            gpus=(GpuSlot("A", k, "T4", mem), GpuSlot("B", k, "T4", mem)),
            stages=(_stage(0, 0, 2), _stage(1, 3, 5)),
            nm_max=4,
            throughput=100.0,
        )
        for k in range(2)
    )
    return Plan(
        model="mlp",
        batch_size=32,
        policy="hd",
        nm=2,
        D=0,
        placement="default",
        cluster=cluster,
        virtual_workers=vws,
        shards=(ShardPlan(0, "A", ("l0", "l1"), 8000), ShardPlan(1, "B", ("l4",), 4000)),
        predicted=Prediction(200.0, (100.0, 100.0)),
        num_layers=6,
    )


Doc = dict[str, Any]


def _stages(d: Doc, vw: int = 0) -> list[Doc]:
    return d["virtual_workers"][vw]["stages"]  # type: ignore[no-any-return]


def _set(path: str, value: object) -> Callable[[Doc], None]:
    """A mutation setting ``a.b[1].c`` (dots and [i]) to ``value``."""

    def mutate(d: Doc) -> None:
        keys = [
            int(k) if k.isdigit() else k for k in path.replace("[", ".").replace("]", "").split(".")
        ]
        target: Any = d
        for k in keys[:-1]:
            target = target[k]
        target[keys[-1]] = value

    return mutate


BAD: list[tuple[str, Callable[[Doc], None], str]] = [
    # (id, mutation of the good plan's document, fragment of the one-line message)
    (
        "overlap",
        _set("virtual_workers[1].stages[1].first_index", 1),
        "virtual_workers[1].stages[1].first_index: 1 overlaps stage 0 (ends at 2); start it at 3",
    ),
    (
        "gap",
        _set("virtual_workers[0].stages[1].first_index", 5),
        "virtual_workers[0].stages[1].first_index: 5 leaves layers 3..4 in no stage",
    ),
    (
        "first_not_0",
        _set("virtual_workers[0].stages[0].first_index", 1),
        "stages[0].first_index: 1 leaves layer 0 in no stage; start it at 0",
    ),
    (
        "short",
        _set("virtual_workers[0].stages[1].last_index", 4),
        "stages[1].last_index: 4 but the model's last layer is 5",
    ),
    (
        "past_layers",
        _set("virtual_workers[0].stages[1].last_index", 9),
        "stages[1].last_index: 9 is past the model's last layer (5)",
    ),
    (
        "reversed_range",
        _set("virtual_workers[0].stages[0].last_index", 0),
        "leaves layers 1..2 in no stage",
    ),
    (
        "inverted",
        _set("virtual_workers[0].stages[1].last_index", 2),
        "stages[1].last_index: 2 is before first_index 3 (a reversed range)",
    ),
    (
        "reversed_order",
        lambda d: _stages(d).reverse(),
        "stages[1].first_index: 0 is before stage 0's (3): list the stages in pipeline order",
    ),
    (
        "negative_index",
        _set("virtual_workers[0].stages[0].first_index", -1),
        "stages[0].first_index: -1 must be at least 0",
    ),
    (
        "unknown_node",
        _set("virtual_workers[0].gpus[1].node", "Z"),
        "virtual_workers[0].gpus[1].node: 'Z' is not a node of the plan's cluster",
    ),
    (
        "gpu_index",
        _set("virtual_workers[0].gpus[0].index", 2),
        "gpus[0].index: 2 but node 'A' has 2 GPUs (indices 0..1)",
    ),
    (
        "gpu_type",
        _set("virtual_workers[0].gpus[0].type", "A100"),
        "gpus[0].type: 'A100' but node 'A' has 'T4' GPUs",
    ),
    (
        "gpu_twice",
        _set("virtual_workers[1].gpus[0].index", 0),
        "virtual_workers[1].gpus[0]: GPU 'A':0 is already used by virtual_workers[0].gpus[0]",
    ),
    (
        "gpu_memory",
        _set("virtual_workers[0].gpus[0].memory_bytes", 2**40),
        "gpus[0].memory_bytes: 1099511627776 is more than node 'A'",
    ),
    (
        "stage_gpu",
        _set("virtual_workers[0].stages[1].gpu", 2),
        "stages[1].gpu: 2 but the VW has 2 GPUs (0..1)",
    ),
    (
        "same_gpu",
        _set("virtual_workers[0].stages[1].gpu", 0),
        "stages[1].gpu: GPU 0 already runs stage 0",
    ),
    (
        "memory",
        _set("virtual_workers[0].stages[0].memory_bytes", 2**31),
        "stages[0].memory_bytes: 2147483648 bytes do not fit the GPU's capacity of 1073741824",
    ),
    (
        "capacity",
        _set("virtual_workers[0].stages[0].capacity_bytes", 2**40),
        "stages[0].capacity_bytes: 1099511627776 is more than its GPU's memory_bytes",
    ),
    ("nm_0", _set("nm", 0), "nm: 0 must be at least 1"),
    ("batch_negative", _set("batch_size", -32), "batch_size: -32 must be at least 1"),
    ("D_negative", _set("D", -1), "D: -1 must be at least 0"),
    ("no_vw", _set("virtual_workers", []), "virtual_workers: the plan has none"),
    (
        "no_gpus",
        _set("virtual_workers[0].gpus", []),
        "virtual_workers[0].gpus: a virtual worker needs",
    ),
    (
        "no_stages",
        _set("virtual_workers[0].stages", []),
        "virtual_workers[0].stages: a virtual worker",
    ),
    (
        "nan_time",
        _set("virtual_workers[0].stages[0].fwd_ms", float("nan")),
        "stages[0].fwd_ms: nan must be a finite number",
    ),
    (
        "inf_time",
        _set("virtual_workers[0].stages[1].recv_bwd_ms", float("inf")),
        "stages[1].recv_bwd_ms: inf must be a finite number",
    ),
    (
        "negative_time",
        _set("virtual_workers[0].stages[0].bwd_ms", -2.0),
        "stages[0].bwd_ms: -2.0 must be at least 0",
    ),
    (
        "in_flight_0",
        _set("virtual_workers[0].stages[0].in_flight", 0),
        "stages[0].in_flight: 0 must be at least 1",
    ),
    (
        "string_time",
        _set("virtual_workers[0].stages[0].fwd_ms", "fast"),
        "virtual_workers[0].stages[0].fwd_ms: 'fast' is not a number",
    ),
    ("bool_count", _set("nm", True), "nm: True is not a whole number"),
    (
        "fraction",
        _set("virtual_workers[0].stages[0].send_bytes", 1.5),
        "stages[0].send_bytes: 1.5 is not a whole number",
    ),
    (
        "huge_int",
        _set("virtual_workers[0].stages[0].param_bytes", 10**30),
        "stages[0].param_bytes: 1000000000000000000000000000000 is out of range",
    ),
    (
        "missing",
        lambda d: d["virtual_workers"][0]["stages"][0].pop("fwd_ms"),
        "virtual_workers[0].stages[0].fwd_ms: missing",
    ),
    ("not_list", _set("shards", {"a": 1}), "shards: expected a list, got dict"),
    (
        "not_mapping",
        _set("virtual_workers[0].gpus[0]", "A:0"),
        "virtual_workers[0].gpus[0]: expected a mapping, got str",
    ),
    (
        "unknown_gpu_key",
        _set("virtual_workers[0].gpus[0].colour", "red"),
        "virtual_workers[0].gpus[0]: unknown field 'colour'",
    ),
    ("vw_id", _set("virtual_workers[1].id", 7), "virtual_workers[1].id: 7 should be 1"),
    ("shard_node", _set("shards[1].node", "C"), "shards[1].node: 'C' is not a node"),
    (
        "shard_layer_twice",
        _set("shards[1].layers", ["l1"]),
        "shards[1].layers: layer 'l1' is also in shard 0",
    ),
    (
        "style_tag",
        _set("virtual_workers[0].stages[0].first_layer", "[/path:553]"),
        "stages[0].first_layer: '[/path:553]' cannot be used: it holds '[/path:553]'",
    ),
    (
        "control_chars",
        _set("model", "mlp\n\x1b[31m"),
        r"model: 'mlp\n\x1b[31m' cannot be used: it is not printable text",
    ),
    ("version", _set("version", 99), "plan version 99 is not supported"),
    (
        "schedule",
        _set("schedule", "gpipe"),
        "schedule: unknown pipeline schedule 'gpipe'; choose one of hetpipe, flush",
    ),
    ("schedule_type", _set("schedule", 3), "schedule"),
    ("cluster", _set("cluster.nodes[0].count", 0), "cluster: nodes[0].count"),
]


@pytest.mark.parametrize(("mutate", "fragment"), [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_impossible_plan_is_one_line_naming_the_field(
    tmp_path: Path, mutate: Callable[[Doc], None], fragment: str
) -> None:
    doc = good_plan().to_dict()
    mutate(doc)
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(doc))
    with pytest.raises((PlanError, ConfigError)) as info:
        load_plan(path)
    message = str(info.value)
    assert message.startswith(f"{path}: ")
    assert "\n" not in message
    assert fragment in message


def test_good_plan_round_trips_through_yaml_and_json(tmp_path: Path) -> None:
    plan = good_plan()
    validate_plan(plan)
    for name in ("plan.yaml", "plan.json"):
        assert load_plan(plan.save(tmp_path / name)).to_dict() == plan.to_dict()


def test_schedule_is_recorded_by_name_and_old_files_have_hetpipes(tmp_path: Path) -> None:
    flushed = dataclasses.replace(good_plan(), schedule="flush")
    assert load_plan(flushed.save(tmp_path / "flush.yaml")).schedule == "flush"
    doc = good_plan().to_dict()
    assert doc["schedule"] == "hetpipe"
    del doc["schedule"]  # a plan file written before the field
    (tmp_path / "old.json").write_text(json.dumps(doc))
    assert load_plan(tmp_path / "old.json").schedule == "hetpipe"
    with pytest.raises(PlanError, match=r"^plan: schedule: unknown pipeline schedule 'gpipe'"):
        validate_plan(dataclasses.replace(good_plan(), schedule="gpipe"))


def test_plan_is_checked_against_the_model_layers() -> None:
    plan = good_plan()
    check_plan_layers(plan, LAYERS, "p.yaml", "the profile")
    with pytest.raises(PlanError, match="model of 6 layers but the profile has 5"):
        check_plan_layers(plan, LAYERS[:5], "p.yaml", "the profile")
    renamed = [*LAYERS[:3], "x3", *LAYERS[4:]]
    with pytest.raises(PlanError, match=r"stages\[1\]\.first_layer: 'l3' but layer 3 of"):
        check_plan_layers(plan, renamed, "p.yaml", "the profile")
    with pytest.raises(PlanError, match=r"shards\[1\]\.layers: 'l4' is not a layer"):
        check_plan_layers(plan, [*LAYERS[:4], "y", "l5"], "p.yaml", "the profile")


def test_simulate_refuses_an_impossible_plan_with_exit_2(tmp_path: Path) -> None:
    doc = good_plan().to_dict()
    BAD[0][1](doc)
    path = tmp_path / "plan.yaml"
    path.write_text(json.dumps(doc))
    for command in (["simulate", str(path), "--waves", "2"], ["run", str(path), "--steps", "1"]):
        result = CliRunner().invoke(app, command)
        assert result.exit_code == 2, result.output
        lines = result.output.strip().splitlines()
        assert len(lines) == 1 and "overlaps stage 0" in lines[0], result.output


def test_generated_plans_are_valid() -> None:
    """The plans other tests build by hand (simulator helper, runtime hand cuts) are valid."""
    import torch
    from torch import nn

    from planner.manual import multi_vw_plan
    from runtime.stage.model import ModelGraph
    from tests.planner.simplan import make_plan

    validate_plan(
        make_plan([[("V", 1.0, 2.0), ("R", 1.0, 2.0)], [("G", 3.0, 1.0), ("Q", 1, 1)]], 2)
    )
    net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4))
    graph = ModelGraph.from_module(net, (torch.randn(2, 8),))
    validate_plan(multi_vw_plan(graph, [[2], [1, 3]], "mlp", 8, 2, n_shards=2))


def test_run_refuses_a_plan_for_another_model(tmp_path: Path) -> None:
    """The plan is valid in itself, but its 6 layers are not the built-in mlp's 11."""
    path = good_plan().save(tmp_path / "plan.yaml")
    result = CliRunner().invoke(app, ["run", str(path), "--steps", "1"])
    assert result.exit_code == 2, result.output
    assert result.output.strip().splitlines() == [
        f"error: {path}: num_layers: the plan is for a model of 6 layers but model 'mlp' has 11; "
        "use the profiles or model the plan was made with"
    ]
