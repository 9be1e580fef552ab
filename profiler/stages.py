"""Stage modules: a range of a captured model's layers as an ``nn.Module``.

:meth:`profiler.graph.ModelGraph.build_stages` splits the captured graph with
``torch.fx.passes.split_module``; each part becomes a :class:`StageModule` that takes the
tensors crossing its first cut and returns those crossing its last one.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, cast

import torch
import torch.fx as fx
from torch import nn
from torch.utils import _pytree as pytree

from profiler.errors import ModelError

__all__ = ["StageModule", "inner_signature", "refs"]


def _mutates_input(gm: fx.GraphModule, node: fx.Node) -> bool:
    """Whether ``node`` may write into its first input (``ReLU(inplace=True)``, ``x.add_(y)``)."""
    if node.kwargs.get("inplace") is True:
        return True
    if node.op == "call_module":
        return bool(getattr(gm.get_submodule(str(node.target)), "inplace", False))
    if node.op == "call_function" and isinstance(node.target, torch._ops.OpOverload):
        return bool(node.target._schema.is_mutable)
    name = str(getattr(node.target, "__name__", node.target))
    return name.endswith("_") and not name.endswith("__")


def inner_signature(
    inner: fx.GraphModule | None,
) -> tuple[tuple[str, ...], tuple[str, ...], set[str]]:
    """A split submodule's input and output names, and the inputs it writes in place.

    Postponed annotations (``"Tensor"``) on its placeholders are dropped: they cannot be pickled.
    """
    inner_in: tuple[str, ...] = ()
    inner_out: tuple[str, ...] = ()
    clone: set[str] = set()
    if inner is not None:
        sub_graph = inner.graph
        placeholders = [n for n in sub_graph.nodes if n.op == "placeholder"]
        if any(isinstance(p.type, str) for p in placeholders):
            for p in placeholders:  # a postponed annotation ("Tensor") cannot be pickled
                p.type = None
            inner.recompile()
        inner_in = tuple(n.name for n in placeholders)
        out_arg = next(n for n in sub_graph.nodes if n.op == "output").args[0]
        outs = out_arg if isinstance(out_arg, (tuple, list)) else (out_arg,)
        inner_out = tuple(o.name for o in outs)
        clone = {p.name for p in placeholders if any(_mutates_input(inner, u) for u in p.users)}
    return inner_in, inner_out, clone


@dataclass(frozen=True)
class _Ref:
    """A reference to a graph value by node name in a stage's output structure (picklable,
    unlike the ``fx.Node`` it stands for, which drags in the whole model graph)."""

    name: str


def refs(structure: Any) -> Any:
    """``structure`` (an fx output argument) with every node replaced by a :class:`_Ref`."""
    return fx.node.map_aggregate(
        structure, lambda a: cast("Any", _Ref(a.name)) if isinstance(a, fx.Node) else a
    )


class StageModule(nn.Module):
    """A range of layers as a module: crossing tensors in, crossing tensors out.

    ``forward(*inputs)`` takes the tensors crossing the stage's first cut (in
    ``input_names`` order) and returns those crossing its last cut (``output_names``
    order), passing skip tensors through. The last stage returns the model's output
    in its original structure instead. Inputs the stage writes in place (an in-place
    ReLU right after the cut) are cloned first: a received activation is an autograd leaf.
    """

    def __init__(
        self,
        inner: nn.Module | None,
        inner_inputs: tuple[str, ...],
        inner_outputs: tuple[str, ...],
        input_names: tuple[str, ...],
        output_names: tuple[str, ...],
        output_structure: Any = None,
        out_spec: Any = None,
        clone_inputs: frozenset[str] = frozenset(),
    ) -> None:
        super().__init__()
        self.inner = inner
        self.inner_inputs = inner_inputs
        self.inner_outputs = inner_outputs
        self.input_names = input_names
        self.output_names = output_names
        self.output_structure = output_structure  # fx output args, for the last stage
        self.out_spec = out_spec  # pytree spec of an exported model's output
        self.clone_inputs = clone_inputs

    def forward(self, *inputs: Any) -> Any:
        if len(inputs) != len(self.input_names):
            raise ModelError(
                f"stage expects {len(self.input_names)} inputs {self.input_names}, got {len(inputs)}"
            )
        env: dict[str, Any] = dict(zip(self.input_names, inputs, strict=True))
        for name in self.clone_inputs:
            env[name] = env[name].clone()
        if self.inner is not None:
            result = self.inner(*(env[n] for n in self.inner_inputs))
            if len(self.inner_outputs) == 1:
                result = (result,)
            env.update(zip(self.inner_outputs, result, strict=True))
        if self.output_structure is None:
            return tuple(env[n] for n in self.output_names)
        out = fx.node.map_aggregate(
            self.output_structure, lambda a: env[a.name] if isinstance(a, _Ref) else a
        )
        if self.out_spec is not None:
            return pytree.tree_unflatten(list(out), self.out_spec)
        return out
