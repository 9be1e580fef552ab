"""Measured per-layer profiles: run every layer of the model graph on its real inputs.

Two kinds of passes over the traced graph:

* A counting pass (:func:`run_layers`) interprets the graph node by node, each layer on
  detached copies of its inputs (so its backward stops at its own boundary): it records
  the bytes autograd saves (:class:`profiler.memory.SavedTensorCounter`, exact), the
  forward FLOPs (``FlopCounterMode``) and, on CUDA, the allocator peak.
* ``warmup + repeats`` timed passes (:func:`profiler.timing.timed_pass`) execute one training step layer
  by layer on connected tensors: each layer's forward is timed around its call; its
  backward is the time autograd spends in the autograd nodes its forward created
  (node pre/post hooks), so engine start-up, allocation and cache behaviour are those of
  a real step. The loss is charged to the ``output`` row. Medians are kept.

Times come from ``time.perf_counter`` (or this thread's CPU time, ``clock="cpu"``, robust on
a shared machine) on CPU and from CUDA events on GPU. :func:`step_time_ms` times a
whole-model training step (forward + loss + backward) for the honesty check.
"""

from __future__ import annotations

import gc
import hashlib
import logging
import platform
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any

import pandas as pd
import torch
from torch import Tensor, nn
from torch.utils.flop_counter import FlopCounterMode

from profiler.catalog import lookup_gpu
from profiler.errors import ConfigError
from profiler.graph import ModelGraph
from profiler.interpret import LayerCall, backward_call, run_layers
from profiler.memory import SavedTensorCounter, cuda_peak_bytes, reset_cuda_peak
from profiler.models import ModelSpec
from profiler.precision import autocast, dtype_name
from profiler.table import COLUMNS, Profile, ProfileMeta
from profiler.timing import Clock, clock_of, timed_ms, timed_pass

__all__ = [
    "measure_profile",
    "parse_device",
    "profile_rows",
    "step_time_ms",
]

log = logging.getLogger(__name__)

Progress = Callable[[int, int, str], None]


# ---------------------------------------------------------------- devices and clocks


def parse_device(name: str) -> torch.device:
    """Parse ``cpu``, ``cuda`` or ``cuda:N`` and check the device exists on this machine.

    Raises:
        ConfigError: malformed name, or a CUDA device that is not present.
    """
    try:
        device = torch.device(name)
    except (RuntimeError, ValueError) as exc:
        raise ConfigError(
            f"--device {name!r} is not a device name; use cpu, cuda or cuda:N"
        ) from exc
    if device.type == "cpu":
        return device
    if device.type != "cuda":
        raise ConfigError(f"--device {name!r}: only cpu and cuda devices can be profiled")
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    index = device.index or 0
    if index >= count:
        raise ConfigError(
            f"--device {name!r} does not exist on this machine ({count} CUDA devices); "
            "use --device cpu, or --analytic --device-type TYPE to estimate without the GPU"
        )
    return torch.device("cuda", index)


# ---------------------------------------------------------------- per-layer measurement


@dataclass(frozen=True)
class _Row:
    fwd_ms: float
    bwd_ms: float
    saved_bytes: int
    peak_bytes: int
    flops: float


def _count_call(
    call: LayerCall, device: torch.device, counter: SavedTensorCounter
) -> tuple[Any, int, int, float]:
    """One counted forward (saved bytes, FLOPs) and backward (CUDA peak) of a layer.

    Returns:
        (output, saved bytes, peak bytes, forward FLOPs).
    """
    reset_cuda_peak(device)
    with counter, FlopCounterMode(display=False) as flops:
        out = call.forward()
    saved = counter.take()
    run = backward_call(out, call.grad_inputs, retain=True)
    if run is not None:
        run()
    return out, saved, cuda_peak_bytes(device), float(flops.get_total_flops())


def _tick(progress: Progress | None, done: int, total: int, name: str) -> None:
    if progress is not None:
        progress(done, total, name)


def _counting_pass(
    graph: ModelGraph,
    inputs: Sequence[Any],
    device: torch.device,
    tick: Callable[[int, str], None],
) -> dict[int, tuple[int, int, float]]:
    """Saved bytes, CUDA peak and forward FLOPs of every layer (see :func:`_count_call`).

    Everything the pass keeps alive (saved tensors, layer outputs) is released on return.
    """
    counter = SavedTensorCounter(exclude=list(graph.gm.parameters()))
    counted: dict[int, tuple[int, int, float]] = {}

    def visit(call: LayerCall) -> Any:
        tick(call.index, call.node.name)
        if call.node.op == "placeholder":
            return call.forward()
        out, saved, peak, flops = _count_call(call, device, counter)
        counted[call.index] = (saved, peak, flops)
        return out

    run_layers(graph.gm, inputs, visit)
    return counted


