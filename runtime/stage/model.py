"""Building one stage's module, and nothing more of the model, with deterministic weights.

For a model reference (``mlp``, ``pkg.mod:factory``) each stage process builds the model on
the ``meta`` device, splits it with :meth:`ModelGraph.build_stages` and materialises only its
own stage: every submodule is re-initialised with its own ``reset_parameters()`` under a
seed derived from ``(seed, submodule name)``. The names are the flat names the splitter gives
(``layers_1_conv1``), identical whatever the cuts, so a single-process reference built with no
cuts (:func:`reference_module`) has bit-identical initial weights. Models with a parameter or
buffer owner that has no ``reset_parameters`` (e.g. a bare positional-embedding parameter)
fall back to building the whole model on CPU under ``torch.manual_seed(seed)`` first.

A user's ``nn.Module`` keeps its own initial weights. The parent captures it once per run
(:func:`model_graph`, kept in ``ModelSource.cache`` by batch size): planning, the run's data,
the shards' layout, pacing and shipping all read that one capture. It is split as given,
once per cut list (:func:`ship_stage`, kept there by batch size and cuts), and the launcher
puts each stage's piece in its job; each stage process receives its stage alone and each
parameter-server shard its own initial weights (:func:`ship_shard`), as one ``torch.save``
blob each (:class:`runtime.config.ModelSource`).
"""

from __future__ import annotations

import dataclasses
import logging
import zlib
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from profiler.errors import ModelError
from profiler.graph import ModelGraph
from profiler.host_memory import building, check_fits_host
from profiler.models import ModelSpec, output_loss, resolve_model, resolve_model_for_graph
from profiler.stages import StageModule
from runtime.config import LossFn, ModelSource
from runtime.stage.comm import TensorSpec, cut_specs
from runtime.stage.tied import TiedParam, tied_params

__all__ = [
    "BuiltStage",
    "build_stage",
    "initial_weights",
    "model_graph",
    "original_names",
    "reference_module",
    "resolve_source",
    "ship_shard",
    "ship_stage",
    "stage_rng_seed",
]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class BuiltStage:
    """A materialised stage with what the worker needs from the graph (all of it picklable,
    the graph aside: a shipped stage has none).

    Attributes:
        module: the stage module (only this stage's parameters exist).
        loss: the loss function.
        names: stage parameter name -> original model parameter name.
        buffer_names: stage buffer name -> original model buffer name (batch-norm statistics).
        meta_built: whether the model was built on the meta device.
        cuts, stage: which stage of which split this is.
        in_specs, out_specs: the tensors crossing its first and last cut (the graph's dtypes).
        tied: its VW's tied parameters (:func:`runtime.stage.tied.tied_params`).
        input_names: keyword names of the model inputs (``()``: positional).
        inputs, targets: the sample minibatch (possibly on ``meta``; shapes and dtypes valid).
        model_name: the model's display name.
        graph: the model graph (parameters on ``meta`` when built that way); ``None`` when shipped.
    """

    module: StageModule
    loss: LossFn
    names: dict[str, str]
    meta_built: bool
    cuts: tuple[int, ...]
    stage: int
    in_specs: tuple[TensorSpec, ...]
    out_specs: tuple[TensorSpec, ...]
    tied: dict[str, TiedParam]
    input_names: tuple[str, ...]
    inputs: tuple[Tensor, ...]
    targets: Tensor
    model_name: str
    graph: ModelGraph | None = None
    buffer_names: dict[str, str] = dataclasses.field(default_factory=dict)


def _built(
    graph: ModelGraph,
    spec: ModelSpec,
    module: StageModule,
    loss: LossFn,
    cuts: Sequence[int],
    stage: int,
    meta_built: bool,
) -> BuiltStage:
    bounds = [0, *cuts, len(graph.layers)]
    last = stage == len(cuts)
    return BuiltStage(
        module, loss, original_names(graph, module), meta_built, tuple(cuts), stage,
        cut_specs(graph, bounds[stage]) if stage > 0 else (),
        () if last else cut_specs(graph, bounds[stage + 1]),
        tied_params(graph, cuts), graph.input_names, spec.inputs, spec.targets, spec.name, graph,
        original_names(graph, module, buffers=True),
    )  # fmt: skip


def _key_seed(seed: int, name: str) -> int:
    return (seed * 1_000_003 + zlib.crc32(name.encode())) % (2**63)


