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


def test_each_stage_of_a_vw_is_shipped_only_the_data_it_reads() -> None:
    """Stage 0 carries the inputs, the last stage the targets, a middle stage nothing, and
    each end's minibatches equal those of the whole data set (issue #26)."""
    import pickle

    import torch
    from torch.utils.data import Subset, TensorDataset

    from runtime.data import MinibatchSource

    source = ModelSource(ref="mlp")
    graph = ModelGraph.from_spec(resolve_source(source, 8, meta=True))
    plan = multi_vw_plan(graph, [[1, 2]], "mlp", 8, 1, cluster=cpu_cluster(3))
    x, y = torch.randn(256, 64), torch.randint(0, 10, (256,))
    prep = prepare(plan, source, RunSpec(RunConfig(steps=2)), TensorDataset(x, y),
                   Attempt("file:///nonexistent"))  # fmt: skip
    assert isinstance(prep, Prepared)
    first, middle, last = prep.stages
    assert middle.dataset is None and isinstance(first.dataset, Subset)
    sizes = [len(pickle.dumps(j)) for j in prep.stages]
    assert sizes[1] < sizes[2] < x.numel() * 4 < sizes[0]

    split = first.dataset.indices  # the training split: the same samples at both ends
    assert isinstance(last.dataset, Subset) and last.dataset.indices == split
    whole = MinibatchSource(Subset(TensorDataset(x, y), split), 8, 0, (8,))
    ends = [MinibatchSource(j.dataset, 8, 0, (8,)) for j in (first, last)]
    for mb in (1, 2, 40):
        torch.testing.assert_close(ends[0].inputs(mb), whole.inputs(mb), rtol=0, atol=0)
        torch.testing.assert_close(ends[1].targets(mb), whole.targets(mb), rtol=0, atol=0)


def test_stage_view_keeps_minibatches_bit_identical() -> None:
    """Each end of a pipeline collates its half of every minibatch exactly as the whole set."""
    import torch
    from torch.utils.data import Subset, TensorDataset

    from runtime.data import MinibatchSource, stage_view

    x, y = torch.randn(100, 5), torch.randint(0, 10, (100,))
    data = Subset(TensorDataset(x, y), list(range(3, 90)))
    whole = MinibatchSource(data, 8, 3)
    assert stage_view(data, 0, 1) is data  # a one-stage VW reads both
    assert stage_view(data, 1, 3) is None
    ends = [MinibatchSource(stage_view(data, s, 3), 8, 3) for s in (0, 2)]  # type: ignore[arg-type]
    for mb in (1, 5, 17):
        torch.testing.assert_close(ends[0].inputs(mb), whole.inputs(mb), rtol=0, atol=0)
        torch.testing.assert_close(ends[1].targets(mb), whole.targets(mb), rtol=0, atol=0)