def profile_rows(
    graph: ModelGraph,
    inputs: Sequence[Any],
    device: torch.device,
    repeats: int = 5,
    warmup: int = 2,
    progress: Progress | None = None,
    clock: Clock = time.perf_counter,
    loss: Callable[[Any], Tensor] | None = None,
) -> pd.DataFrame:
    """Measure every layer of ``graph`` on ``inputs`` (already on ``device``) as a profile table.

    A first pass interprets the graph node by node and records saved bytes, FLOPs and the
    CUDA peak; then ``warmup + repeats`` timed passes (:func:`timed_pass`) run every layer
    layer by layer; the medians over the last ``repeats`` passes are kept. ``loss(output)``
    (e.g. cross-entropy against the sample targets) is timed as the ``output`` row.
    """
    total = len(graph.layers) + warmup + repeats
    counted = _counting_pass(graph, inputs, device, lambda i, name: _tick(progress, i, total, name))
    gc.collect()  # free the counting pass (autograd graphs and closures can form cycles)
    gm = graph.gm
    gm.zero_grad(set_to_none=True)
    fwd_runs: list[dict[int, float]] = []
    bwd_runs: list[dict[int, float]] = []
    for r in range(warmup + repeats):
        if progress is not None:
            progress(len(graph.layers) + r, total, f"pass {r + 1}/{warmup + repeats}")
        fwd, bwd = timed_pass(graph, inputs, device, clock, loss)
        if r >= warmup:
            fwd_runs.append(fwd)
            bwd_runs.append(bwd)
    if progress is not None:
        progress(total, total, "done")
    return _table(graph, counted, fwd_runs, bwd_runs)


def _table(
    graph: ModelGraph,
    counted: dict[int, tuple[int, int, float]],
    fwd_runs: Sequence[dict[int, float]],
    bwd_runs: Sequence[dict[int, float]],
) -> pd.DataFrame:
    """The profile table: per layer, the median timed forward/backward and the counted bytes."""
    rows: dict[int, _Row] = {}
    for index, (saved, peak, flops) in counted.items():
        rows[index] = _Row(
            statistics.median(run.get(index, 0.0) for run in fwd_runs),
            statistics.median(run.get(index, 0.0) for run in bwd_runs),
            saved,
            peak,
            flops,
        )
    names = graph.names
    table = []
    for lay in graph.layers:
        row = rows.get(lay.index, _Row(0.0, 0.0, 0, 0, 0.0))
        if lay.op == "output" and fwd_runs:
            row = _Row(
                statistics.median(run.get(lay.index, 0.0) for run in fwd_runs),
                statistics.median(run.get(lay.index, 0.0) for run in bwd_runs),
                0,
                0,
                0.0,
            )
        table.append(
            {
                "layer": lay.name,
                "op": lay.op,
                "inputs": ";".join(names[i] for i in lay.inputs),
                "fwd_ms": row.fwd_ms,
                "bwd_ms": row.bwd_ms,
                "act_bytes": lay.act_bytes,
                "saved_bytes": row.saved_bytes,
                "param_bytes": lay.param_bytes,
                "buffer_bytes": lay.buffer_bytes,
                "mem_per_mb_bytes": row.saved_bytes + lay.param_bytes,
                "peak_bytes": row.peak_bytes,
                "flops": row.flops,
            }
        )
    return pd.DataFrame(table, columns=list(COLUMNS)).astype(COLUMNS)


def _check_counts(repeats: int, warmup: int) -> None:
    if repeats < 1:
        raise ConfigError(f"--repeats must be >= 1, got {repeats}")
    if warmup < 0:
        raise ConfigError(f"--warmup must be >= 0, got {warmup}")


def _cuda_type(device: torch.device) -> str:
    """The catalog name of a CUDA device when the catalog knows it, else the driver's name."""
    name = torch.cuda.get_device_name(device)
    try:
        return lookup_gpu(name.removeprefix("NVIDIA ").removeprefix("Tesla ")).name
    except ConfigError:
        return name


def _meta(
    spec: ModelSpec,
    device_type: str,
    dtype: str,
    repeats: int,
    warmup: int,
    dev: torch.device,
    clock: str,
) -> ProfileMeta:
    """A measured profile's metadata: what was measured, where, when and how."""
    return ProfileMeta(
        model=spec.name,
        device_type=device_type,
        batch_size=spec.batch_size,
        source="measured",
        dtype=dtype,
        torch_version=torch.__version__,
        host=platform.node(),
        created=datetime.now(timezone.utc).isoformat(timespec="seconds"),
        extra={
            "repeats": repeats,
            "warmup": warmup,
            "device": str(dev),
            "threads": torch.get_num_threads(),
            "clock": clock if dev.type == "cpu" else "cuda-events",
        },
    )


