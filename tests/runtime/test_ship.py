"""What a process receives for a user's module: a stage process its stage alone, a shard its
own initial weights alone; one ``torch.save`` blob each, the user's initial weights kept."""

from __future__ import annotations

import pickle

import pytest
import torch
from torch import nn

from profiler.errors import ModelError
from runtime.config import ModelSource
from runtime.stage.model import (
    build_stage,
    initial_weights,
    model_graph,
    reference_module,
    resolve_source,
    ship_shard,
    ship_stage,
)


def _source() -> tuple[nn.Module, ModelSource]:
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 10)
    )
    return model, ModelSource(module=model, sample_inputs=(torch.randn(4, 64),))


def _count_captures(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Make every capture of a module append its id to the returned list."""
    import profiler.graph

    captures: list[int] = []
    real = profiler.graph.capture

    def counting(module: nn.Module, *args: object, **kwargs: object) -> object:
        captures.append(id(module))
        return real(module, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(profiler.graph, "capture", counting)
    return captures


def test_a_stage_process_receives_its_stage_alone_with_the_users_weights() -> None:
    model, source = _source()
    whole = len(pickle.dumps(source))
    params = dict(model.named_parameters())
    cuts = (4,)
    sizes = []
    for stage in range(2):
        shipped = ship_stage(source, 4, cuts, stage)
        blob = pickle.dumps(shipped)
        sizes.append(len(blob))
        received = pickle.loads(blob)
        assert received.module is None and received.stage is not None
        built = build_stage(received, 4, cuts, stage, seed=0)
        assert built.graph is None  # no model graph (it holds every parameter) travels
        for name, p in built.module.named_parameters():
            assert torch.equal(p, params[built.names[name]])  # the user's initial weights
            assert p.data_ptr() != params[built.names[name]].data_ptr()  # a copy, not shared
    assert all(size < whole for size in sizes)
    assert sum(sizes) < 1.1 * whole  # each parameter travels once
    assert sum(key[0] == "stages" for key in source.cache) == 1  # split once for both stages
    with pytest.raises(ModelError, match="shipped the wrong stage"):
        build_stage(pickle.loads(pickle.dumps(ship_stage(source, 4, cuts, 0))), 4, cuts, 1, 0)


def test_the_parent_captures_a_users_module_once_per_run(monkeypatch: pytest.MonkeyPatch) -> None:
    """Planning, the run's data, shipping every stage and the reference model read one capture."""
    from hetpipe.planning import plan_on_the_fly
    from planner.on_the_fly import PlanRequest
    from runtime.data_source import output_classes

    captures = _count_captures(monkeypatch)
    model, source = _source()
    spec = resolve_source(source, 4, meta=False)
    request = PlanRequest(source.name, 4, nm=2, stages=2)
    plan = plan_on_the_fly(None, request, model_graph(source, spec))  # planning (hetpipe.train)
    assert output_classes(spec, model_graph(source, spec)) == 10  # the run's data
    cuts = tuple(st.last_index + 1 for st in plan.virtual_workers[0].stages[:-1])
    shipped = [ship_stage(source, 4, cuts, s) for s in range(2)]  # each stage's job
    reference_module(source, 4, seed=0)  # the single-process reference
    assert captures == [id(model)]
    assert all(s.stage is not None and s.module is None for s in shipped)
    other = ModelSource(module=model, sample_inputs=(torch.randn(8, 64),))
    model_graph(other, resolve_source(other, 8, meta=False))  # another run: its own capture
    assert len(captures) == 2


def test_a_wsp_run_of_a_users_module_is_captured_once_and_shipped_by_the_launcher(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The launcher's whole preparation (data, shards' layout, pacing, every stage's job) reads
    the capture planning made, and each stage's job already holds its stage alone."""
    from planner.manual import cpu_cluster, multi_vw_plan
    from runtime.config import RunConfig
    from runtime.launch.jobs import Attempt, Prepared
    from runtime.launch.launcher import prepare
    from runtime.spec import RunSpec

    captures = _count_captures(monkeypatch)
    model, source = _source()
    graph = model_graph(source, resolve_source(source, 4, meta=False))
    plan = multi_vw_plan(graph, [[2], [2]], "Sequential", 4, 1, cluster=cpu_cluster(4))
    prep = prepare(plan, source, RunSpec(RunConfig(steps=2)), None, Attempt("file:///nonexistent"))
    assert isinstance(prep, Prepared) and prep.shards and len(prep.stages) == 4
    assert captures == [id(model)]
    assert all(j.source.stage is not None and j.source.module is None for j in prep.stages)
    assert [j.source.stage.stage for j in prep.stages] == [0, 1, 0, 1]  # type: ignore[union-attr]


def test_a_shard_receives_only_its_initial_weights() -> None:
    model, source = _source()
    shipped = pickle.loads(pickle.dumps(ship_shard(source, ["4.weight", "4.bias"])))
    weights = initial_weights(shipped, 4, seed=0)
    assert set(weights) == {"4.weight", "4.bias"}
    assert torch.equal(weights["4.weight"], model[4].weight)
    ref = ModelSource(ref="mlp")
    assert ship_shard(ref, ["x"]) is ref and ship_stage(ref, 4, (3,), 0) is ref


def test_synthetic_data_for_a_factory_keeps_its_sample_value_ranges() -> None:
    from runtime.data import default_dataset

    ids = torch.randint(0, 512, (8, 16), generator=torch.Generator().manual_seed(0))
    sample = (ids, torch.ones_like(ids), torch.tensor([0, 2, 1, 0, 1, 2, 0, 1]))
    names = ("input_ids", "attention_mask", "labels")
    data = default_dataset("pkg.mod:bert", sample, torch.zeros(8), 8, names)
    items = [data[i][0] for i in range(64)]
    assert all(int(x["labels"].max()) <= 2 for x in items)  # 3 classes, not 10
    assert all(bool((x["attention_mask"] == 1).all()) for x in items)
    assert max(int(x["input_ids"].max()) for x in items) > 10  # the vocabulary's range