def stage_rng_seed(seed: int, vw: int, stage: int) -> int:
    """The seed of a stage process's global RNG (dropout masks) before its first task: fixed by
    ``(seed, vw, stage)``, so runs repeat (a new process's RNG is seeded at random)."""
    return _key_seed(seed, f"rng/vw{vw}/stage{stage}")


def _owners(module: nn.Module) -> list[tuple[str, nn.Module]]:
    return [
        (name, m)
        for name, m in module.named_modules()
        if any(True for _ in m.parameters(recurse=False))
        or any(True for _ in m.buffers(recurse=False))
    ]


def _resettable(module: nn.Module) -> bool:
    return all(callable(getattr(m, "reset_parameters", None)) for _, m in _owners(module))


def _seeded_reset(module: nn.Module, seed: int) -> None:
    """Re-initialise every resettable submodule under a seed derived from its flat name."""
    with torch.no_grad():
        for name, m in _owners(module):
            reset = getattr(m, "reset_parameters", None)
            if callable(reset):
                with torch.random.fork_rng(devices=[]):
                    torch.manual_seed(_key_seed(seed, name.removeprefix("inner.")))
                    reset()


def resolve_source(source: ModelSource, batch_size: int, meta: bool) -> ModelSpec:
    """The :class:`ModelSpec` of ``source`` (on the meta device when ``meta``)."""
    if source.module is not None:
        targets = (
            source.sample_targets if source.sample_targets is not None else torch.zeros(batch_size)
        )
        return ModelSpec(
            type(source.module).__name__,
            source.module,
            source.sample_inputs,
            targets,
            output_loss if source.input_names else F.cross_entropy,
            batch_size,
            source.input_names,
        )
    if source.ref is None:
        raise ModelError("model source has neither a reference nor a module")
    if meta:  # on CPU when the graph could depend on the device (see resolve_model_for_graph)
        return resolve_model_for_graph(source.ref, batch_size)
    return resolve_model(source.ref, batch_size)


def model_graph(source: ModelSource, spec: ModelSpec) -> ModelGraph:
    """The captured graph of ``source``, resolved as ``spec`` (:func:`resolve_source`).

    A user's module is captured once per batch size and kept in ``source.cache`` (key
    ``("graph", batch size)``), so the parent captures it once per run however many steps
    read it; a model reference is captured from ``spec`` each time (each process resolves
    its own, on the meta device where it can).

    Raises:
        ModelError: the model cannot be captured.
    """
    if source.module is None:
        return ModelGraph.from_spec(spec)
    key = ("graph", spec.batch_size)
    if key not in source.cache:
        source.cache[key] = ModelGraph.from_spec(spec)
    graph: ModelGraph = source.cache[key]
    return graph


def original_names(graph: ModelGraph, stage: nn.Module, buffers: bool = False) -> dict[str, str]:
    """Map each stage parameter name (``inner.layers_1_conv1.weight``) to the model's
    (``layers.1.conv1.weight``); with ``buffers``, each buffer name (``running_mean``)."""
    flat = {
        str(n.target).replace(".", "_"): str(n.target)
        for n in graph.gm.graph.nodes
        if n.op == "call_module"
    }
    out = {}
    named = stage.named_buffers() if buffers else stage.named_parameters()
    for name, _ in named:
        mod, _, pname = name.removeprefix("inner.").rpartition(".")
        full = f"{flat.get(mod, mod)}.{pname}"
        out[name] = graph.param_renames.get(full, full)
    return out


def build_stage(
    source: ModelSource, batch_size: int, cuts: Sequence[int], stage: int, seed: int
) -> BuiltStage:
    """Build stage ``stage`` of the model split at ``cuts``, with deterministic weights.

    Raises:
        ModelError: the model cannot be built, traced or split at ``cuts``, or a shipped
            stage is another one.
    """
    if source.stage is not None:
        built: BuiltStage = source.stage
        if (built.cuts, built.stage) != (tuple(cuts), stage):
            raise ModelError(
                f"received stage {built.stage} of cuts {list(built.cuts)}, not stage {stage} of "
                f"{list(cuts)}: the launcher shipped the wrong stage"
            )
        return built
    if source.module is not None:
        spec = resolve_source(source, batch_size, meta=False)
        graph = model_graph(source, spec)
        module = graph.build_stages(cuts, only=stage)[0]
        meta_built = False
    else:
        spec, graph, module, meta_built = _build_from_ref(source, batch_size, cuts, stage, seed)
    loss = source.loss if source.loss is not None else spec.loss
    return _built(graph, spec, module, loss, cuts, stage, meta_built)


