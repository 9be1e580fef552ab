"""Where a run's data comes from: the user's ``--data package.module:factory`` (a training and
a test set), or the model's built-in data; checked against the model before any process starts.

The factory contract (``hetpipe run --data mypkg.data:make``): ``make()`` (or
``make(seed=...)`` when it takes a ``seed``) returns ``(train, test)``, two torch ``Dataset``
objects (``__len__`` and ``__getitem__``) whose samples are ``(input, target)`` pairs, the
input a tensor (or a tuple of tensors), the target a class index; ``test`` may be ``None``
(a seeded fifth of ``train`` is then held out). The datasets are pickled into the stage
processes, so their classes must be importable there (the factory's module is).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.utils.data import Dataset, Subset, TensorDataset

from profiler.errors import ConfigError, HetPipeError, shown
from profiler.models import ModelSpec, import_factory
from runtime.data import DigitsDataset, SyntheticDataset, default_dataset
from runtime.results.evaluation import split_dataset

if TYPE_CHECKING:
    from profiler.graph import ModelGraph

__all__ = [
    "SYNTHETIC",
    "RunData",
    "check_targets",
    "describe_default",
    "load_data",
    "named_data",
    "output_classes",
    "run_data",
    "synthetic_data",
]

SYNTHETIC = "synthetic"
"""``--data synthetic``: random inputs shaped like the model's, targets below its output width."""

_SHAPE = (
    "it must return (train, test): two torch Datasets of (input, target) samples, test may be "
    "None (e.g. (TensorDataset(x, y), TensorDataset(x_test, y_test)))"
)


@dataclass(frozen=True)
class RunData:
    """The data a run trains and tests on.

    Attributes:
        train: training samples ``(inputs, target)`` (or dicts of tensors, ``labels`` the target).
        test: the samples the final accuracy is measured on (``None``: a seeded
            ``test_fraction`` of ``train`` is held out, :func:`split_dataset`).
        label: what the summary says the data is (``mydata:make (train 400, test 100)``).
        origin: what an error about the data names (``--data mydata:make``).
    """

    train: Dataset[Any]
    test: Dataset[Any] | None = None
    label: str = ""
    origin: str = "the data set"

    def split(self, test_fraction: float, seed: int = 0) -> tuple[Subset[Any], Subset[Any]]:
        """``(train, test)`` as subsets: the given test set, or ``train``'s held-out split."""
        if self.test is None:
            return split_dataset(self.train, test_fraction, seed)
        return _whole(self.train), _whole(self.test)

    @property
    def settings(self) -> str:
        """What a resumed run's data must match (the type and size of each set)."""
        kind = f"{type(self.train).__name__}:{len(self.train)}"  # type: ignore[arg-type]
        if self.test is None:
            return kind
        return f"{kind}:test {type(self.test).__name__}:{len(self.test)}"  # type: ignore[arg-type]


def _whole(dataset: Dataset[Any]) -> Subset[Any]:
    """All of ``dataset`` as a :class:`Subset` (VW shards are subsets of it)."""
    return Subset(dataset, list(range(len(dataset))))  # type: ignore[arg-type]


def describe_default(dataset: Dataset[Any]) -> str:
    """The summary's words for a model's built-in data set."""
    if isinstance(dataset, DigitsDataset):
        return f"digits (scikit-learn, {len(dataset)} samples, 10 classes)"
    if isinstance(dataset, SyntheticDataset):
        return f"synthetic (random inputs, targets in [0, {dataset.classes}))"
    return f"{type(dataset).__name__} ({len(dataset)} samples)"  # type: ignore[arg-type]


def output_classes(spec: ModelSpec, graph: ModelGraph | None = None) -> int | None:
    """The width of the model's output (its number of classes), from the shapes of one
    sample minibatch propagated without compute (``graph``: its capture, when the caller has
    it; else captured here); ``None``: not one tensor of scores."""
    from profiler.graph import ModelGraph

    if spec.input_names:  # a keyword (Hugging Face) model computes its own loss
        return None
    try:
        layers = (graph if graph is not None else ModelGraph.from_spec(spec)).layers
    except HetPipeError:
        return None
    out = layers[-1]  # the graph's output node: what it returns is its one input's output
    if out.op != "output" or len(out.inputs) != 1:
        return None
    shapes = layers[out.inputs[0]].out_shapes
    if len(shapes) != 1 or len(shapes[0]) < 2:
        return None
    return int(shapes[0][-1])


