"""Resolution of models by name: built-ins (:mod:`profiler.builtin_models`) and user factories.

Every model is returned as a :class:`ModelSpec`: the ``nn.Module``, one sample batch
(inputs and targets, with the batch size as the first dimension) and a loss function.
Built-in names: ``mlp``, ``resnet`` (small, CIFAR-shaped), ``transformer`` (small causal
language model), ``vgg19`` and ``resnet152`` (the paper's models, ImageNet shapes).
Custom models are named ``package.module:factory``; the factory takes ``batch_size``
(or nothing) and returns a ``ModelSpec``, a ``(module, (inputs, targets))`` pair or a
``(module, {name: tensor})`` pair for a model called with keyword inputs (Hugging Face
style, the loss taken from the model's output). The module is imported the way
``python -m`` does: the current directory comes first on the import path.
"""

from __future__ import annotations

import importlib
import inspect
import os
import re
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from profiler.builtin_models import BasicBlock, Bottleneck, ResNet, TinyTransformer, mlp, vgg19
from profiler.errors import HetPipeError, ModelError
from profiler.host_memory import allocation_error, building, check_fits_host, is_allocation_failure

__all__ = [
    "BUILTIN_MODELS",
    "ModelSpec",
    "import_factory",
    "keyword_spec",
    "output_loss",
    "resolve_model",
    "resolve_model_for_graph",
]

LossFn = Callable[[Any, Tensor], Tensor]


def output_loss(outputs: Any, targets: Tensor) -> Tensor:
    """The loss the model computed itself (Hugging Face models return ``loss`` given ``labels``).

    Raises:
        ModelError: the output carries no loss.
    """
    del targets  # the labels went into the model with the other inputs
    loss = outputs.get("loss") if isinstance(outputs, Mapping) else getattr(outputs, "loss", None)
    if loss is None and isinstance(outputs, (tuple, list)) and outputs:
        loss = outputs[0]
    if not isinstance(loss, Tensor) or loss.dim() != 0:
        raise ModelError(
            f"the model returned {type(outputs).__name__} without a scalar 'loss'; put 'labels' "
            "in each sample or give a loss function (loss_fn=...)"
        )
    return loss


def _raised_at(exc: BaseException) -> str:
    """``file:line`` of the innermost frame of ``exc``'s traceback."""
    tb = exc.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    return f"{tb.tb_frame.f_code.co_filename}:{tb.tb_lineno}" if tb is not None else "?"


def _first_line(exc: BaseException) -> str:
    """The first line of ``exc``'s message, at most 200 characters."""
    lines = str(exc).strip().splitlines()
    return lines[0][:200] if lines else "(no message)"


def keyword_spec(
    name: str, module: nn.Module, batch: Mapping[str, Tensor], loss: LossFn | None = None
) -> ModelSpec:
    """A spec for a model called as ``module(**batch)`` with the keys its forward takes (by
    name); the loss defaults to :func:`output_loss`.

    ``batch["labels"]`` (when present) is the target a user loss receives; it goes into the
    forward only if the forward takes it.

    Raises:
        ModelError: a key the forward does not take, an argument no key gives, or labels the
            forward does not take with no ``loss`` to receive them.
    """
    from profiler.capture import as_keywords

    names, inputs = as_keywords(batch, module)
    if loss is None and "labels" in batch and "labels" not in names:
        raise ModelError(
            f"{type(module).__name__}.forward takes no 'labels', so its output carries no loss: "
            "give a loss function (loss_fn=...) to receive them as targets"
        )
    first = next(iter(batch.values()))
    batch_size = int(first.shape[0]) if first.dim() > 0 else 1
    targets = batch["labels"] if "labels" in batch else torch.zeros(batch_size)
    return ModelSpec(
        name,
        module,
        inputs,
        targets,
        loss if loss is not None else output_loss,
        batch_size,
        names,
    )


@dataclass(frozen=True)
class ModelSpec:
    """A model ready to trace, profile, plan and train.

    Attributes:
        name: the reference it was resolved from (``"mlp"`` or ``"pkg.mod:factory"``).
        module: the model.
        inputs: sample inputs, one minibatch, batch dimension first.
        targets: sample targets for the same minibatch.
        loss: ``loss(outputs, targets) -> scalar``; cross-entropy unless the factory says otherwise.
        batch_size: minibatch size of the sample.
        input_names: keyword names of ``inputs`` when the model is called as
            ``module(**batch)`` (Hugging Face style); ``()`` = positional inputs.
    """

    name: str
    module: nn.Module
    inputs: tuple[Tensor, ...]
    targets: Tensor
    loss: LossFn = field(default=F.cross_entropy)
    batch_size: int = 0
    input_names: tuple[str, ...] = ()


