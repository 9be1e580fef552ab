"""Graph capture: ``torch.fx.symbolic_trace`` where it works, ``torch.export`` where it does not.

``symbolic_trace`` is cheap and keeps ``nn.Module`` calls as single nodes (a ``Conv2d`` is one
layer). Library models (Hugging Face ``transformers``) branch on shapes and flags in Python and
cannot be traced symbolically; for those, and for models called with keyword inputs, the
model is captured with ``torch.export.export(..., strict=False)`` and its unlifted
``GraphModule`` (``ExportedProgram.module()``, ATen ops, parameters as ``get_attr``) is used.

Whichever path, every ``get_attr`` of a tensor (parameter, buffer or constant) is then
rewritten the way ``torch.distributed.pipelining`` moves parameters into the submodule that
uses them: one holder-module call per *user*, placed right before that user, so a parameter
always lives on the stage that reads it and never crosses a cut as an activation. A parameter
read on two stages (GPT-2's tied input and output embeddings) is then held by both.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import re
import traceback
import warnings
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx
from torch import Tensor, nn

from profiler.errors import ModelError

__all__ = [
    "HOLDER_PREFIX",
    "Captured",
    "capture",
    "keyword_order",
    "quiet_treespec",
    "rewrite_tensor_attrs",
]

log = logging.getLogger(__name__)

HOLDER_PREFIX = "_hp_attr"


@contextlib.contextmanager
def quiet_treespec() -> Iterator[None]:
    """Silence torch's own ``LeafSpec`` deprecation while a captured graph is copied or
    (un)pickled.

    An exported ``GraphModule`` carries pytree specs; torch 2.13's ``copy``/``pickle`` of them
    rebuilds ``LeafSpec`` objects through ``copyreg``, and that constructor warns
    (``FutureWarning: isinstance(treespec, LeafSpec) is deprecated``) from torch's code, not
    the caller's. Every Hugging Face stage process printed it three times. Only that one
    message is filtered, only inside the block.
    """
    with warnings.catch_warnings():
        warnings.filterwarnings(
            "ignore", message=r".*isinstance\(treespec, LeafSpec\)", category=FutureWarning
        )
        yield


@dataclass(frozen=True)
class Captured:
    """A captured model.

    Attributes:
        gm: the graph module (holders in place of tensor ``get_attr`` nodes).
        param_renames: holder parameter/buffer name (``_hp_attr3.value``) -> the model's name.
        out_spec: pytree spec of the model's output (``None``: the fx output structure is used).
        input_names: keyword names of the placeholders, in placeholder order (``()``: positional).
        exported: whether ``torch.export`` captured it.
    """

    gm: fx.GraphModule
    param_renames: dict[str, str]
    out_spec: Any = None
    input_names: tuple[str, ...] = ()
    exported: bool = False


class _AttrHolder(nn.Module):
    """Owns one tensor attribute so it can be placed on the stage(s) that read it."""

    def __init__(self, value: Tensor) -> None:
        super().__init__()
        if isinstance(value, nn.Parameter):
            self.value = value
        else:
            self.register_buffer("value", value)

    def forward(self) -> Tensor:
        return self.value  # type: ignore[no-any-return]


def _get_attr(root: nn.Module, target: str) -> Any:
    obj: Any = root
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj


def _canonical_names(module: nn.Module | None) -> dict[int, str]:
    """``id(tensor)`` -> the model's own name for it (first name of a tied parameter)."""
    if module is None:
        return {}
    names: dict[int, str] = {}
    for name, t in [*module.named_parameters(), *module.named_buffers()]:
        names.setdefault(id(t), name)
    return names


def rewrite_tensor_attrs(gm: fx.GraphModule, original: nn.Module | None = None) -> dict[str, str]:
    """Replace every ``get_attr`` of a tensor by holder calls, one per user, right before it.

    Args:
        gm: the graph module, edited in place.
        original: the captured model, to name tied tensors by their first name.

    Returns:
        Map from holder names (``_hp_attr3.value``) to the tensors' names in the model.
    """
    canonical = _canonical_names(original)
    renames: dict[str, str] = {}
    holders: dict[str, str] = {}  # get_attr target -> holder module name
    for node in list(gm.graph.nodes):
        if node.op != "get_attr":
            continue
        value = _get_attr(gm, str(node.target))
        if not isinstance(value, Tensor):
            continue
        holder = holders.get(str(node.target))
        if holder is None:
            holder = f"{HOLDER_PREFIX}{len(holders)}"
            holders[str(node.target)] = holder
            gm.add_submodule(holder, _AttrHolder(value))
            renames[f"{holder}.value"] = canonical.get(id(value), str(node.target))
        for user in list(node.users):
            with gm.graph.inserting_before(user):
                new = gm.graph.call_module(holder)
            new.meta = dict(node.meta)
            user.replace_input_with(node, new)
        gm.graph.erase_node(node)
    gm.graph.lint()
    gm.recompile()
    return renames