def ship_stage(
    source: ModelSource, batch_size: int, cuts: Sequence[int], stage: int
) -> ModelSource:
    """What the process of stage ``stage`` receives: of a user's module, that stage alone
    (the module's one capture, :func:`model_graph`, is split once per cut list here and the
    stages kept in ``source.cache``; they share the module's parameters, so its initial
    weights are kept); a model reference as it is (the process builds only its stage from it,
    :func:`build_stage`). The launcher calls it once per stage, building the stage's job.

    Raises:
        ModelError: the module cannot be captured or split at ``cuts``.
    """
    if source.module is None:
        return source
    key = ("stages", batch_size, tuple(cuts))
    if key not in source.cache:
        spec = resolve_source(source, batch_size, meta=False)
        graph = model_graph(source, spec)
        loss = source.loss if source.loss is not None else spec.loss
        source.cache[key] = [
            _built(graph, spec, m, loss, cuts, s, False)
            for s, m in enumerate(graph.build_stages(cuts))
        ]
    built = dataclasses.replace(source.cache[key][stage], graph=None)
    return ModelSource(stage=built, input_names=source.input_names)


def ship_shard(source: ModelSource, names: Sequence[str]) -> ModelSource:
    """What a parameter-server shard receives: of a user's module, the initial weights of the
    parameters ``names`` (original names) alone; a model reference as it is."""
    if source.module is None:
        return source
    params = dict(source.module.named_parameters(remove_duplicate=False))
    return ModelSource(weights={n: params[n].detach().clone() for n in names})


def _build_from_ref(
    source: ModelSource, batch_size: int, cuts: Sequence[int], stage: int, seed: int
) -> tuple[ModelSpec, ModelGraph, StageModule, bool]:
    try:
        spec = resolve_source(source, batch_size, meta=True)
        graph = ModelGraph.from_spec(spec)
        module = graph.build_stages(cuts, only=stage)[0]
        meta_ok = _resettable(module) and _resettable(spec.module)
    except ModelError:
        raise
    except Exception as exc:  # a user factory that cannot run on meta: build on CPU instead
        log.info(
            "model %s cannot be built on the meta device (%s); building it on CPU", source.name, exc
        )
        meta_ok = False
    if meta_ok:
        check_fits_host(source.name, module)  # this stage's weights, still on meta
        with building(source.name):
            module.to_empty(device="cpu")
            _seeded_reset(module, seed)
        return spec, graph, module, True
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        spec = resolve_source(source, batch_size, meta=False)
    graph = ModelGraph.from_spec(spec)
    module = graph.build_stages(cuts, only=stage)[0]
    _seeded_reset(module, seed)
    return spec, graph, module, False


def reference_module(
    source: ModelSource, batch_size: int, seed: int
) -> tuple[StageModule, dict[str, str], LossFn]:
    """The whole model as one module with the same initial weights every pipeline gets.

    Returns:
        The module (its parameters named like the stages'), the map to original names, the loss
        (:func:`build_stage` with no cuts has the buffers' map too).
    """
    built = build_stage(source, batch_size, (), 0, seed)
    return built.module, built.names, built.loss


def initial_weights(source: ModelSource, batch_size: int, seed: int) -> dict[str, Tensor]:
    """The initial weights every pipeline starts from, by original name (a shard's own when
    it received only those, :func:`ship_shard`)."""
    if source.weights is not None:
        return source.weights
    module, names, _ = reference_module(source, batch_size, seed)
    return {names[n]: p.detach() for n, p in module.named_parameters()}


def sample_batch(spec: ModelSpec) -> tuple[tuple[Tensor, ...], Tensor]:
    """The spec's sample minibatch on CPU (zeros with the right shapes if it lives on meta)."""
    if spec.targets.device.type != "meta":
        return spec.inputs, spec.targets
    inputs = tuple(torch.zeros(x.shape, dtype=x.dtype) for x in spec.inputs)
    return inputs, torch.zeros(spec.targets.shape, dtype=spec.targets.dtype)