# ---------------------------------------------------------------- factories


def _gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _mlp_spec(batch_size: int, hidden: int = 256, depth: int = 4, name: str = "mlp") -> ModelSpec:
    x = torch.randn(batch_size, 64, generator=_gen())
    y = torch.randint(0, 10, (batch_size,), generator=_gen(1))
    return ModelSpec(name, mlp(hidden=hidden, depth=depth), (x,), y, batch_size=batch_size)


_SIZED = re.compile(r"^(\w+)\((.*)\)$")
_SIZED_ARGS = {"mlp": ("hidden", "depth")}  # built-ins that take size arguments in their reference


def _sized_builtin(ref: str, batch_size: int) -> ModelSpec | None:
    """``mlp(hidden=1024, depth=8)``: a built-in with other sizes; ``None`` if not that form."""
    m = _SIZED.match(ref.replace(" ", ""))
    if m is None or m.group(1) not in BUILTIN_MODELS:
        return None
    name, body = m.group(1), m.group(2)
    allowed = _SIZED_ARGS.get(name, ())
    kwargs: dict[str, int] = {}
    for item in filter(None, body.split(",")):
        key, _, value = item.partition("=")
        if not allowed:
            raise ModelError(
                f"model {ref!r}: built-in {name!r} takes no size arguments; use {name!r}"
            )
        if key not in allowed or not value.isdigit() or int(value) < 1:
            raise ModelError(
                f"model {ref!r}: {item!r} is not a size argument of {name!r}; "
                f"use {name}({', '.join(f'{a}=N' for a in allowed)}) with N >= 1"
            )
        kwargs[key] = int(value)
    if torch.get_default_device().type != "meta":  # refuse before allocating: count on meta
        with torch.device("meta"):
            check_fits_host(ref, mlp(**kwargs))
    with building(ref):
        return _mlp_spec(batch_size, name=ref.replace(" ", ""), **kwargs)


def _resnet_spec(batch_size: int) -> ModelSpec:
    model = ResNet(BasicBlock, (2, 2, 2), (16, 32, 64), classes=10, imagenet=False)
    x = torch.randn(batch_size, 3, 32, 32, generator=_gen())
    y = torch.randint(0, 10, (batch_size,), generator=_gen(1))
    return ModelSpec("resnet", model, (x,), y, batch_size=batch_size)


def _transformer_spec(batch_size: int) -> ModelSpec:
    model = TinyTransformer()
    idx = torch.randint(0, 256, (batch_size, 32), generator=_gen())
    y = torch.randint(0, 256, (batch_size * 32,), generator=_gen(1))
    return ModelSpec("transformer", model, (idx,), y, batch_size=batch_size)


def _vgg19_spec(batch_size: int) -> ModelSpec:
    x = torch.randn(batch_size, 3, 224, 224, generator=_gen())
    y = torch.randint(0, 1000, (batch_size,), generator=_gen(1))
    return ModelSpec("vgg19", vgg19(), (x,), y, batch_size=batch_size)


def _resnet152_spec(batch_size: int) -> ModelSpec:
    model = ResNet(Bottleneck, (3, 8, 36, 3), (64, 128, 256, 512), classes=1000, imagenet=True)
    x = torch.randn(batch_size, 3, 224, 224, generator=_gen())
    y = torch.randint(0, 1000, (batch_size,), generator=_gen(1))
    return ModelSpec("resnet152", model, (x,), y, batch_size=batch_size)


BUILTIN_MODELS: dict[str, Callable[[int], ModelSpec]] = {
    "mlp": _mlp_spec,
    "resnet": _resnet_spec,
    "transformer": _transformer_spec,
    "vgg19": _vgg19_spec,
    "resnet152": _resnet152_spec,
}


def _load_factory(ref: str) -> Callable[..., object]:
    return import_factory(
        ref,
        f"model {ref!r}",
        f"unknown model {ref!r}: use a built-in name ({', '.join(BUILTIN_MODELS)}) "
        "or 'package.module:factory'",
        ModelError,
    )