def load_data(ref: str, seed: int = 0) -> RunData:
    """The ``(train, test)`` of the factory ``ref`` (``package.module:factory``), checked.

    Raises:
        ConfigError: the factory cannot be found, raises, or returns something else than the
            contract (one line naming ``--data ref`` and what was wrong).
    """
    factory = _factory(ref)
    try:
        takes_seed = "seed" in inspect.signature(factory).parameters
        result = factory(seed=seed) if takes_seed else factory()
    except Exception as exc:  # a user factory may raise anything: report it as one line
        raise ConfigError(f"--data {ref} raised {type(exc).__name__}: {shown(str(exc))}") from None
    if not isinstance(result, (tuple, list)) or len(result) != 2:
        raise ConfigError(f"--data {ref} returned {shown(result)}; {_SHAPE}")
    train, test = result
    _check_set(ref, "train", train)
    if test is not None:
        _check_set(ref, "test", test)
    sizes = f"train {len(train)}" + (
        f", test {len(test)}" if test is not None else ", test held out"
    )
    return RunData(train, test, f"{ref} ({sizes})", f"--data {ref}")


def named_data(ref: str, model: str, batch_size: int, seed: int = 0) -> RunData | None:
    """What ``--data ref`` names for a run of ``model`` (both entries, ``hetpipe run`` and
    ``python -m runtime``): the factory's ``(train, test)``, synthetic data shaped for the
    model, or ``None`` (``ref`` empty) for a built-in model's own data.

    Raises:
        ConfigError: a factory model without ``--data``, or a bad factory (one line).
    """
    if not ref:
        if ":" in model:  # pkg.mod:factory: no data of its own
            raise ConfigError(
                f"model {model!r} has no data of its own: give --data pkg.mod:factory "
                "(returning (train, test) datasets of (input, target) samples), or --data "
                f"{SYNTHETIC} to train on random inputs"
            )
        return None
    if ref == SYNTHETIC:
        return synthetic_data(model, batch_size)
    return load_data(ref, seed)


def _factory(ref: str) -> Callable[..., object]:
    """The callable ``ref`` names (:func:`profiler.models.import_factory`)."""
    bad_form = (
        f"--data {shown(ref)}: use 'package.module:factory' (returning (train, test) "
        f"datasets) or '{SYNTHETIC}'"
    )
    return import_factory(ref, f"--data {ref}", bad_form, ConfigError)


def _check_set(ref: str, which: str, dataset: object) -> None:
    """``dataset`` is a non-empty data set whose first sample is ``(input, target)``."""
    if not (hasattr(dataset, "__len__") and hasattr(dataset, "__getitem__")):
        raise ConfigError(
            f"--data {ref}: the {which} set is a {type(dataset).__name__}, not a Dataset with "
            f"__len__ and __getitem__; {_SHAPE}"
        )
    if len(dataset) == 0:  # type: ignore[arg-type]
        raise ConfigError(f"--data {ref}: the {which} set is empty; give it samples")
    try:
        sample = dataset[0]  # type: ignore[index]
    except Exception as exc:  # the user's __getitem__ may raise anything
        raise ConfigError(
            f"--data {ref}: {which}[0] raised {type(exc).__name__}: {shown(str(exc))}"
        ) from None
    if isinstance(sample, Mapping):
        return  # keyword samples: the model takes them, 'labels' is the target
    pair = isinstance(sample, (tuple, list)) and len(sample) == 2
    if not pair or not isinstance(sample[1], (Tensor, int)):
        raise ConfigError(
            f"--data {ref}: {which}[0] is {shown(sample)}; each sample must be (input, target) "
            "with a tensor or int target"
        )


