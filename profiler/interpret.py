"""Run a traced model layer by layer: the interpreter the profilers share.

:func:`run_layers` walks the fx graph of a model in its linear order and hands every layer
to a visitor as a :class:`LayerCall`: a zero-argument forward bound to *detached* copies of
the layer's inputs (floating inputs become leaves requiring grad, so a layer's backward
stops at its own boundary), the tensors a backward differentiates for, and all its tensor
arguments. The measured profiler counts saved bytes and FLOPs with it on real tensors; the
analytic profiler counts FLOPs, traffic and saved bytes on ``meta`` tensors.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx
from torch import Tensor

from profiler.errors import ModelError

__all__ = ["LayerCall", "backward_call", "bind_node", "run_layers", "tensors_of"]


@dataclass(frozen=True)
class LayerCall:
    """One layer ready to run on its (detached) inputs.

    Attributes:
        index: layer index in the graph's linear order.
        node: the fx node.
        forward: runs the layer's forward once and returns its output.
        grad_inputs: tensors the backward differentiates for (input leaves and owned parameters).
        inputs: every tensor argument of the layer.
    """

    index: int
    node: fx.Node
    forward: Callable[[], Any]
    grad_inputs: tuple[Tensor, ...]
    inputs: tuple[Tensor, ...] = ()


def _leaf(value: Any) -> Any:
    """Detach every tensor in ``value``; floating tensors become leaves requiring grad."""
    if isinstance(value, Tensor):
        out = value.detach()
        return out.requires_grad_(True) if out.is_floating_point() else out
    if isinstance(value, tuple):
        return tuple(_leaf(v) for v in value)
    if isinstance(value, list):
        return [_leaf(v) for v in value]
    if isinstance(value, dict):
        return {k: _leaf(v) for k, v in value.items()}
    return value


def tensors_of(value: Any) -> list[Tensor]:
    """Every tensor in a nested tuple/list/dict ``value``."""
    return _tensors(value)


def _tensors(value: Any) -> list[Tensor]:
    if isinstance(value, Tensor):
        return [value]
    if isinstance(value, (tuple, list)):
        return [t for v in value for t in _tensors(v)]
    if isinstance(value, dict):
        return [t for v in value.values() for t in _tensors(v)]
    return []


def run_layers(
    gm: fx.GraphModule, inputs: Sequence[Any], visit: Callable[[LayerCall], Any]
) -> None:
    """Interpret a traced model layer by layer, letting ``visit`` run each layer.

    Args:
        gm: the traced model (``ModelGraph.gm``), one layer per fx node.
        inputs: positional model inputs.
        visit: called once per non-``output`` layer with a :class:`LayerCall`; returns the
            layer's output (normally ``call.forward()``), which becomes the next layers' input.

    Raises:
        ModelError: a layer fails on its inputs.
    """
    env: dict[fx.Node, Any] = {}
    args_iter = iter(inputs)
    nodes = list(gm.graph.nodes)
    last_use = {n: i for i, node in enumerate(nodes) for n in node.all_input_nodes}
    for index, node in enumerate(nodes):
        if node.op == "output":
            break
        for done in [n for n in env if last_use.get(n, -1) < index]:
            del env[done]  # no later layer reads it: free the activation
        if node.op == "placeholder":
            value = next(args_iter)
            # model inputs need no grad
            leaf = value.detach() if isinstance(value, Tensor) else value
            env[node] = leaf

            def identity(v: Any = leaf) -> Any:
                return v

            visit(LayerCall(index, node, identity, ()))
            continue
        args = fx.node.map_arg(node.args, env.__getitem__)
        kwargs = fx.node.map_arg(node.kwargs, env.__getitem__)
        params: tuple[Tensor, ...] = ()
        if node.op == "call_module":
            sub = gm.get_submodule(str(node.target))
            params = tuple(p for p in sub.parameters() if p.requires_grad)
        leaves = tuple(t for t in _tensors((args, kwargs)) if t.requires_grad)
        if _is_inplace(gm, node):  # a leaf cannot be modified in place: hand it a copy
            args, kwargs = fx.node.map_aggregate(
                (args, kwargs),
                lambda v: v.clone() if isinstance(v, Tensor) and v.requires_grad else v,
            )
        tensors = tuple(_tensors((args, kwargs)))
        forward = bind_node(gm, node, args, kwargs)

        try:
            out = visit(LayerCall(index, node, forward, leaves + params, tensors))
        except (RuntimeError, TypeError, ValueError, IndexError) as exc:
            raise ModelError(f"layer {index} ({node.name}) failed on its inputs: {exc}") from exc
        env[node] = _leaf(out)


def _is_inplace(gm: fx.GraphModule, node: fx.Node) -> bool:
    """Whether the node modifies an input in place (``ReLU(inplace=True)``, ``x.add_(y)``)."""
    if node.kwargs.get("inplace") is True:
        return True
    if node.op == "call_module":
        return bool(getattr(gm.get_submodule(str(node.target)), "inplace", False))
    name = str(getattr(node.target, "__name__", node.target))
    return name.endswith("_") and not name.endswith("__")


def bind_node(gm: fx.GraphModule, node: fx.Node, args: Any, kwargs: Any) -> Callable[[], Any]:
    """A zero-argument callable running ``node`` on ``args``/``kwargs`` (target resolved once)."""
    if node.op == "call_module":
        return functools.partial(gm.get_submodule(str(node.target)), *args, **kwargs)
    if node.op == "call_function":
        target: Callable[..., Any] = node.target  # type: ignore[assignment]
        return functools.partial(target, *args, **kwargs)
    if node.op == "call_method":
        self_obj, *rest = args
        return functools.partial(getattr(self_obj, str(node.target)), *rest, **kwargs)
    if node.op == "get_attr":
        obj: Any = gm
        for part in str(node.target).split("."):
            obj = getattr(obj, part)
        return functools.partial(lambda v: v, obj)
    raise ModelError(f"unsupported fx node op {node.op!r} at {node.name}")


def backward_call(
    out: Any, wrt: Sequence[Tensor], retain: bool = True
) -> Callable[[], None] | None:
    """A callable running the layer's backward once (ones-like output gradient).

    Returns ``None`` when nothing differentiable flows through the layer.
    """
    outs = [t for t in _tensors(out) if t.requires_grad and t.grad_fn is not None]
    if not outs or not wrt:
        return None
    grads = [torch.ones_like(t) for t in outs]
    wrt = list(wrt)

    def run() -> None:
        torch.autograd.grad(outs, wrt, grads, retain_graph=retain, allow_unused=True)

    return run
