"""Device-independent per-layer costs of a model, counted on the ``meta`` device.

:func:`layer_costs` builds the model under ``torch.device("meta")`` (no memory, no compute),
traces it and runs every layer once (:func:`profiler.interpret.run_layers`) under
``FlopCounterMode`` (FLOPs of forward and of a real autograd backward), a dispatch mode
summing the bytes of every non-view aten kernel's tensors (memory traffic, kernel count) and
a :class:`~profiler.memory.SavedTensorCounter` (exact saved-for-backward bytes). The same
pass provides the shapes of the :class:`~profiler.graph.ModelGraph`. Structurally identical
layers are counted once and replayed. Results are cached per (model, batch size).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx
from torch import Tensor
from torch.fx.passes.shape_prop import _extract_tensor_metadata
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import FlopCounterMode

from profiler.capture import Captured, capture
from profiler.graph import ModelGraph
from profiler.interpret import LayerCall, backward_call, run_layers, tensors_of
from profiler.memory import SavedTensorCounter, storage_bytes, tensor_bytes
from profiler.models import ModelSpec, resolve_model

__all__ = ["LayerCost", "layer_costs"]


@dataclass(frozen=True)
class LayerCost:
    """Device-independent cost of one layer for one minibatch.

    Attributes:
        name, op, inputs: as in the profile table (``inputs`` ``;``-joined).
        act_bytes, saved_bytes, param_bytes, buffer_bytes: as in the profile table.
        fwd_flops, bwd_flops: floating-point operations of forward and backward.
        fwd_bytes, bwd_bytes: memory traffic (tensor bytes read + written by kernels).
        fwd_kernels, bwd_kernels: number of non-view aten kernels.
    """

    name: str
    op: str
    inputs: str
    act_bytes: int
    saved_bytes: int
    param_bytes: int
    buffer_bytes: int
    fwd_flops: float
    bwd_flops: float
    fwd_bytes: float
    bwd_bytes: float
    fwd_kernels: int
    bwd_kernels: int


class _TrafficMode(TorchDispatchMode):
    """Counts non-view aten kernels and the tensor bytes they read and write."""

    def __init__(self) -> None:
        super().__init__()
        self.nbytes = 0
        self.kernels = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if not getattr(func, "is_view", False) and "detach" not in str(func):
            self.nbytes += (
                tensor_bytes(list(args)) + tensor_bytes(dict(kwargs or {})) + tensor_bytes(out)
            )
            self.kernels += 1
        return out


def _structural_key(gm: fx.GraphModule, call: LayerCall) -> str:
    """What determines a layer's FLOPs and traffic: its operation and its inputs' shapes.

    Identical blocks (36 in ResNet-152's third stage) share a key, so they are counted once
    (:class:`_Memo`).
    """
    node = call.node
    if node.op == "call_module":
        mod = gm.get_submodule(str(node.target))
        what = f"{type(mod).__qualname__}:{mod!r}:{mod.training}"
    else:
        what = f"{node.op}:{getattr(node.target, '__qualname__', node.target)}"
    args = fx.node.map_arg((node.args, node.kwargs), lambda _: "T")
    tensors = [(tuple(t.shape), t.dtype, t.requires_grad) for t in call.inputs]
    return f"{what}:{args!r}:{tensors!r}"


def _tensor_meta(value: Any) -> Any:
    """``ShapeProp``'s ``tensor_meta`` of a (nested) value."""
    return fx.node.map_aggregate(
        value, lambda v: _extract_tensor_metadata(v) if isinstance(v, Tensor) else v
    )


def _trace(spec: ModelSpec) -> Captured:
    """Capture like :meth:`ModelGraph.from_module`, leaving shapes to the counting pass."""
    return capture(spec.module, spec.inputs, spec.input_names)


@dataclass(frozen=True)
class _Memo:
    """A counted layer, to replay for structurally identical layers.

    ``costs`` are forward and backward (flops, bytes, kernels). When the layer's output is one
    fresh tensor (no view of an input), later identical layers are not executed at all: their
    saved bytes are replayed from ``internal_bytes`` (tensors created and saved inside the
    layer), ``input_saved`` (which inputs it saved) and ``output_saved``.
    """

    costs: tuple[float, ...]
    internal_bytes: int
    input_saved: tuple[bool, ...]
    output_saved: bool
    out_shape: tuple[int, ...] | None  # None: not replayable, run the forward
    out_dtype: torch.dtype
    out_grad: bool


def _replay(
    call: LayerCall, counter: SavedTensorCounter, memo: _Memo, shape: tuple[int, ...]
) -> tuple[int, Any]:
    """Saved bytes and a stand-in output of an identical layer, without running it."""
    saved = memo.internal_bytes
    for t, was_saved in zip(call.inputs, memo.input_saved, strict=True):
        if was_saved and not counter.seen(t):
            counter.exclude(t)
            saved += storage_bytes(t)
    out = torch.empty(shape, dtype=memo.out_dtype, device="meta").requires_grad_(memo.out_grad)
    if memo.output_saved:
        counter.exclude(out)
        saved += storage_bytes(out)
    return saved, out


def _count(call: LayerCall, counter: SavedTensorCounter) -> tuple[int, Any, _Memo]:
    """Run one layer on meta tensors, counting saved bytes, FLOPs, traffic and kernels."""
    before = [counter.seen(t) for t in call.inputs]
    with counter, FlopCounterMode(display=False) as flops, _TrafficMode() as traffic:
        out = call.forward()
    saved = counter.take()
    fwd = (float(flops.get_total_flops()), float(traffic.nbytes), float(traffic.kernels))
    bwd = (0.0, 0.0, 0.0)
    run = backward_call(out, call.grad_inputs, retain=False)
    if run is not None:
        with FlopCounterMode(display=False) as bflops, _TrafficMode() as btraffic:
            run()
        bwd = (float(bflops.get_total_flops()), float(btraffic.nbytes), float(btraffic.kernels))
    input_saved = tuple(not b and counter.seen(t) for b, t in zip(before, call.inputs, strict=True))
    in_keys = {t.untyped_storage()._cdata for t in call.inputs}
    outs = tensors_of(out)
    replayable = (
        isinstance(out, Tensor)
        and out.untyped_storage()._cdata not in in_keys
        and len(in_keys) == len(call.inputs)
    )
    output_saved = replayable and counter.seen(out)
    charged = sum(storage_bytes(t) for t, f in zip(call.inputs, input_saved, strict=True) if f)
    charged += storage_bytes(out) if output_saved else 0
    memo = _Memo(
        (*fwd, *bwd),
        saved - charged,
        input_saved,
        output_saved,
        tuple(out.shape) if replayable else None,
        outs[0].dtype if outs else torch.float32,
        bool(outs and outs[0].requires_grad),
    )
    return saved, out, memo


def _measure_layer(
    call: LayerCall,
    counter: SavedTensorCounter,
    costs: dict[int, tuple[float, ...]],
    key: str,
    memos: dict[str, _Memo],
) -> Any:
    memo = memos.get(key)
    if memo is not None and memo.out_shape is not None:
        saved, out = _replay(call, counter, memo, memo.out_shape)
    elif memo is not None:
        with counter:
            out = call.forward()
        saved = counter.take()
    else:
        saved, out, memo = _count(call, counter)
        memos[key] = memo
    costs[call.index] = (float(saved), *memo.costs)
    return out


@functools.lru_cache(maxsize=8)
def layer_costs(model_ref: str, batch_size: int) -> tuple[LayerCost, ...]:
    """Per-layer FLOPs, traffic and sizes of a model, computed on the ``meta`` device (cached).

    Raises:
        ModelError: the model cannot be resolved, traced or run.
    """
    with torch.device("meta"):
        spec = resolve_model(model_ref, batch_size)
    spec.module.train()
    cap = _trace(spec)
    gm, renames = cap.gm, cap.param_renames
    counter = SavedTensorCounter(exclude=list(spec.module.parameters()))
    costs: dict[int, tuple[float, ...]] = {}
    memos: dict[str, _Memo] = {}

    def visit(call: LayerCall) -> Any:
        if call.node.op == "placeholder":
            out = call.forward()
        else:
            out = _measure_layer(call, counter, costs, _structural_key(gm, call), memos)
        call.node.meta["tensor_meta"] = _tensor_meta(out)
        return out

    inputs = spec.inputs
    if cap.input_names:
        given = dict(zip(spec.input_names, spec.inputs, strict=True))
        inputs = tuple(given[n] for n in cap.input_names)
    run_layers(gm, inputs, visit)
    graph = ModelGraph(
        gm, renames, cap.out_spec, cap.input_names
    )  # shapes come from the pass above: no second propagation
    names = graph.names
    result = []
    for lay in graph.layers:
        c = costs.get(lay.index, (0.0,) * 7)
        result.append(
            LayerCost(
                lay.name,
                lay.op,
                ";".join(names[i] for i in lay.inputs),
                lay.act_bytes,
                int(c[0]),
                lay.param_bytes,
                lay.buffer_bytes,
                c[1],
                c[4],
                c[2],
                c[5],
                int(c[3]),
                int(c[6]),
            )
        )
    return tuple(result)
