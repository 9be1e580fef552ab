"""A plan checked against its model before anything runs or is simulated: the model reference
builds, its layers are the plan's, and every emulated stage's weights fit its memory cap.

``hetpipe run`` and ``hetpipe simulate`` both call :func:`check_plan_model`, so a plan one of
them refuses the other refuses too, in the same words, before any process starts (checks on
the plan alone: :func:`planner.plan_check.validate_plan`, run when the file is read).
"""

from __future__ import annotations

from collections.abc import Sequence

from planner.offload import MemoryPlacement
from planner.plan import Plan
from planner.plan_check import check_plan_layers
from profiler.errors import ModelError, PlanError

__all__ = ["check_plan_model", "check_static_memory"]


def check_plan_model(plan: Plan, source: str) -> None:
    """Refuse a plan whose model does not build (unknown name, a reference that is not a
    factory), whose stage boundaries or shard layers are not its model's (a plan made for
    another model, or edited by hand), or whose emulated stages cannot hold their own weights
    (:func:`check_static_memory`).

    Raises:
        PlanError: one line naming ``source`` and the field (``model`` when it does not build).
    """
    from profiler.graph import ModelGraph
    from runtime.config import ModelSource
    from runtime.stage.model import resolve_source

    try:
        spec = resolve_source(ModelSource(ref=plan.model), plan.batch_size, meta=True)
    except ModelError as exc:
        raise PlanError(f"{source}: model: {exc}") from None
    graph = ModelGraph.from_spec(spec)
    check_plan_layers(plan, graph.names, source, f"model {plan.model!r}")
    check_static_memory(plan, [(x.param_bytes, x.buffer_bytes) for x in graph.layers], source)


def check_static_memory(plan: Plan, layer_bytes: Sequence[tuple[int, int]], source: str) -> None:
    """Refuse an emulated stage whose weights, gradients and optimizer state alone exceed its
    device's memory cap: the bytes :class:`runtime.stage.emulation.MemoryMeter` charges before
    the first minibatch, so the run would stop with an out-of-memory error once started.

    Args:
        plan: a plan that passed :func:`planner.plan_check.validate_plan`.
        layer_bytes: ``(param_bytes, buffer_bytes)`` of each of the model's layers, in order.
        source: the plan file, for messages.

    Raises:
        PlanError: ``<source>: virtual_workers[i].stages[j]: ... bytes > cap ...``.
    """
    from runtime.launch.roles import emulation

    for i, vw in enumerate(plan.virtual_workers):
        for j, st in enumerate(vw.stages):
            gpu = vw.gpus[st.gpu]
            speed, cap = emulation(plan, gpu.node, gpu.speed, gpu.memory_bytes)
            if speed <= 0 or cap <= 0 or not MemoryPlacement.parse(st.memory).kept:
                continue  # a real GPU, no cap, or weights that may leave the device
            own = layer_bytes[st.first_index : st.last_index + 1]
            params, buffers = sum(p for p, _ in own), sum(b for _, b in own)
            static = int(params * (2 + plan.optimizer_state_factor) + buffers)
            if static > cap:
                raise PlanError(
                    f"{source}: virtual_workers[{i}].stages[{j}]: its weights, gradients and "
                    f"optimizer state take {static} bytes but device {gpu.node}:{gpu.index} has "
                    f"{cap} (emulate.memory of node {gpu.node!r}); raise that memory, or re-plan "
                    "with 'hetpipe plan' for this cluster"
                )