def _forward_params(module: nn.Module) -> list[inspect.Parameter]:
    """The parameters of ``module.forward`` (``[]`` when its signature cannot be read)."""
    try:
        return list(inspect.signature(module.forward).parameters.values())
    except (TypeError, ValueError):
        return []


def keyword_order(module: nn.Module, names: Sequence[str]) -> tuple[str, ...]:
    """The keys of a dict sample that ``module.forward`` takes, in its signature's order.

    ``labels`` is kept only if the forward takes it (or ``**kwargs``): otherwise it is the
    target of the loss. A forward with ``**kwargs`` takes every key (unknown ones last, sorted).

    Raises:
        ModelError: a key the forward does not take, or a forward argument without a default
            that no key gives (naming the argument and the fix).
    """
    params = _forward_params(module)
    known = [p.name for p in params if p.name in names and p.kind not in _VARIADIC]
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params) or not params:
        return (*known, *sorted(n for n in names if n not in known))
    model, signature = type(module).__name__, ", ".join(p.name for p in params)
    extra = [n for n in names if n not in known and n != "labels"]
    if extra:
        raise ModelError(
            f"sample key {extra[0]!r} is not an argument of {model}.forward({signature}): "
            "rename the key to the argument it is for, or drop it from the samples"
        )
    needed = [p.name for p in params if p.default is p.empty and p.kind not in _VARIADIC]
    lacking = [n for n in needed if n not in names]
    if lacking:
        raise ModelError(
            f"{model}.forward({signature}) needs {lacking[0]!r}, which the samples lack: "
            f"add a {lacking[0]!r} key to each sample (or give the argument a default)"
        )
    return tuple(known)


_VARIADIC = (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)


def _fx_defaults(module: nn.Module, given: int | None) -> dict[str, Any]:
    """The defaults of the forward arguments past the ``given`` positional sample inputs,
    fixed for ``symbolic_trace`` (a ``mask=None`` otherwise becomes a graph input with no
    value); ``given=None``: every argument that has a default.

    Raises:
        ModelError: an argument past the sample inputs has no default.
    """
    params = [p for p in _forward_params(module) if p.kind not in _VARIADIC]
    positional = [p for p in params if p.kind is not inspect.Parameter.KEYWORD_ONLY]
    if given is None:
        given = sum(1 for p in positional if p.default is p.empty)
    rest = positional[given:] + [p for p in params if p.kind is inspect.Parameter.KEYWORD_ONLY]
    for p in rest:
        if p.default is p.empty:
            raise ModelError(
                f"{type(module).__name__}.forward takes {p.name!r} (no default) but each "
                f"sample gives {given} input(s): make samples ((x, {p.name}, ...), y), or "
                f"dicts with a {p.name!r} key, or give {p.name!r} a default"
            )
    return {p.name: p.default for p in rest}


def _drop_fixed_inputs(gm: fx.GraphModule, names: Sequence[str]) -> None:
    """Remove the placeholders ``symbolic_trace`` keeps for the fixed (concrete) arguments
    ``names`` (fx calls them ``mask_1``) and the guards it puts on them: the graph's inputs
    are then the sample's."""
    guards = (torch._assert, fx._symbolic_trace._assert_is_none)
    for node in reversed(list(gm.graph.nodes)):
        if node.op == "call_function" and node.target in guards and not node.users:
            gm.graph.erase_node(node)
    gm.graph.eliminate_dead_code()
    for node in list(gm.graph.nodes):
        target = str(node.target)
        fixed = any(target == n or re.fullmatch(rf"{re.escape(n)}_\d+", target) for n in names)
        if node.op == "placeholder" and fixed and not node.users:
            gm.graph.erase_node(node)
    gm.graph.lint()
    gm.recompile()


def _clean_exported(gm: fx.GraphModule) -> None:
    """Drop export's guard call and unused runtime asserts (no data flows through them)."""
    for node in reversed(list(gm.graph.nodes)):
        if node.users or node.op not in ("call_module", "call_function"):
            continue
        name = str(getattr(node.target, "__name__", node.target))
        if node.op == "call_module" or "_assert" in name:
            gm.graph.erase_node(node)
    if hasattr(gm, "_guards_fn"):
        delattr(gm, "_guards_fn")
    gm.graph.lint()
    gm.recompile()