def measure_profile(
    spec: ModelSpec,
    device: str | torch.device = "cpu",
    device_type: str | None = None,
    repeats: int = 5,
    warmup: int = 2,
    progress: Progress | None = None,
    clock: str = "wall",
    precision: str = "fp32",
) -> Profile:
    """Measure a per-layer profile of a resolved model.

    Args:
        spec: the model and its sample minibatch (from :func:`profiler.models.resolve_model`).
        device: ``cpu``, ``cuda`` or ``cuda:N``.
        device_type: the GPU type to record (catalog name); defaults to the CUDA device
            name, or ``cpu``.
        repeats: timed forward/backward repetitions per layer (the median is kept).
        warmup: untimed repetitions before them.
        progress: ``progress(done, total, layer_name)`` callback.
        clock: CPU clock, ``wall`` or ``cpu`` (see :func:`clock_of`); CUDA always uses events.
        precision: ``fp32``, or ``bf16``: every pass runs under autocast (times and saved bytes
            are bfloat16's; activations are counted at 2 bytes per element).

    Raises:
        ConfigError: bad device or counts.
        ModelError: the model cannot be traced or run.
    """
    _check_counts(repeats, warmup)
    clock_fn = clock_of(clock)
    dev = parse_device(device) if isinstance(device, str) else device
    module = spec.module.to(dev).train()
    inputs = tuple(t.to(dev) for t in spec.inputs)
    graph = ModelGraph.from_module(module, inputs, input_names=spec.input_names)
    inputs = graph.flat_inputs(inputs, spec.input_names)
    targets = spec.targets.to(dev)

    def loss(output: Any) -> Tensor:
        return spec.loss(graph.structured_output(output), targets)

    with autocast(dev.type, precision):
        table = profile_rows(graph, inputs, dev, repeats, warmup, progress, clock_fn, loss)
    dtype = str(next(iter(module.parameters()), torch.empty(0)).dtype).removeprefix("torch.")
    if precision == "bf16":
        table["act_bytes"] = table["act_bytes"] // 2
        dtype = dtype_name(precision)
    if device_type is None:
        device_type = _cuda_type(dev) if dev.type == "cuda" else "cpu"
    meta = _meta(spec, device_type, dtype, repeats, warmup, dev, clock)
    return Profile(table, meta)


def profile_key(model: str, batch_size: int, device: str = "cpu", precision: str = "fp32") -> str:
    """What a cached profile of ``model`` depends on: its graph, batch, precision and device.

    The graph part is :meth:`ModelGraph.fingerprint` (op types, edges, shapes, parameter
    sizes), so a factory that now returns another model never reuses the old profile. The
    model is built on the ``meta`` device when its factory allows (no weights are made).

    Raises:
        ModelError: the model cannot be resolved or captured.
    """
    from profiler.models import resolve_model_for_graph

    spec = resolve_model_for_graph(model, batch_size)
    graph = ModelGraph.from_spec(spec)
    dtype = next((p.dtype for p in spec.module.parameters()), torch.float32)
    text = f"{graph.fingerprint()}|batch={batch_size}|{dtype}|{device}"
    if precision != "fp32":
        text += f"|{precision}"  # fp32 keys stay as they were (existing caches stay valid)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def step_time_ms(
    spec: ModelSpec,
    device: str | torch.device = "cpu",
    repeats: int = 5,
    warmup: int = 2,
    clock: str = "wall",
) -> float:
    """Median time of one whole-model training step (forward, loss, backward), milliseconds.

    The optimizer update is not included: per-layer profiles do not time it either.
    """
    _check_counts(repeats, warmup)
    clock_fn = clock_of(clock)
    dev = parse_device(device) if isinstance(device, str) else device
    module: nn.Module = spec.module.to(dev).train()
    inputs = tuple(t.to(dev) for t in spec.inputs)
    targets = spec.targets.to(dev)

    kwargs = dict(zip(spec.input_names, inputs, strict=True)) if spec.input_names else {}

    def step() -> None:
        out = module(**kwargs) if spec.input_names else module(*inputs)
        loss = spec.loss(out, targets)
        loss.backward()

    times = []
    for r in range(warmup + repeats):
        module.zero_grad(set_to_none=True)
        ms = timed_ms(dev, step, clock_fn)[0]
        if r >= warmup:
            times.append(ms)
    module.zero_grad(set_to_none=True)
    return statistics.median(times)
