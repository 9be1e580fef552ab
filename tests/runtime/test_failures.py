"""A stage that raises or is killed ends the whole run quickly, naming that stage."""

from __future__ import annotations

import time

import pytest

from planner.manual import balanced_cuts, manual_plan
from profiler.errors import HetPipeRuntimeError
from profiler.graph import ModelGraph
from runtime.config import ModelSource, RunConfig
from runtime.faults import StageFault
from runtime.launch.launcher import launch
from runtime.stage.model import resolve_source
from tests.runtime._spec import spec


def _plan() -> tuple[ModelSource, object]:
    source = ModelSource(ref="mlp")
    graph = ModelGraph.from_spec(resolve_source(source, 8, meta=True))
    return source, manual_plan(graph, balanced_cuts(graph, 3), "mlp", 8, 2)


@pytest.mark.parametrize(
    ("fault", "expected"),
    [
        (StageFault(1, 3, signum=0), "injected fault at minibatch 3"),
        (StageFault(1, 3), "SIGKILL"),
    ],
)
def test_failing_stage_ends_run_naming_it(fault: StageFault, expected: str) -> None:
    source, plan = _plan()
    t0 = time.monotonic()
    with pytest.raises(HetPipeRuntimeError) as info:
        launch(plan, source, spec(None, RunConfig(steps=50, timeout_s=20), stage_fault=fault))
    elapsed = time.monotonic() - t0
    message = str(info.value)
    assert "rank 1 (vw 0 | stage 1 |" in message
    assert expected in message
    assert elapsed < 60  # start-up included; the failure itself is noticed within a second


def test_out_of_memory_is_a_clear_error() -> None:
    """An emulated device whose cap cannot hold its stage raises the out-of-memory error."""
    from planner.manual import cpu_cluster

    source = ModelSource(ref="mlp")
    graph = ModelGraph.from_spec(resolve_source(source, 8, meta=True))
    cluster = cpu_cluster(2, speed=1.0, memory_bytes=200_000)
    plan = manual_plan(graph, balanced_cuts(graph, 2), "mlp", 8, 2, cluster)
    with pytest.raises(HetPipeRuntimeError, match="out of memory on vw 0 \\| stage"):
        launch(plan, source, spec(None, RunConfig(steps=4, timeout_s=20, emulate=True)))