def _configs(module: nn.Module) -> Iterator[Any]:
    """Every model config reachable from ``module``: each submodule's ``config`` (T5's decoder
    stack keeps its own copy) and the sub-configs inside them (``decoder``, ``text_config``)."""
    seen: set[int] = set()
    for m in module.modules():
        todo = [getattr(m, "config", None)]
        while todo:
            cfg = todo.pop()
            if cfg is None or id(cfg) in seen or not hasattr(cfg, "to_dict"):
                continue
            seen.add(id(cfg))
            yield cfg
            todo += [v for v in vars(cfg).values() if hasattr(v, "to_dict")]


def _disable_cache(module: nn.Module) -> None:
    """Training needs no key/value cache; HF models return one by default (not exportable).
    Switched off in every config of the model, not only the top one: an encoder-decoder's
    decoder reads its own copy."""
    for cfg in _configs(module):
        if getattr(cfg, "use_cache", False):
            log.info("%s: use_cache set to False for capture", type(cfg).__name__)
            cfg.use_cache = False


def _where(exc: BaseException) -> str:
    """``file:line`` of the innermost frame outside torch, for error messages."""
    frames = traceback.extract_tb(exc.__traceback__)
    for fr in reversed(frames):
        if "/torch/" not in fr.filename and "/site-packages/torch" not in fr.filename:
            return f"{fr.filename}:{fr.lineno} ({fr.line})"
    return "unknown location"


def _export(module: nn.Module, inputs: tuple[Any, ...], names: tuple[str, ...]) -> Captured:
    _disable_cache(module)
    args: tuple[Any, ...] = () if names else inputs
    kwargs = dict(zip(names, inputs, strict=True)) if names else {}
    try:
        ep = torch.export.export(module, args, kwargs, strict=False)
    except Exception as exc:  # export raises many types (UserError, GuardOnDataDependent, ...)
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        raise ModelError(
            f"cannot capture {type(module).__name__} with torch.fx or torch.export "
            f"({type(exc).__name__} at {_where(exc)}: {first[:300]}); for an `if` on a tensor's "
            "value use torch.where or torch.cond, and switch off caches/optional outputs "
            "(e.g. config.use_cache=False) in the model's config"
        ) from exc
    gm = ep.module()
    if not isinstance(gm, fx.GraphModule):
        raise ModelError(f"torch.export of {type(module).__name__} gave no GraphModule")
    _clean_exported(gm)
    order: tuple[str, ...] = ()
    if names:
        import torch.fx._pytree as fx_pytree

        in_spec = getattr(gm, "_in_spec", None)
        flat = fx_pytree.tree_flatten_spec(((), {n: n for n in names}), in_spec)  # type: ignore[arg-type]
        order = tuple(str(n) for n in flat)
    codegen = gm.graph._codegen
    info = getattr(codegen, "pytree_info", None)
    out_spec = info.out_spec if info is not None else None
    # the graph's inputs and outputs are flat from here on (stage modules take flat tensors)
    gm.graph._codegen = fx.graph.CodeGen()
    renames = rewrite_tensor_attrs(gm, module)
    return Captured(gm, renames, out_spec, order, exported=True)


def capture(
    module: nn.Module,
    inputs: tuple[Any, ...] | None = None,
    input_names: Sequence[str] = (),
) -> Captured:
    """Capture ``module`` as a graph: ``symbolic_trace`` first, ``torch.export`` if that fails.

    Args:
        module: the model.
        inputs: one sample minibatch (needed by ``torch.export``; ``None`` = fx only).
        input_names: keyword names of ``inputs`` (the model is called as ``module(**batch)``);
            keyword inputs always go through ``torch.export``.

    Raises:
        ModelError: neither path captures the model (naming the file, line and a fix).
    """
    names = tuple(input_names)
    if not names:
        fixed = _fx_defaults(module, None if inputs is None else len(inputs))
        try:
            gm = fx.symbolic_trace(module, concrete_args=fixed or None)
            if fixed:
                _drop_fixed_inputs(gm, list(fixed))
        except Exception as exc:  # fx raises many types (TraceError, TypeError, ValueError, ...)
            if inputs is None:
                raise ModelError(
                    f"cannot trace {type(module).__name__} with torch.fx ({type(exc).__name__}: "
                    f"{exc}); give sample inputs so torch.export can capture it"
                ) from exc
            log.info(
                "torch.fx cannot trace %s (%s): using torch.export", type(module).__name__, exc
            )
        else:
            return Captured(gm, rewrite_tensor_attrs(gm, module))
    if inputs is None:
        raise ModelError(f"{type(module).__name__} takes keyword inputs: give sample inputs")
    return _export(module, inputs, names)


def as_keywords(
    batch: Mapping[str, Any], module: nn.Module
) -> tuple[tuple[str, ...], tuple[Any, ...]]:
    """A dict batch as ``(names, tensors)`` in the order of ``module.forward``'s signature."""
    names = keyword_order(module, list(batch))
    return names, tuple(batch[n] for n in names)
