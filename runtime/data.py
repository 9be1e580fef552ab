"""Training data: the user's ``Dataset`` or a built-in default, in a deterministic seeded order.

Minibatch ``p`` (1-based) of a run is a pure function of the data set, the batch size and the
seed, so the first stage (which reads inputs) and the last stage (which reads targets) agree
without talking, and a single-process reference sees the same minibatches. Epoch ``e`` uses
the permutation drawn from ``seed + e``; the last incomplete minibatch of an epoch is dropped
(stage modules are traced with a fixed batch shape).

Built-in defaults: scikit-learn's *digits* (1,797 8x8 images -> 64 features, offline) for
``mlp``; synthetic tensors shaped like the model's sample minibatch for every other model.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor
from torch.utils.data import Dataset, Subset, TensorDataset, default_collate

from planner.sync import global_slice
from profiler.errors import ConfigError

__all__ = [
    "DigitsDataset",
    "MinibatchSource",
    "SyntheticDataset",
    "default_dataset",
    "model_inputs",
    "stage_view",
]

# number of classes (or vocabulary size) of each built-in model's targets and integer inputs
_BUILTIN_CLASSES = {"mlp": 10, "resnet": 10, "transformer": 256, "vgg19": 1000, "resnet152": 1000}


class DigitsDataset(Dataset[tuple[Tensor, Tensor]]):
    """scikit-learn's digits: ``(64,)`` float features scaled to [0, 1], integer class 0..9."""

    def __init__(self) -> None:
        from sklearn.datasets import load_digits

        digits = load_digits()
        self.x = torch.tensor(digits.data, dtype=torch.float32) / 16.0  # (N, 64)
        self.y = torch.tensor(digits.target, dtype=torch.int64)  # (N,)

    def __len__(self) -> int:
        return int(self.x.shape[0])

    def __getitem__(self, i: int) -> tuple[Tensor, Tensor]:
        return self.x[i], self.y[i]


class SyntheticDataset(Dataset[tuple[Any, Tensor]]):
    """Seeded random samples shaped like one row of a model's sample minibatch.

    Float inputs are standard normal; integer inputs and targets are uniform in
    ``[0, classes)``, or in the range of the sample minibatch's values when ``ranges`` gives
    one (token ids below the vocabulary, an attention mask of ones, class labels below the
    number of classes). Sample ``i`` depends only on ``(seed, i)``.

    Args:
        input_shapes: per-sample shape of each input (batch dimension removed).
        input_dtypes: dtype of each input.
        target_shape: per-sample target shape.
        target_dtype: target dtype.
        classes: range of integer values.
        size: number of samples.
        seed: data seed.
        input_names: keyword names of the inputs (samples are then ``({name: x}, y)``).
        ranges: inclusive ``(low, high)`` of each integer input's values, in input order
            (``None``: ``[0, classes)``); ``()``: none known.
    """

    def __init__(
        self,
        input_shapes: tuple[tuple[int, ...], ...],
        input_dtypes: tuple[torch.dtype, ...],
        target_shape: tuple[int, ...],
        target_dtype: torch.dtype,
        classes: int,
        size: int = 4096,
        seed: int = 0,
        input_names: tuple[str, ...] = (),
        ranges: tuple[tuple[int, int] | None, ...] = (),
    ) -> None:
        self.input_shapes = input_shapes
        self.input_dtypes = input_dtypes
        self.target_shape = target_shape
        self.target_dtype = target_dtype
        self.classes = classes
        self.size = size
        self.seed = seed
        self.input_names = input_names
        self.ranges = ranges or (None,) * len(input_shapes)

    def __len__(self) -> int:
        return self.size

    def _tensor(
        self,
        shape: tuple[int, ...],
        dtype: torch.dtype,
        gen: torch.Generator,
        span: tuple[int, int] | None = None,
    ) -> Tensor:
        if dtype.is_floating_point:
            return torch.randn(shape, generator=gen, dtype=dtype)
        low, high = span if span is not None else (0, self.classes - 1)
        return torch.randint(low, high + 1, shape, generator=gen, dtype=dtype)

    def __getitem__(self, i: int) -> tuple[Any, Tensor]:
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + i)
        xs = tuple(
            self._tensor(s, d, gen, r)
            for s, d, r in zip(self.input_shapes, self.input_dtypes, self.ranges, strict=True)
        )
        y = self._tensor(self.target_shape, self.target_dtype, gen)
        if self.input_names:  # a model called with keyword inputs gets dict samples
            return dict(zip(self.input_names, xs, strict=True)), y
        return (xs[0] if len(xs) == 1 else xs), y