def import_factory(
    ref: str, what: str, bad_form: str, error: type[HetPipeError]
) -> Callable[..., object]:
    """The callable ``ref`` (``package.module:factory``) names, imported the way ``python -m``
    does: the current directory first on the import path.

    Args:
        ref: the reference.
        what: how messages name it (``"model 'x:y'"``, ``"--data x:y"``).
        bad_form: the whole message when ``ref`` is not ``module:attribute``.
        error: the :class:`HetPipeError` subclass to raise.

    Raises:
        error: a malformed reference, a module that cannot be imported, no such callable.
    """
    module_name, _, attr = ref.partition(":")
    if not module_name or not attr:
        raise error(bad_form)
    cwd = os.getcwd()
    if cwd not in sys.path and "" not in sys.path:  # like `python -m`: the current directory
        sys.path.insert(0, cwd)
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise error(
            f"{what}: cannot import module {module_name!r} ({exc}); run from the directory "
            "that holds it or add that directory to PYTHONPATH"
        ) from exc
    factory = getattr(module, attr, None)
    if not callable(factory):
        raise error(f"{what}: {module_name!r} has no callable {attr!r}")
    return factory  # type: ignore[no-any-return]


def _as_spec(ref: str, result: object, batch_size: int) -> ModelSpec:
    if isinstance(result, ModelSpec):
        return result
    if isinstance(result, tuple) and len(result) == 2 and isinstance(result[0], nn.Module):
        module, batch = result
        if isinstance(batch, Mapping) and all(isinstance(t, Tensor) for t in batch.values()):
            return keyword_spec(ref, module, batch)
        if isinstance(batch, (tuple, list)) and len(batch) == 2:
            inputs, targets = batch
            inputs_t = tuple(inputs) if isinstance(inputs, (tuple, list)) else (inputs,)
            if all(isinstance(t, Tensor) for t in inputs_t) and isinstance(targets, Tensor):
                return ModelSpec(ref, module, inputs_t, targets, batch_size=int(targets.shape[0]))
    raise ModelError(
        f"model factory {ref!r} returned {type(result).__name__}; it must return a ModelSpec, "
        "(nn.Module, (inputs, targets)) with tensors or (nn.Module, {name: tensor})"
    )


def resolve_model_for_graph(ref: str, batch_size: int) -> ModelSpec:
    """``ref`` built on the ``meta`` device (no weights) when its graph does not depend on it.

    ``torch.fx`` graphs do not; models only ``torch.export`` captures (Hugging Face) may take
    other code paths on ``meta`` (their graph would not match the one every stage process
    builds on CPU), so those, and factories that cannot run on ``meta``, are built on CPU.

    Raises:
        ModelError: as :func:`resolve_model`.
    """
    import torch.fx as fx

    try:
        with torch.device("meta"):
            spec = resolve_model(ref, batch_size)
        if not spec.input_names:
            fx.symbolic_trace(spec.module)
            return spec
    except ModelError:
        raise
    except Exception:  # fx cannot trace it, or the factory cannot run on meta
        pass
    return resolve_model(ref, batch_size)


def resolve_model(ref: str, batch_size: int) -> ModelSpec:
    """Build the model named ``ref`` with a sample minibatch of ``batch_size``.

    Raises:
        ModelError: unknown name, a factory that fails or returns the wrong thing,
            or a non-positive batch size; a sized built-in whose weights exceed this host's
            memory (counted on ``meta`` first), or any build that runs out of memory
            (:mod:`profiler.host_memory`).
    """
    if batch_size <= 0:
        raise ModelError(f"batch size must be a positive integer, got {batch_size}")
    if ref in BUILTIN_MODELS:
        with building(ref):
            return BUILTIN_MODELS[ref](batch_size)
    sized = _sized_builtin(ref, batch_size)
    if sized is not None:
        return sized
    factory = _load_factory(ref)
    try:
        params = inspect.signature(factory).parameters
        result = factory(batch_size=batch_size) if "batch_size" in params else factory()
    except Exception as exc:  # a user factory may raise anything: report it as one line
        if is_allocation_failure(exc):
            raise allocation_error(ref, exc) from exc
        raise ModelError(
            f"model factory {ref!r} raised {type(exc).__name__} at {_raised_at(exc)}: "
            f"{_first_line(exc)}; fix the factory (call it alone for the traceback)"
        ) from exc
    return _as_spec(ref, result, batch_size)