def check_targets(data: RunData, classes: int, where: str) -> None:
    """Every integer target of ``data`` is a class index below ``classes`` (the model's output
    width), before a stage's cross-entropy meets one that is not.

    Raises:
        ConfigError: names ``where`` (the data's origin), the set, the target and the fix.
    """
    for which, dataset in (("train", data.train), ("test", data.test)):
        if dataset is None:
            continue
        try:
            targets = _targets(dataset)
        except Exception as exc:  # the user's __getitem__ may raise anything
            raise ConfigError(
                f"{where}: reading the {which} set's targets raised {type(exc).__name__}: "
                f"{shown(str(exc))}; each sample must be (input, target)"
            ) from None
        if targets is None or targets.numel() == 0 or targets.is_floating_point():
            continue
        low, high = int(targets.min()), int(targets.max())
        if low < 0 or high >= classes:
            bad = high if high >= classes else low
            raise ConfigError(
                f"{where}: a {which} target is {bad}, but the model outputs {classes} classes "
                f"(targets 0..{classes - 1}); fix the data's labels or give the model "
                f"{max(high + 1, classes)} outputs"
            )


def _targets(dataset: Dataset[Any]) -> Tensor | None:
    """Every target of ``dataset`` as one tensor (``None``: dict samples, no ``labels``)."""
    indices: list[int] | None = None
    while isinstance(dataset, Subset):
        inner = [int(i) for i in dataset.indices]
        indices = inner if indices is None else [inner[i] for i in indices]
        dataset = dataset.dataset
    if isinstance(dataset, TensorDataset) and len(dataset.tensors) == 2:
        y = dataset.tensors[1]
        return y if indices is None else y[torch.tensor(indices, dtype=torch.int64)]
    n = len(dataset)  # type: ignore[arg-type]
    ys = []
    for i in indices if indices is not None else range(n):
        sample = dataset[i]
        label = sample.get("labels") if isinstance(sample, Mapping) else sample[1]
        if label is None:
            return None
        ys.append(torch.as_tensor(label).reshape(-1))
    return torch.cat(ys) if ys else None


def synthetic_data(model: str, batch_size: int) -> RunData:
    """``--data synthetic``: random inputs shaped like ``model``'s sample minibatch, integer
    targets below its output width (:func:`output_classes`).

    Raises:
        ConfigError: the model's number of classes cannot be told (its output is not one
            tensor of scores) and it takes integer targets.
    """
    from runtime.config import ModelSource
    from runtime.stage.model import resolve_source

    spec = resolve_source(ModelSource(ref=model), batch_size, meta=True)
    built = default_dataset(model, spec.inputs, spec.targets, batch_size,
                            classes=output_classes(spec), synthetic=True)  # fmt: skip
    return RunData(built, None, describe_default(built), f"--data {SYNTHETIC}")


def run_data(
    dataset: Dataset[Any] | RunData | None,
    name: str,
    spec: ModelSpec,
    batch_size: int,
    loss: object,
    graph: ModelGraph | None = None,
) -> RunData:
    """The data a run of model ``name`` (resolved as ``spec``, captured as ``graph`` when the
    caller has it) uses: ``dataset`` (the user's, its integer targets checked against the
    model's output width when ``loss`` is the default cross-entropy) or, ``None``, the model's
    built-in data (:func:`runtime.data.default_dataset`).

    Raises:
        ConfigError: a target out of the model's range (:func:`check_targets`), or synthetic
            data for a model whose number of classes is unknown.
    """
    if dataset is None:
        built = default_dataset(name, spec.inputs, spec.targets, batch_size,
                                classes=output_classes(spec, graph))  # fmt: skip
        return RunData(built, None, describe_default(built))
    data = dataset
    if not isinstance(data, RunData):
        data = RunData(dataset, None, f"{type(dataset).__name__} ({len(dataset)} samples)")  # type: ignore[arg-type]
    checked = loss is F.cross_entropy and not isinstance(data.train, SyntheticDataset)
    classes = output_classes(spec, graph) if checked else None
    if classes is not None:
        check_targets(data, classes, data.origin)
    return data
