"""Plan validation: a plan file is checked against itself, its cluster and (when known) its
model's layers before ``simulate`` or ``run`` use it.

:func:`validate_plan` raises one :class:`~profiler.errors.PlanError` line naming the file, the
field (``virtual_workers[1].stages[2].first_index``), the bad value and the fix, for:

- types and ranges: every number of the plan's dataclasses finite and non-negative (ints
  whole, not ``true``), strings printable and bounded; ``batch_size``, ``nm``, ``num_layers``
  and a stage's ``in_flight`` at least 1; at least one virtual worker;
- GPUs: on a node of the embedded cluster, index within its ``count``, the node's GPU type,
  memory at most the node's; no GPU used twice;
- stages: one per GPU at most, ``gpu`` within the VW's GPUs, layer ranges covering
  ``0 .. num_layers - 1`` in order with no gap, overlap or reversed range; ``memory_bytes``
  at most ``capacity_bytes``, itself at most the GPU's memory;
- shards: on known nodes, no layer held twice;
- ``schedule``: a name in :data:`planner.schedule.SCHEDULES`.

:func:`check_plan_layers` adds the model's layer names (from a profile or the model graph).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import MISSING, fields, is_dataclass
from typing import TYPE_CHECKING, Any

from planner.offload import MemoryPlacement
from planner.schedule import schedule_named
from planner.sync import check_rule_values
from profiler.errors import PlanError, shown
from profiler.inputs import text_problem
from profiler.units import MAX_BYTES

if TYPE_CHECKING:
    from planner.plan import Plan, VirtualWorker

__all__ = ["check_nm", "check_plan_document", "check_plan_layers", "validate_plan"]

MAX_TEXT_CHARS = 1000  # longest string field (model reference, layer name, provenance)
_AT_LEAST_ONE = {"batch_size", "nm", "num_layers", "in_flight"}


def validate_plan(plan: Plan, source: str = "plan") -> None:
    """Check ``plan`` (see the module docstring); return quietly when it is usable.

    Raises:
        PlanError: the first problem found, as one line naming ``source`` and the field.
    """
    _check_values(plan, "", source)
    if not plan.virtual_workers:
        raise PlanError(f"{source}: virtual_workers: the plan has none; re-run 'hetpipe plan'")
    used: dict[tuple[str, int], str] = {}
    for i, vw in enumerate(plan.virtual_workers):
        at = f"virtual_workers[{i}]"
        if vw.id != i:
            raise PlanError(
                f"{source}: {at}.id: {vw.id} should be {i} (VWs are numbered 0, 1, ...)"
            )
        _check_gpus(plan, vw, at, used, source)
        _check_stages(plan, vw, at, source)
    _check_shards(plan, source)
    schedule_named(plan.schedule, f"{source}: schedule")
    check_rule_values(plan.sync, plan.sync_params, len(plan.virtual_workers), source)


def check_plan_layers(plan: Plan, layers: Sequence[str], source: str, what: str) -> None:
    """Check that ``plan`` was made for a model with these layer names (in linear order).

    Args:
        plan: a plan that passed :func:`validate_plan`.
        layers: the model's layer names, e.g. ``Profile.layers``.
        source: the plan file, for messages.
        what: where ``layers`` come from (``"profile resnet.csv"``), for messages.

    Raises:
        PlanError: another layer count, a stage boundary or shard layer not named as in the model.
    """
    if plan.num_layers != len(layers):
        raise PlanError(
            f"{source}: num_layers: the plan is for a model of {plan.num_layers} layers but "
            f"{what} has {len(layers)}; use the profiles or model the plan was made with"
        )
    for i, vw in enumerate(plan.virtual_workers):
        for j, st in enumerate(vw.stages):
            for key, index, name in (
                ("first_layer", st.first_index, st.first_layer),
                ("last_layer", st.last_index, st.last_layer),
            ):
                if layers[index] != name:
                    raise PlanError(
                        f"{source}: virtual_workers[{i}].stages[{j}].{key}: {shown(name)} but "
                        f"layer {index} of {what} is {shown(layers[index])}; use the profiles or "
                        "model the plan was made with"
                    )
    known = set(layers)
    for k, shard in enumerate(plan.shards):
        for name in shard.layers:
            if name not in known:
                raise PlanError(
                    f"{source}: shards[{k}].layers: {shown(name)} is not a layer of {what}; "
                    "use the profiles or model the plan was made with"
                )


def check_nm(plan: Plan, nm: int, vw: int = -1) -> None:
    """Refuse an explicit ``--nm`` above what the planner's memory model lets a VW hold
    (``VirtualWorker.nm_max``): VW ``vw`` alone, else every VW.

    Raises:
        ConfigError: one line naming the maximum and the VW that sets it.
    """
    from profiler.errors import ConfigError

    workers = (
        [plan.virtual_workers[vw]] if 0 <= vw < len(plan.virtual_workers) else plan.virtual_workers
    )
    tight = min(workers, key=lambda w: w.nm_max, default=None)
    if tight is not None and 0 < tight.nm_max < nm:
        raise ConfigError(
            f"--nm {nm}: the planner's memory model fits at most {tight.nm_max} minibatches in "
            f"flight on VW {tight.id} ({shown(tight.signature, 40)}); give --nm {tight.nm_max} "
            "or less, or drop --nm"
        )


# ---------------------------------------------------------------- the raw document


def check_plan_document(d: dict[str, Any], source: str) -> None:
    """Check the shape of a parsed plan file before :meth:`Plan.from_dict` converts it: every
    section a mapping or list as expected, no required field missing, every scalar of the
    declared type (``nm: '3'`` or ``fwd_ms: [1]`` name their field instead of a vague error).

    Raises:
        PlanError: one line naming ``source`` and the field.
    """
    from planner.plan import Plan

    _check_shape(d, Plan, "", source)


def _check_shape(raw: object, cls: type, at: str, source: str) -> None:
    from planner import plan as plan_module

    where = at or "the document"
    if not isinstance(raw, dict):
        raise PlanError(f"{source}: {where}: expected a mapping, got {type(raw).__name__}")
    names = {f.name for f in fields(cls)}
    if cls is plan_module.GpuSlot:  # built with GpuSlot(**g): no other key may appear
        extra = sorted(str(k) for k in raw if k not in names)
        if extra:
            raise PlanError(f"{source}: {at}: unknown field {shown(extra[0], 40)}; remove it")
    for f in fields(cls):
        path = f"{at}.{f.name}" if at else f.name
        if f.name not in raw:
            if f.default is MISSING and f.default_factory is MISSING:
                raise PlanError(
                    f"{source}: {path}: missing (a truncated file, or not a hetpipe plan?)"
                )
            continue
        value, kind = raw[f.name], str(f.type)
        if f.name == "cluster":  # parse_cluster reports its own fields
            continue
        if kind in _SCALARS and not _SCALARS[kind](value):
            raise PlanError(f"{source}: {path}: {shown(value)} is not {_NOUNS[kind]}")
        if kind.startswith("tuple["):
            if not isinstance(value, list):
                raise PlanError(f"{source}: {path}: expected a list, got {type(value).__name__}")
            inner = getattr(plan_module, kind[len("tuple[") : -len(", ...]")], None)
            if is_dataclass(inner):
                for k, item in enumerate(value):
                    _check_shape(item, inner, f"{path}[{k}]", source)  # type: ignore[arg-type]
        elif kind.startswith("dict[") and not isinstance(value, dict):
            raise PlanError(f"{source}: {path}: expected a mapping, got {type(value).__name__}")
        elif is_dataclass(getattr(plan_module, kind, None)):
            _check_shape(value, getattr(plan_module, kind), path, source)


def _whole(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


_SCALARS = {
    "int": _whole,
    "float": lambda v: _whole(v) or isinstance(v, float),
    "str": lambda v: isinstance(v, str),
}
_NOUNS = {"int": "a whole number", "float": "a number", "str": "a string"}


# ---------------------------------------------------------------- values


def _check_values(obj: object, at: str, source: str) -> None:
    """Type and range of every scalar field of ``obj`` and of the dataclasses inside it."""
    if not is_dataclass(obj):
        return
    for f in fields(obj):
        if f.name == "cluster":  # validated by planner.cluster.parse_cluster
            continue
        value = getattr(obj, f.name)
        path = f"{at}.{f.name}" if at else f.name
        kind = str(f.type)
        if kind in ("int", "float"):
            _check_number(value, kind, path, source, 1 if f.name in _AT_LEAST_ONE else 0)
        elif kind == "str":
            _check_text(value, path, source)
        elif (
            kind.startswith("tuple[") and kind != "tuple[str, ...]" and kind != "tuple[float, ...]"
        ):
            for k, item in enumerate(value):
                _check_values(item, f"{path}[{k}]", source)
        elif kind == "tuple[float, ...]":
            for k, item in enumerate(value):
                _check_number(item, "float", f"{path}[{k}]", source, 0)
        elif kind == "tuple[str, ...]":
            for k, item in enumerate(value):
                _check_text(item, f"{path}[{k}]", source)
        elif kind == "dict[str, str]":
            for key, item in value.items():
                _check_text(key, path, source)
                _check_text(item, f"{path}[{shown(key, 40)}]", source)
        elif is_dataclass(value):
            _check_values(value, path, source)


def _check_number(value: object, kind: str, path: str, source: str, least: int) -> None:
    whole = isinstance(value, int) and not isinstance(value, bool)
    if kind == "int" and not whole:
        raise PlanError(f"{source}: {path}: {shown(value)} is not a whole number")
    if kind == "float" and not (whole or isinstance(value, float)):
        raise PlanError(f"{source}: {path}: {shown(value)} is not a number")
    if whole and abs(value) > MAX_BYTES:  # type: ignore[arg-type]
        raise PlanError(f"{source}: {path}: {shown(value)} is out of range (at most 2**60)")
    if not math.isfinite(value):  # type: ignore[arg-type]
        raise PlanError(f"{source}: {path}: {shown(value)} must be a finite number")
    if value < least:  # type: ignore[operator]
        raise PlanError(f"{source}: {path}: {shown(value)} must be at least {least}")


def _check_text(value: object, path: str, source: str) -> None:
    if not isinstance(value, str):
        raise PlanError(f"{source}: {path}: {shown(value)} is not a string")
    problem = text_problem(value, MAX_TEXT_CHARS)
    if problem is not None:
        raise PlanError(f"{source}: {path}: {shown(value)} cannot be used: {problem}")


# ---------------------------------------------------------------- structure


def _check_gpus(
    plan: Plan, vw: VirtualWorker, at: str, used: dict[tuple[str, int], str], source: str
) -> None:
    if not vw.gpus:
        raise PlanError(f"{source}: {at}.gpus: a virtual worker needs at least one GPU")
    nodes = {n.name: n for n in plan.cluster.nodes}
    for j, gpu in enumerate(vw.gpus):
        here = f"{at}.gpus[{j}]"
        node = nodes.get(gpu.node)
        if node is None:
            raise PlanError(
                f"{source}: {here}.node: {shown(gpu.node)} is not a node of the plan's cluster "
                f"(nodes: {', '.join(shown(n, 20) for n in list(nodes)[:8])})"
            )
        if gpu.index >= node.count:
            raise PlanError(
                f"{source}: {here}.index: {gpu.index} but node {shown(node.name)} has "
                f"{node.count} GPUs (indices 0..{node.count - 1})"
            )
        if gpu.type != node.gpu_type:
            raise PlanError(
                f"{source}: {here}.type: {shown(gpu.type)} but node {shown(node.name)} has "
                f"{shown(node.gpu_type)} GPUs"
            )
        if gpu.memory_bytes > node.memory_bytes:
            raise PlanError(
                f"{source}: {here}.memory_bytes: {gpu.memory_bytes} is more than node "
                f"{shown(node.name)}'s {node.memory_bytes} bytes per GPU"
            )
        key = (gpu.node, gpu.index)
        if key in used:
            raise PlanError(
                f"{source}: {here}: GPU {shown(gpu.node)}:{gpu.index} is already used by "
                f"{used[key]}; a GPU runs one stage of one VW"
            )
        used[key] = here


def _check_stages(plan: Plan, vw: VirtualWorker, at: str, source: str) -> None:
    if not vw.stages:
        raise PlanError(f"{source}: {at}.stages: a virtual worker needs at least one stage")
    if len(vw.stages) > len(vw.gpus):
        raise PlanError(
            f"{source}: {at}.stages: {len(vw.stages)} stages but {len(vw.gpus)} GPUs "
            "(one stage per GPU)"
        )
    last = plan.num_layers - 1
    firsts = [st.first_index for st in vw.stages]
    for j in range(1, len(firsts)):
        if firsts[j] < firsts[j - 1]:
            raise PlanError(
                f"{source}: {at}.stages[{j}].first_index: {firsts[j]} is before stage {j - 1}'s "
                f"({firsts[j - 1]}): list the stages in pipeline order, first layers first"
            )
    on_gpu: dict[int, int] = {}
    for j, st in enumerate(vw.stages):
        here = f"{source}: {at}.stages[{j}]"
        if st.gpu >= len(vw.gpus):
            raise PlanError(
                f"{here}.gpu: {st.gpu} but the VW has {len(vw.gpus)} GPUs (0..{len(vw.gpus) - 1})"
            )
        if st.gpu in on_gpu:
            raise PlanError(f"{here}.gpu: GPU {st.gpu} already runs stage {on_gpu[st.gpu]}")
        on_gpu[st.gpu] = j
        _check_range(st.first_index, st.last_index, last, j, vw, here)
        try:
            MemoryPlacement.parse(st.memory)
        except ValueError as exc:
            raise PlanError(f"{here}.memory: {exc}") from None
        if st.memory_bytes > st.capacity_bytes:
            raise PlanError(
                f"{here}.memory_bytes: {st.memory_bytes} bytes do not fit the GPU's capacity "
                f"of {st.capacity_bytes}; re-plan with a smaller Nm or more GPUs"
            )
        gpu_memory = vw.gpus[st.gpu].memory_bytes
        if st.capacity_bytes > gpu_memory:
            raise PlanError(
                f"{here}.capacity_bytes: {st.capacity_bytes} is more than its GPU's "
                f"memory_bytes ({gpu_memory})"
            )
    if vw.stages[-1].last_index != last:
        raise PlanError(
            f"{source}: {at}.stages[{len(vw.stages) - 1}].last_index: "
            f"{vw.stages[-1].last_index} but the model's last layer is {last} "
            f"(num_layers {plan.num_layers}); the stages must cover every layer"
        )


def _check_range(first: int, end: int, last: int, j: int, vw: VirtualWorker, here: str) -> None:
    """Stage ``j`` covers ``first..end``; stage ``j - 1`` ended just before ``first``."""
    if first > last or end > last:
        index, key = (first, "first_index") if first > last else (end, "last_index")
        raise PlanError(
            f"{here}.{key}: {index} is past the model's last layer ({last}); re-run 'hetpipe plan'"
        )
    if end < first:
        raise PlanError(
            f"{here}.last_index: {end} is before first_index {first} (a reversed range)"
        )
    expected = vw.stages[j - 1].last_index + 1 if j else 0
    if first < expected:
        what = f"overlaps stage {j - 1} (ends at {expected - 1})" if j else "must be 0"
        raise PlanError(f"{here}.first_index: {first} {what}; start it at {expected}")
    if first > expected:
        gap = f"layers {expected}..{first - 1}" if first - 1 > expected else f"layer {expected}"
        raise PlanError(
            f"{here}.first_index: {first} leaves {gap} in no stage; start it at {expected}"
        )


def _check_shards(plan: Plan, source: str) -> None:
    nodes = {n.name for n in plan.cluster.nodes}
    holder: dict[str, int] = {}
    for k, shard in enumerate(plan.shards):
        if shard.id != k:
            raise PlanError(f"{source}: shards[{k}].id: {shard.id} should be {k}")
        if shard.node not in nodes:
            raise PlanError(
                f"{source}: shards[{k}].node: {shown(shard.node)} is not a node of the plan's cluster"
            )
        for name in shard.layers:
            if name in holder:
                raise PlanError(
                    f"{source}: shards[{k}].layers: layer {shown(name)} is also in shard "
                    f"{holder[name]}; each layer's parameters live in one shard"
                )
            holder[name] = k
