"""Each process's frozen job: the process group's size is set in one place (``with_world``)."""

from __future__ import annotations

from planner.manual import cpu_cluster, multi_vw_plan
from profiler.graph import ModelGraph
from runtime.config import ModelSource, RunConfig
from runtime.launch.jobs import Attempt, Prepared, with_world
from runtime.launch.launcher import prepare
from runtime.spec import RunSpec
from runtime.stage.model import resolve_source


def test_shards_and_stages_share_one_world_size() -> None:
    source = ModelSource(ref="mlp")
    graph = ModelGraph.from_spec(resolve_source(source, 8, meta=True))
    plan = multi_vw_plan(graph, [[2], [2]], "mlp", 8, 1, cluster=cpu_cluster(4))
    spec = RunSpec(RunConfig(steps=2))
    prep = prepare(plan, source, spec, None, Attempt("file:///nonexistent"))
    assert isinstance(prep, Prepared) and prep.shards
    world = len(prep.shards) + len(prep.stages)
    assert {j.world_size for j in prep.shards} == {world}
    assert {j.world_size for j in prep.stages} == {world}
    assert [j.ctx.rank for j in prep.stages] == list(range(len(prep.shards), world))


def test_with_world_counts_the_shards_before_the_stages() -> None:
    source = ModelSource(ref="mlp")
    graph = ModelGraph.from_spec(resolve_source(source, 8, meta=True))
    plan = multi_vw_plan(graph, [[2]], "mlp", 8, 1, cluster=cpu_cluster(2))
    spec = RunSpec(RunConfig(steps=2), vw=0)  # VW 0 alone
    prep = prepare(plan, source, spec, None, Attempt("file:///nonexistent"))
    assert isinstance(prep, Prepared) and not prep.shards
    stages = list(prep.stages)
    assert with_world(stages)[0] == len(stages) == 2
    world, jobs = with_world(stages, n_shards=3)
    assert world == 5 and {j.world_size for j in jobs} == {5}


def test_a_stage_job_carries_only_its_sections_of_the_spec() -> None:
    import pickle

    from runtime.faults import StageFault
    from runtime.spec import CheckpointConfig, TestHooks

    source = ModelSource(ref="mlp")
    graph = ModelGraph.from_spec(resolve_source(source, 8, meta=True))
    plan = multi_vw_plan(graph, [[2], [2]], "mlp", 8, 1, cluster=cpu_cluster(4))
    fault = StageFault(stage=1, at_mb=3)
    spec = RunSpec(RunConfig(steps=2), checkpoints=CheckpointConfig(every=3),
                   faults=TestHooks(stage_fault=fault))  # fmt: skip
    prep = prepare(plan, source, spec, None, Attempt("file:///nonexistent"))
    assert isinstance(prep, Prepared)
    job = prep.stages[0]
    assert (job.run, job.optimizer, job.fault) == (spec.run, spec.optimizer, fault)
    shipped = pickle.dumps(job)
    for other in (b"RunSpec", b"CheckpointConfig", b"FailurePolicy", b"TestHooks"):
        assert other not in shipped
