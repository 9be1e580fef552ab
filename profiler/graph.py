"""The model graph: any ``nn.Module`` as a layer DAG in a topological linear order.

A *layer* is one node of the ``torch.fx`` graph: the model inputs (``placeholder``),
every operation (``call_module``, ``call_function``, ``call_method``) and the model
output. Layers are numbered in graph order, which is topological, so a pipeline
partition is a list of cut points ``0 < c1 < c2 < ... < L``; stage ``s`` holds layers
``[c_s, c_{s+1})``. The tensors that cross a cut (skip connections included) are
exactly the outputs of earlier layers that a later layer (or the model output) uses;
the runtime forwards them stage to stage and the cost model charges for them.

The graph comes from :mod:`profiler.capture` (``torch.fx`` or ``torch.export``), where every
tensor attribute is read through a holder module placed with its user. Layers carry a
*position* for cuts: a holder counts at its user and a ``getitem`` of a tuple at the tuple's
producer, so only tensors (activations, token ids, masks) ever cross a cut; a parameter read
on two stages (tied embeddings) is held by both (:meth:`ModelGraph.shared_params`).
Stage modules (:mod:`profiler.stages`) are built with ``torch.fx.passes.split_module`` on the
captured graph; the tensors crossing each cut are :func:`profiler.crossing.crossing_sets`.
"""

from __future__ import annotations

import bisect
import hashlib
import itertools
import operator
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, cast

import networkx as nx
import torch
import torch.fx as fx
from torch import Tensor, nn
from torch.fx.passes.shape_prop import ShapeProp, TensorMetadata
from torch.fx.passes.split_module import split_module
from torch.utils import _pytree as pytree

from profiler.capture import HOLDER_PREFIX, capture, quiet_treespec
from profiler.crossing import crossing_sets
from profiler.errors import ModelError
from profiler.models import ModelSpec
from profiler.stages import StageModule, inner_signature, refs

__all__ = ["Layer", "ModelGraph", "trace_module"]


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


def trace_module(
    module: nn.Module, inputs: tuple[Tensor, ...] | None = None
) -> tuple[fx.GraphModule, dict[str, str]]:
    """Capture ``module`` (:func:`profiler.capture.capture`) without shape propagation.

    Raises:
        ModelError: the module cannot be captured.
    """
    cap = capture(module, inputs)
    return cap.gm, cap.param_renames


def _op_name(node: fx.Node, gm: fx.GraphModule) -> str:
    if node.op in ("placeholder", "output"):
        return node.op
    if node.op == "call_module":
        return type(gm.get_submodule(str(node.target))).__name__
    target = node.target
    return getattr(target, "__name__", str(target))


def _is_holder(node: fx.Node) -> bool:
    return node.op == "call_module" and str(node.target).startswith(HOLDER_PREFIX)


def _sample_failure(model: str, exc: BaseException) -> str:
    """One line for a forward that fails on the sample: the node, the error's first line and
    what to check (ShapeProp's own text is a multi-line graph dump)."""
    text = str(exc).strip()
    lines = text.splitlines()
    first = lines[0][:200] if lines else type(exc).__name__
    node = re.search(r"While executing %(\w+)", text)
    at = f" at node {node.group(1)!r}" if node else ""
    return (
        f"running {model} on the sample input failed{at}: {type(exc).__name__}: {first}; "
        "check the sample's shapes and dtypes against the forward's arguments"
    )