def default_dataset(
    model_name: str,
    sample_inputs: tuple[Tensor, ...],
    sample_targets: Tensor,
    batch_size: int,
    input_names: tuple[str, ...] = (),
    classes: int | None = None,
    synthetic: bool = False,
) -> Dataset[Any]:
    """The built-in data set for a model: digits for ``mlp``, synthetic otherwise.

    Args:
        model_name: model reference (``mlp`` or a sized ``mlp(hidden=..., depth=...)`` selects
            digits when its input is 64 wide).
        sample_inputs: one minibatch of inputs (only shapes and dtypes are used; may be meta).
        sample_targets: one minibatch of targets (shape and dtype only).
        batch_size: the minibatch size of the samples.
        input_names: keyword names of the inputs (a model called as ``module(**batch)``).
        classes: the range of synthetic integer targets and inputs: the model's output width
            (:func:`runtime.data_source.output_classes`); ``None``: a built-in model's own.
        synthetic: synthetic data even for ``mlp`` (``--data synthetic``).

    Raises:
        ConfigError: synthetic integer values are needed and the number of classes is unknown.
    """
    is_mlp = model_name == "mlp" or model_name.replace(" ", "").startswith("mlp(")
    if is_mlp and not synthetic and tuple(sample_inputs[0].shape[1:]) == (64,):
        return DigitsDataset()
    target_shape = tuple(int(d) for d in sample_targets.shape)
    per_sample = (target_shape[0] // batch_size, *target_shape[1:]) if target_shape else ()
    if per_sample and per_sample[0] == 1 and len(target_shape) == 1:
        per_sample = ()
    return SyntheticDataset(
        tuple(tuple(int(d) for d in x.shape[1:]) for x in sample_inputs),
        tuple(x.dtype for x in sample_inputs),
        per_sample,
        sample_targets.dtype,
        _classes(model_name, classes, sample_inputs, sample_targets, input_names),
        input_names=input_names,
        # keyword models' samples are always real (their factories run on CPU): positional
        # ones may be on meta in one process and real in another, so they keep [0, classes)
        ranges=tuple(_value_range(x) for x in sample_inputs) if input_names else (),
    )


def _classes(
    model_name: str,
    classes: int | None,
    sample_inputs: tuple[Tensor, ...],
    sample_targets: Tensor,
    input_names: tuple[str, ...],
) -> int:
    """The range of synthetic integer values: ``classes``, else a built-in model's own, else
    above the largest real sample target (0 where no integer value is drawn without a range).

    Raises:
        ConfigError: integer values are needed and neither is known.
    """
    known = classes if classes is not None else _BUILTIN_CLASSES.get(model_name)
    if known is not None:
        return known
    seen = _value_range(sample_targets)  # a keyword model's real labels
    if seen is not None:
        return seen[1] + 1
    ranged = bool(input_names)  # keyword models draw their integer inputs in the sample's range
    needs = not sample_targets.dtype.is_floating_point or (
        not ranged and any(not x.dtype.is_floating_point for x in sample_inputs)
    )
    if needs:
        raise ConfigError(
            f"synthetic data for model {model_name!r}: its number of classes is unknown (its "
            "output is not one tensor of scores); give your data with --data package.module:factory"
        )
    return 0


def _value_range(sample: Tensor) -> tuple[int, int] | None:
    """The ``(min, max)`` of an integer sample input with real values (``None``: a float or
    bool input, or one on the meta device)."""
    if sample.dtype.is_floating_point or sample.dtype == torch.bool or sample.numel() == 0:
        return None
    if sample.device.type == "meta":
        return None
    return int(sample.min()), int(sample.max())


def _gather(dataset: Dataset[Any], idx: list[int]) -> tuple[Tensor, Tensor] | None:
    """``(inputs, targets)`` of ``idx`` by one tensor index when ``dataset`` is (a ``Subset`` of)
    an in-memory tensor data set (digits, ``TensorDataset`` of two tensors); ``None`` otherwise.

    Equal to collating the items one by one, without a Python call per sample (which cost
    ~14 % of a small model's stage time).
    """
    while isinstance(dataset, Subset):
        idx = [int(dataset.indices[i]) for i in idx]
        dataset = dataset.dataset
    where = torch.tensor(idx, dtype=torch.int64)
    if isinstance(dataset, DigitsDataset):
        return dataset.x[where], dataset.y[where]
    if isinstance(dataset, TensorDataset) and len(dataset.tensors) == 2:
        x, y = dataset.tensors
        return x[where], y[where]
    return None


@functools.lru_cache(maxsize=2)
def _permutation(n: int, seed: int) -> tuple[int, ...]:
    """The seeded order of one epoch (cached: consecutive minibatches share it)."""
    gen = torch.Generator().manual_seed(seed)
    return tuple(int(i) for i in torch.randperm(n, generator=gen))


@dataclass(frozen=True)
class MinibatchSource:
    """Minibatch ``p`` of a run, as a pure function of ``p``.

    Attributes:
        dataset: the data set: items ``(inputs, target)`` (inputs a tensor, a tuple or a dict
            of tensors) or a dict of tensors (``labels``, when present, is the target).
        batch_size: samples per minibatch.
        seed: data-order seed.
        target_shape: shape the collated targets are reshaped to (the model's sample target
            shape, e.g. ``(B*T,)`` for a language model); ``()`` keeps the collated shape.
        input_names: for dict inputs, the keys in the order the model graph takes them.
        offset: minibatch ``p`` is minibatch ``offset + p`` of the data order (a resumed run
            goes on where its snapshot stopped).
        slice_of: ``(rank, world)``: this rank's ``batch_size`` samples of every global
            minibatch of ``world * batch_size`` (:func:`planner.sync.global_slice`, the
            ``allreduce`` rule's data); ``(0, 1)``: the whole minibatch.
    """

    dataset: Dataset[Any]
    batch_size: int
    seed: int = 0
    target_shape: tuple[int, ...] = ()
    input_names: tuple[str, ...] = field(default=(), kw_only=True)
    offset: int = field(default=0, kw_only=True)
    slice_of: tuple[int, int] = field(default=(0, 1), kw_only=True)

    def __post_init__(self) -> None:
        if self.steps_per_epoch < 1:
            raise ConfigError(
                f"the data set has {len(self.dataset)} samples, fewer than one minibatch of "  # type: ignore[arg-type]
                f"{self.batch_size}: lower the batch size"
            )

    @property
    def steps_per_epoch(self) -> int:
        """Full (global) minibatches per epoch (the remainder is dropped)."""
        return len(self.dataset) // (self.batch_size * self.slice_of[1])  # type: ignore[arg-type]

    def indices(self, mb: int) -> list[int]:
        """Sample indices of 1-based minibatch ``mb``."""
        epoch, pos = divmod(self.offset + mb - 1, self.steps_per_epoch)
        perm = _permutation(len(self.dataset), self.seed * 7919 + epoch)  # type: ignore[arg-type]
        rank, world = self.slice_of
        lo, hi = global_slice(rank, self.batch_size)
        start = pos * self.batch_size * world
        return list(perm[start + lo : start + hi])

    def batch(self, mb: int) -> tuple[tuple[Tensor, ...], Tensor]:
        """Collated ``(inputs, targets)`` of minibatch ``mb``."""
        idx = self.indices(mb)
        fast = _gather(self.dataset, idx)
        batch: Any = fast if fast is not None else default_collate([self.dataset[i] for i in idx])
        return model_inputs(batch, self.input_names, self.batch_size, self.target_shape)

    def inputs(self, mb: int) -> tuple[Tensor, ...]:
        """Inputs of minibatch ``mb`` (what the first stage reads)."""
        return self.batch(mb)[0]

    def targets(self, mb: int) -> Tensor:
        """Targets of minibatch ``mb`` (what the last stage reads)."""
        return self.batch(mb)[1]


def model_inputs(
    batch: Any, input_names: tuple[str, ...], batch_size: int, target_shape: tuple[int, ...] = ()
) -> tuple[tuple[Tensor, ...], Tensor]:
    """A collated minibatch as the model's positional inputs and the loss's targets: what the
    first and the last stage read (and ``hetpipe.calibrate``'s reference steps).

    Args:
        batch: collated samples: ``(inputs, targets)`` (inputs a tensor, a tuple or a dict of
            tensors) or a dict of tensors (``labels``, when present, is the target).
        input_names: for dict inputs, the keys in the order the model takes them (``()``: the
            dict's order).
        batch_size: samples in ``batch`` (the targets of a model that computes its own loss are
            ``batch_size`` zeros).
        target_shape: shape the targets are reshaped to when the sizes agree (``()``: kept).

    Raises:
        ConfigError: dict samples without a key the model takes.
    """
    xs: Any
    y: Any
    if isinstance(batch, Mapping):  # {"input_ids", "attention_mask", "labels"}
        xs, y = batch, batch.get("labels")
    else:
        xs, y = batch
    if isinstance(xs, Mapping):
        missing = [k for k in input_names if k not in xs]
        if missing:
            raise ConfigError(
                f"data set samples have keys {sorted(xs)}; the model takes {missing} too: "
                "add them to each sample"
            )
        inputs = tuple(xs[k] for k in input_names) if input_names else tuple(xs.values())
    else:
        inputs = tuple(xs) if isinstance(xs, (tuple, list)) else (xs,)
    if y is None:  # the loss comes from the model's output
        y = torch.zeros(batch_size)
    elif target_shape and y.numel() == math.prod(target_shape):
        y = y.reshape(target_shape)
    return inputs, y


def stage_view(dataset: Dataset[Any] | None, stage: int, n_stages: int) -> Dataset[Any] | None:
    """What stage ``stage`` of an ``n_stages`` pipeline is shipped of ``dataset``: only what it
    reads. A middle stage reads nothing (``None``; it never builds a :class:`MinibatchSource`);
    of an in-memory tensor data set (digits, ``TensorDataset(x, y)``, a ``Subset`` of either)
    stage 0 keeps the inputs and the last stage the targets, the other column becoming zeros
    of one element broadcast to its shape (so indices, order and collated shapes are unchanged
    and minibatches stay bit-identical); a one-stage pipeline, and any other data set, whole.
    """
    if dataset is None or n_stages == 1:
        return dataset
    if 0 < stage < n_stages - 1:
        return None
    return _keep_column(dataset, 0 if stage == 0 else 1)


def _keep_column(dataset: Dataset[Any], keep: int) -> Dataset[Any]:
    """``dataset`` with only column ``keep`` (0: inputs, 1: targets) of its in-memory tensors;
    a data set of another kind unchanged."""
    if isinstance(dataset, Subset):
        return Subset(_keep_column(dataset.dataset, keep), dataset.indices)
    if isinstance(dataset, DigitsDataset):
        pair = (dataset.x, dataset.y)
    elif isinstance(dataset, TensorDataset) and len(dataset.tensors) == 2:
        pair = (dataset.tensors[0], dataset.tensors[1])
    else:
        return dataset
    cols = [t if i == keep else t.new_zeros(()).expand(t.shape) for i, t in enumerate(pair)]
    return TensorDataset(*cols)
