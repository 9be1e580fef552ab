"""The model graph: any ``nn.Module`` as a layer DAG in a topological linear order.

A *layer* is one node of the ``torch.fx`` graph: the model inputs (``placeholder``),
every operation (``call_module``, ``call_function``, ``call_method``) and the model
output. Layers are numbered in graph order, which is topological, so a pipeline
partition is a list of cut points ``0 < c1 < c2 < ... < L``; stage ``s`` holds layers
``[c_s, c_{s+1})``. The tensors that cross a cut (skip connections included) are
exactly the outputs of earlier layers that a later layer (or the model output) uses;
the runtime forwards them stage to stage and the cost model charges for them.

Stage modules are built with ``torch.fx.passes.split_module`` on the traced graph.
Bare tensor attributes (``get_attr`` of a parameter, e.g. a positional embedding) are
first rewritten into tiny holder modules so each parameter is owned by exactly one stage.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, cast

import networkx as nx
import torch
import torch.fx as fx
from torch import Tensor, nn
from torch.fx.passes.shape_prop import ShapeProp, TensorMetadata
from torch.fx.passes.split_module import split_module

from profiler.errors import ModelError
from profiler.models import ModelSpec

__all__ = [
    "Layer",
    "ModelGraph",
    "StageModule",
    "crossing_sets",
    "rewrite_tensor_attrs",
    "trace_module",
]


@dataclass(frozen=True)
class Layer:
    """One node of the model graph.

    Attributes:
        index: position in the topological linear order.
        name: fx node name (unique), used in plan files.
        op: ``placeholder``, ``output``, or the operation, e.g. ``Conv2d``, ``add``, ``flatten``.
        inputs: indices of the layers whose outputs this layer reads.
        out_shapes: shapes of the tensors this layer outputs (several for tuple outputs).
        act_bytes: bytes of this layer's output tensors for one minibatch.
        param_bytes: bytes of the parameters this layer owns (first use of a shared module).
        buffer_bytes: bytes of the buffers (e.g. batch-norm statistics) it owns.
        params: qualified names (in the original module) of the parameters it owns.
    """

    index: int
    name: str
    op: str
    inputs: tuple[int, ...]
    out_shapes: tuple[tuple[int, ...], ...]
    act_bytes: int
    param_bytes: int
    buffer_bytes: int
    params: tuple[str, ...]


def crossing_sets(inputs: Sequence[Sequence[int]]) -> list[tuple[int, ...]]:
    """For every cut ``k`` (between layer ``k-1`` and layer ``k``), the layers whose output crosses it.

    Args:
        inputs: ``inputs[j]`` lists the producers that layer ``j`` reads.

    Returns:
        ``result[k]`` for ``k`` in ``0..L``: sorted producer indices ``i < k`` with a
        consumer ``j >= k``. ``result[0]`` and ``result[L]`` are empty.
    """
    n = len(inputs)
    last_use = list(range(n))  # a layer's output is "used" until its last consumer
    for j, preds in enumerate(inputs):
        for i in preds:
            if i >= j:
                raise ModelError(
                    f"layer {j} reads layer {i}, which is not earlier: the order is not topological"
                )
            last_use[i] = max(last_use[i], j)
    result: list[tuple[int, ...]] = [()]
    live: set[int] = set()
    for k in range(1, n + 1):
        live.add(k - 1)
        live = {i for i in live if last_use[i] >= k}
        result.append(tuple(sorted(live)))
    result[n] = ()
    return result


def _meta_bytes(meta: Any) -> tuple[int, list[tuple[int, ...]]]:
    """Bytes and shapes of a (possibly nested) ShapeProp tensor_meta."""
    if isinstance(meta, TensorMetadata):
        numel = 1
        for d in meta.shape:
            numel *= int(d)
        return numel * torch.empty((), dtype=meta.dtype).element_size(), [
            tuple(int(d) for d in meta.shape)
        ]
    if isinstance(meta, (tuple, list)):
        total, shapes = 0, []
        for m in meta:
            b, s = _meta_bytes(m)
            total += b
            shapes += s
        return total, shapes
    if isinstance(meta, dict):
        return _meta_bytes(list(meta.values()))
    return 0, []


class _AttrHolder(nn.Module):
    """Owns one bare tensor attribute so it can be placed on a single stage."""

    def __init__(self, value: Tensor) -> None:
        super().__init__()
        if isinstance(value, nn.Parameter):
            self.value = value
        else:
            self.register_buffer("value", value)

    def forward(self) -> Tensor:
        return self.value  # type: ignore[no-any-return]


def rewrite_tensor_attrs(gm: fx.GraphModule) -> dict[str, str]:
    """Replace each ``get_attr`` of a tensor by a call to a holder module.

    Returns:
        Map from holder-module parameter names to the original qualified names.
    """
    renames: dict[str, str] = {}
    for i, node in enumerate(list(gm.graph.nodes)):
        if node.op != "get_attr":
            continue
        value = _get_attr(gm, str(node.target))
        if not isinstance(value, Tensor):
            continue
        holder_name = f"_hp_attr{i}"
        gm.add_submodule(holder_name, _AttrHolder(value))
        renames[f"{holder_name}.value"] = str(node.target)
        with gm.graph.inserting_before(node):
            new = gm.graph.call_module(holder_name)
        new.meta = dict(node.meta)
        node.replace_all_uses_with(new)
        gm.graph.erase_node(node)
    gm.graph.lint()
    gm.recompile()
    return renames


def trace_module(module: nn.Module) -> tuple[fx.GraphModule, dict[str, str]]:
    """``torch.fx.symbolic_trace`` plus :func:`rewrite_tensor_attrs`, without shape propagation.

    Raises:
        ModelError: the module cannot be traced symbolically.
    """
    try:
        gm = fx.symbolic_trace(module)
    except Exception as exc:  # fx raises many types (TraceError, TypeError, ...)
        raise ModelError(
            f"cannot trace {type(module).__name__} with torch.fx ({type(exc).__name__}: {exc}); "
            "remove data-dependent Python control flow from forward()"
        ) from exc
    return gm, rewrite_tensor_attrs(gm)


def _get_attr(gm: nn.Module, target: str) -> Any:
    obj: Any = gm
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj


def _op_name(node: fx.Node, gm: fx.GraphModule) -> str:
    if node.op in ("placeholder", "output"):
        return node.op
    if node.op == "call_module":
        return type(gm.get_submodule(str(node.target))).__name__
    target = node.target
    return getattr(target, "__name__", str(target))


class StageModule(nn.Module):
    """A contiguous range of layers as a module: crossing tensors in, crossing tensors out.

    ``forward(*inputs)`` takes the tensors crossing the stage's first cut (in
    ``input_names`` order) and returns those crossing its last cut (``output_names``
    order), passing skip tensors through. The last stage returns the model's output
    in its original structure instead.
    """

    def __init__(
        self,
        inner: nn.Module | None,
        inner_inputs: tuple[str, ...],
        inner_outputs: tuple[str, ...],
        input_names: tuple[str, ...],
        output_names: tuple[str, ...],
        output_structure: Any = None,
    ) -> None:
        super().__init__()
        self.inner = inner
        self.inner_inputs = inner_inputs
        self.inner_outputs = inner_outputs
        self.input_names = input_names
        self.output_names = output_names
        self.output_structure = output_structure  # fx output args, for the last stage

    def forward(self, *inputs: Any) -> Any:
        if len(inputs) != len(self.input_names):
            raise ModelError(
                f"stage expects {len(self.input_names)} inputs {self.input_names}, got {len(inputs)}"
            )
        env: dict[str, Any] = dict(zip(self.input_names, inputs, strict=True))
        if self.inner is not None:
            result = self.inner(*(env[n] for n in self.inner_inputs))
            if len(self.inner_outputs) == 1:
                result = (result,)
            env.update(zip(self.inner_outputs, result, strict=True))
        if self.output_structure is not None:
            return fx.node.map_aggregate(
                self.output_structure, lambda a: env[a.name] if isinstance(a, fx.Node) else a
            )
        return tuple(env[n] for n in self.output_names)


class ModelGraph:
    """A traced model as a layer DAG with shapes, bytes and cut information.

    Build with :meth:`from_module` or :meth:`from_spec`. Attributes:
        gm: the traced (and attribute-rewritten) ``GraphModule``.
        layers: the layers in topological order.
        dag: ``networkx.DiGraph`` over layer indices, edges weighted by ``bytes``.
        crossing: ``crossing[k]`` = layers whose output crosses cut ``k``.
        param_renames: holder parameter name -> original qualified name.
    """

    def __init__(self, gm: fx.GraphModule, param_renames: dict[str, str]) -> None:
        self.gm = gm
        self.param_renames = param_renames
        self._nodes = [n for n in gm.graph.nodes]
        index = {n: i for i, n in enumerate(self._nodes)}
        self._index = index
        owner: dict[int, int] = {}  # id(param) -> first layer index using it
        layers: list[Layer] = []
        for i, node in enumerate(self._nodes):
            preds = tuple(sorted({index[a] for a in node.all_input_nodes}))
            nbytes, shapes = _meta_bytes(node.meta.get("tensor_meta"))
            pbytes = bbytes = 0
            names: list[str] = []
            if node.op == "call_module":
                sub = gm.get_submodule(str(node.target))
                for pname, p in sub.named_parameters():
                    if id(p) not in owner:
                        owner[id(p)] = i
                        pbytes += p.numel() * p.element_size()
                        qual = f"{node.target}.{pname}"
                        names.append(param_renames.get(qual, qual))
                for _, b in sub.named_buffers():
                    if id(b) not in owner:
                        owner[id(b)] = i
                        bbytes += b.numel() * b.element_size()
            if node.op == "output":
                nbytes, shapes = 0, []
            layers.append(
                Layer(
                    i,
                    node.name,
                    _op_name(node, gm),
                    preds,
                    tuple(shapes),
                    nbytes,
                    pbytes,
                    bbytes,
                    tuple(names),
                )
            )
        self.layers: tuple[Layer, ...] = tuple(layers)
        self.crossing = crossing_sets([lay.inputs for lay in layers])
        dag = nx.DiGraph()
        for lay in layers:
            dag.add_node(lay.index, name=lay.name, op=lay.op)
            for src in lay.inputs:
                dag.add_edge(src, lay.index, bytes=layers[src].act_bytes)
        self.dag = dag

    # ------------------------------------------------------------ construction

    @classmethod
    def from_module(
        cls, module: nn.Module, inputs: tuple[Tensor, ...], *, fake: bool = True
    ) -> ModelGraph:
        """Trace ``module`` with ``torch.fx`` and propagate the shapes of ``inputs``.

        Args:
            module: any traceable module (``nn.Sequential``, residual nets, transformers, ...).
            inputs: one sample minibatch of positional inputs.
            fake: propagate shapes with fake tensors (no compute, works for ImageNet-sized
                models in well under a second); ``False`` runs the real forward.

        Raises:
            ModelError: the module cannot be traced symbolically.
        """
        gm, renames = trace_module(module)
        try:
            if fake:
                from torch._subclasses.fake_tensor import FakeTensorMode

                ShapeProp(gm, fake_mode=FakeTensorMode(allow_non_fake_inputs=True)).propagate(
                    *inputs
                )
            else:
                with torch.no_grad():
                    ShapeProp(gm).propagate(*inputs)
        except Exception as exc:  # shape errors surface as RuntimeError/TypeError from user code
            raise ModelError(
                f"running {type(module).__name__} on the sample input failed: {exc}"
            ) from exc
        return cls(gm, renames)

    @classmethod
    def from_spec(cls, spec: ModelSpec, *, fake: bool = True) -> ModelGraph:
        """Build the graph of a resolved model with its sample inputs."""
        return cls.from_module(spec.module, spec.inputs, fake=fake)

    # ------------------------------------------------------------ queries

    def __len__(self) -> int:
        return len(self.layers)

    @property
    def names(self) -> list[str]:
        """Layer names in linear order."""
        return [lay.name for lay in self.layers]

    def index_of(self, name: str) -> int:
        """Index of the layer called ``name``."""
        for lay in self.layers:
            if lay.name == name:
                return lay.index
        raise ModelError(f"no layer named {name!r} in the model graph ({len(self.layers)} layers)")

    def cut_names(self, cut: int) -> tuple[str, ...]:
        """Names of the tensors crossing cut ``cut`` (between layers ``cut-1`` and ``cut``)."""
        return tuple(self.layers[i].name for i in self.crossing[cut])

    def cut_bytes(self, cut: int) -> int:
        """Bytes crossing cut ``cut`` for one minibatch, skip connections included."""
        return sum(self.layers[i].act_bytes for i in self.crossing[cut])

    # ------------------------------------------------------------ stages

    def _check_cuts(self, cuts: Sequence[int]) -> list[int]:
        bounds = [0, *cuts, len(self.layers)]
        for a, b in itertools.pairwise(bounds):
            if not a < b:
                raise ModelError(
                    f"cut points must be strictly increasing within 1..{len(self.layers) - 1}, got {list(cuts)}"
                )
        return bounds

    def stage_of_layer(self, cuts: Sequence[int]) -> list[int]:
        """Stage index of every layer for the given cut points."""
        bounds = self._check_cuts(cuts)
        stage = []
        s = 0
        for i in range(len(self.layers)):
            while i >= bounds[s + 1]:
                s += 1
            stage.append(s)
        return stage

    def build_stages(self, cuts: Sequence[int], only: int | None = None) -> list[StageModule]:
        """Split the model at ``cuts`` with ``torch.fx.passes.split_module``.

        Args:
            cuts: strictly increasing cut points; ``len(cuts) + 1`` stages.
            only: build just this stage; the list then holds that one module.

        Returns:
            One :class:`StageModule` per stage, sharing parameters with the traced model.
        """
        stage = self.stage_of_layer(cuts)
        n_stages = len(cuts) + 1
        split = split_module(
            self.gm,
            self.gm,
            lambda node: stage[self._index[node]],
            keep_original_node_name=True,
        )
        children = dict(split.named_children())
        self._check_param_ownership(children)
        output_node = self._nodes[-1]
        bounds = [0, *cuts, len(self.layers)]
        result = []
        wanted = range(n_stages) if only is None else [only]
        for s in wanted:
            inner = cast("fx.GraphModule | None", children.get(f"submod_{s}"))
            inner_in: tuple[str, ...] = ()
            inner_out: tuple[str, ...] = ()
            if inner is not None:
                sub_graph = inner.graph
                inner_in = tuple(n.name for n in sub_graph.nodes if n.op == "placeholder")
                out_arg = next(n for n in sub_graph.nodes if n.op == "output").args[0]
                outs = out_arg if isinstance(out_arg, (tuple, list)) else (out_arg,)
                inner_out = tuple(o.name for o in outs)
            in_names = (
                self.cut_names(bounds[s])
                if s > 0
                else tuple(lay.name for lay in self.layers if lay.op == "placeholder")
            )
            last = s == n_stages - 1
            out_names = () if last else self.cut_names(bounds[s + 1])
            structure = output_node.args[0] if last else None
            result.append(StageModule(inner, inner_in, inner_out, in_names, out_names, structure))
        return result

    def _check_param_ownership(self, children: dict[str, nn.Module]) -> None:
        seen: dict[int, str] = {}
        for name, child in children.items():
            for pname, p in child.named_parameters():
                if id(p) in seen and seen[id(p)] != name:
                    raise ModelError(
                        f"parameter {pname!r} is used by two stages ({seen[id(p)]}, {name}); "
                        "shared weights must stay on one stage: move the cut"
                    )
                seen[id(p)] = name

    def original_param_name(self, stage_param_name: str) -> str:
        """Map a stage parameter name (``inner.layers.0.conv1.weight``) to the original model's name."""
        name = stage_param_name.removeprefix("inner.")
        return self.param_renames.get(name, name)