class ModelGraph:
    """A captured model as a layer DAG with shapes, bytes and cut information.

    Build with :meth:`from_module` or :meth:`from_spec`. Attributes:
        gm: the captured ``GraphModule`` (tensor attributes behind holder modules).
        layers: the layers in topological order.
        dag: ``networkx.DiGraph`` over layer indices, edges weighted by ``bytes``.
        positions: where each layer counts for cuts (a holder at its user, a getitem of a
            tuple at its producer); stage ``s`` holds the layers positioned in its range.
        crossing: ``crossing[k]`` = layers whose output crosses cut ``k``.
        param_renames: holder parameter name -> original qualified name.
        out_spec: pytree spec of an exported model's output (``None`` for fx).
        input_names: keyword names of the model inputs in placeholder order (``()``: positional).
    """

    def __init__(
        self,
        gm: fx.GraphModule,
        param_renames: dict[str, str],
        out_spec: Any = None,
        input_names: tuple[str, ...] = (),
    ) -> None:
        self.gm = gm
        self.param_renames = param_renames
        self.out_spec = out_spec
        self.input_names = input_names
        self._nodes = [n for n in gm.graph.nodes]
        index = {n: i for i, n in enumerate(self._nodes)}
        self._index = index
        self.positions = self._positions()
        owner: dict[int, int] = {}  # id(param) -> first layer index using it
        layers: list[Layer] = []
        for i, node in enumerate(self._nodes):
            # a parameter is not an activation: its bytes go to the layer reading it
            preds = tuple(sorted({index[a] for a in node.all_input_nodes if not _is_holder(a)}))
            nbytes, shapes = _meta_bytes(node.meta.get("tensor_meta"))
            pbytes = bbytes = 0
            names: list[str] = []
            for mod in self._owned_modules(node):
                for pname, p in gm.get_submodule(mod).named_parameters():
                    if id(p) not in owner:
                        owner[id(p)] = i
                        pbytes += p.numel() * p.element_size()
                        qual = f"{mod}.{pname}"
                        names.append(param_renames.get(qual, qual))
                for _, b in gm.get_submodule(mod).named_buffers():
                    if id(b) not in owner:
                        owner[id(b)] = i
                        bbytes += b.numel() * b.element_size()
            if node.op == "output" or _is_holder(node):
                nbytes, shapes = 0, []
            op = "param" if _is_holder(node) else _op_name(node, gm)
            layers.append(
                Layer(i, node.name, op, preds, tuple(shapes), nbytes, pbytes, bbytes, tuple(names))
            )
        self.layers: tuple[Layer, ...] = tuple(layers)
        inputs = [tuple(index[a] for a in n.all_input_nodes) for n in self._nodes]
        self.crossing = crossing_sets(inputs, self.positions)
        dag = nx.DiGraph()
        for lay in layers:
            dag.add_node(lay.index, name=lay.name, op=lay.op)
            for src in lay.inputs:
                dag.add_edge(src, lay.index, bytes=layers[src].act_bytes)
        self.dag = dag

    def _owned_modules(self, node: fx.Node) -> list[str]:
        """Submodules whose parameters ``node`` uses: its own, and those of the holders it reads."""
        mods = [str(a.target) for a in node.all_input_nodes if _is_holder(a)]
        if node.op == "call_module" and not _is_holder(node):
            mods.append(str(node.target))
        return mods

    def _positions(self) -> list[int]:
        index = self._index
        pos = list(range(len(self._nodes)))
        for i, node in enumerate(self._nodes):
            if node.target is operator.getitem and node.args:
                src = node.args[0]
                if isinstance(src, fx.Node) and not isinstance(
                    src.meta.get("tensor_meta"), TensorMetadata
                ):
                    pos[i] = pos[index[src]]  # stays with the tuple it unpacks
        for i, node in enumerate(self._nodes):
            if _is_holder(node) and len(node.users) == 1:
                pos[i] = pos[index[next(iter(node.users))]]  # lives with its one user
        return pos

    # ------------------------------------------------------------ construction

    @classmethod
    def from_module(
        cls,
        module: nn.Module,
        inputs: tuple[Tensor, ...],
        *,
        fake: bool = True,
        input_names: Sequence[str] = (),
    ) -> ModelGraph:
        """Capture ``module`` (:func:`profiler.capture.capture`) and propagate the shapes of ``inputs``.

        Args:
            module: any module ``torch.fx`` or ``torch.export`` captures.
            inputs: one sample minibatch of inputs (positional, or keyword with ``input_names``).
            fake: propagate shapes with fake tensors (no compute, works for ImageNet-sized
                models in well under a second); ``False`` runs the real forward.
            input_names: keyword names of ``inputs`` (the model is called as ``module(**batch)``).

        Raises:
            ModelError: the module cannot be captured or fails on the sample input.
        """
        cap = capture(module, inputs, input_names)
        flat = inputs
        if cap.input_names:
            given = dict(zip(input_names, inputs, strict=True))
            flat = tuple(given[n] for n in cap.input_names)
        try:
            if fake:
                from torch._subclasses.fake_tensor import FakeTensorMode

                with quiet_treespec():  # ShapeProp deep-copies the graph's pytree specs
                    ShapeProp(
                        cap.gm, fake_mode=FakeTensorMode(allow_non_fake_inputs=True)
                    ).propagate(*flat)
            else:
                with torch.no_grad():
                    ShapeProp(cap.gm).propagate(*flat)
        except Exception as exc:  # shape errors surface as RuntimeError/TypeError from user code
            raise ModelError(_sample_failure(type(module).__name__, exc)) from exc
        return cls(cap.gm, cap.param_renames, cap.out_spec, cap.input_names)

    @classmethod
    def from_spec(cls, spec: ModelSpec, *, fake: bool = True) -> ModelGraph:
        """Build the graph of a resolved model with its sample inputs."""
        return cls.from_module(spec.module, spec.inputs, fake=fake, input_names=spec.input_names)

    # ------------------------------------------------------------ queries

    def flat_inputs(self, inputs: tuple[Any, ...], names: Sequence[str] = ()) -> tuple[Any, ...]:
        """``inputs`` (keyword ``names`` for a ``module(**batch)`` model) in placeholder order."""
        if not self.input_names:
            return inputs
        given = dict(zip(names, inputs, strict=True))
        return tuple(given[n] for n in self.input_names)

    def structured_output(self, flat: Any) -> Any:
        """The graph's flat output in the model's own structure (e.g. a ``ModelOutput``)."""
        if self.out_spec is None:
            return flat
        return pytree.tree_unflatten(list(flat), self.out_spec)

    def fingerprint(self) -> str:
        """A digest of the graph: every layer's op, inputs, output shapes and parameter bytes.

        Two models with the same fingerprint have the same profile table layout and sizes.
        """
        h = hashlib.sha256()
        for lay in self.layers:
            h.update(
                f"{lay.op}|{lay.inputs}|{lay.out_shapes}|{lay.param_bytes}|{lay.buffer_bytes};".encode()
            )
        for node in self._nodes:
            meta = node.meta.get("tensor_meta")
            if node.op == "placeholder" and isinstance(meta, TensorMetadata):
                h.update(f"{meta.dtype};".encode())
        return h.hexdigest()[:16]

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
        """Stage index of every layer for the given cut points (by its position)."""
        bounds = self._check_cuts(cuts)
        return [bisect.bisect_right(bounds, p) - 1 for p in self.positions]

    def shared_params(self, cuts: Sequence[int]) -> dict[str, tuple[int, ...]]:
        """Original names of the parameters read on several stages -> those stages (tied weights)."""
        stage = self.stage_of_layer(cuts)
        where: dict[str, set[int]] = {}
        for i, node in enumerate(self._nodes):
            if node.op == "call_module":  # a holder, or a module called more than once (fx)
                for pname, _ in self.gm.get_submodule(str(node.target)).named_parameters():
                    qual = f"{node.target}.{pname}"
                    where.setdefault(self.param_renames.get(qual, qual), set()).add(stage[i])
        return {n: tuple(sorted(s)) for n, s in where.items() if len(s) > 1}

    def build_stages(self, cuts: Sequence[int], only: int | None = None) -> list[StageModule]:
        """Split the model at ``cuts`` with ``torch.fx.passes.split_module``.

        Args:
            cuts: strictly increasing cut points; ``len(cuts) + 1`` stages.
            only: build just this stage; the list then holds that one module.

        Returns:
            One :class:`StageModule` per stage, sharing parameters with the captured model
            (a tied parameter appears in every stage that reads it).
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
        output_node = self._nodes[-1]
        bounds = [0, *cuts, len(self.layers)]
        result = []
        wanted = range(n_stages) if only is None else [only]
        for s in wanted:
            inner = cast("fx.GraphModule | None", children.get(f"submod_{s}"))
            inner_in, inner_out, clone = inner_signature(inner)
            in_names = (
                self.cut_names(bounds[s])
                if s > 0
                else tuple(lay.name for lay in self.layers if lay.op == "placeholder")
            )
            last = s == n_stages - 1
            out_names = () if last else self.cut_names(bounds[s + 1])
            structure = refs(output_node.args[0]) if last else None
            result.append(
                StageModule(
                    inner,
                    inner_in,
                    inner_out,
                    in_names,
                    out_names,
                    structure,
                    self.out_spec if last else None,
                    frozenset(clone & set(in_names)) if s > 0 else frozenset(),
                )
            )
        return result

    def original_param_name(self, stage_param_name: str) -> str:
        """Map a stage parameter name (``inner.layers.0.conv1.weight``) to the original model's name."""
        name = stage_param_name.removeprefix("inner.")
        return self.param_renames.get(name, name)
