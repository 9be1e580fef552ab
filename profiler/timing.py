"""Timing a training step layer by layer: clocks, timed calls, the backward timer.

:func:`timed_pass` executes one training step layer by layer on connected tensors: each
layer's forward is timed around its call; its backward is the time autograd spends in the
autograd nodes its forward created (:class:`BackwardTimer`, node pre/post hooks), so engine
start-up, allocation and cache behaviour are those of a real step. Times come from ``clock``
on CPU (:func:`clock_of`) and from CUDA events on GPU. :mod:`profiler.measure` keeps the
medians of several passes.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.fx as fx
from torch import Tensor

from profiler.errors import ConfigError
from profiler.graph import ModelGraph
from profiler.interpret import bind_node, tensors_of

__all__ = ["BackwardTimer", "Clock", "clock_of", "timed_ms", "timed_pass"]

Clock = Callable[[], float]


def clock_of(name: str) -> Clock:
    """The CPU clock called ``name``: ``wall`` (``time.perf_counter``) or ``cpu``.

    ``cpu`` (``time.thread_time``, this thread's CPU time) is only meaningful with one
    intra-op thread, where it ignores time the process spends preempted on a shared machine.

    Raises:
        ConfigError: unknown clock name.
    """
    if name == "wall":
        return time.perf_counter
    if name == "cpu":
        return time.thread_time
    raise ConfigError(f"--clock {name!r} is unknown; use wall or cpu")


def timed_ms(
    device: torch.device, fn: Callable[[], Any], clock: Clock = time.perf_counter
) -> tuple[float, Any]:
    """Run ``fn`` once and return (milliseconds, result): CUDA events on GPU, ``clock`` on CPU."""
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        result = fn()
        end.record()
        torch.cuda.synchronize(device)
        return float(start.elapsed_time(end)), result
    t0 = clock()
    result = fn()
    return (clock() - t0) * 1e3, result


def _new_grad_fns(value: Any, known: set[Any]) -> list[Any]:
    """Autograd nodes reachable from ``value`` that are not in ``known`` (adds them to it)."""
    stack: list[Any] = [t.grad_fn for t in tensors_of(value) if t.grad_fn is not None]
    found = []
    while stack:
        fn = stack.pop()
        if fn is None or fn in known:
            continue
        known.add(fn)
        found.append(fn)
        stack += [nxt for nxt, _ in fn.next_functions]
    return found


class BackwardTimer:
    """Sums, per layer, the time autograd spends inside the layer's backward nodes.

    Each autograd node a layer's forward created gets a pre-hook and a post-hook; on CPU the
    engine runs nodes one at a time, so ``post - pre`` is that node's backward time. On CUDA
    the hooks record events instead and the totals are read after a synchronize.
    """

    def __init__(self, device: torch.device, clock: Clock) -> None:
        self.device = device
        self.clock = clock
        self.total_ms: dict[int, float] = {}
        self._events: list[tuple[int, Any, Any]] = []

    def watch(self, layer: int, grad_fns: Sequence[Any]) -> None:
        """Attribute the backward time of ``grad_fns`` to ``layer``."""
        self.total_ms.setdefault(layer, 0.0)
        for fn in grad_fns:
            start: list[Any] = [None]

            def pre(grad_outputs: Any, start: list[Any] = start) -> None:
                if self.device.type == "cuda":
                    start[0] = torch.cuda.Event(enable_timing=True)
                    start[0].record()
                else:
                    start[0] = self.clock()

            def post(
                grad_inputs: Any, grad_outputs: Any, start: list[Any] = start, layer: int = layer
            ) -> None:
                if self.device.type == "cuda":
                    end = torch.cuda.Event(enable_timing=True)
                    end.record()
                    self._events.append((layer, start[0], end))
                else:
                    self.total_ms[layer] += (self.clock() - start[0]) * 1e3

            fn.register_prehook(pre)
            fn.register_hook(post)

    def result(self) -> dict[int, float]:
        """Milliseconds of backward per layer."""
        if self._events:
            torch.cuda.synchronize(self.device)
            for layer, start, end in self._events:
                self.total_ms[layer] += float(start.elapsed_time(end))
            self._events.clear()
        return self.total_ms


def timed_pass(
    graph: ModelGraph,
    inputs: Sequence[Any],
    device: torch.device,
    clock: Clock,
    loss: Callable[[Any], Tensor] | None = None,
) -> tuple[dict[int, float], dict[int, float]]:
    """One training step executed layer by layer: timed forwards in order, then one backward.

    Layers run on the outputs of the layers before them (not on detached copies), so
    allocation, cache behaviour and autograd engine costs match a real step; every layer's
    forward is timed around its call and its backward is the time autograd spends in the
    autograd nodes its forward created (:class:`BackwardTimer`). The backward starts from
    the loss, whose forward and backward are charged to the ``output`` layer (the last
    stage computes it), or without ``loss`` from the model output with a ones-like gradient.

    Returns:
        Forward and backward milliseconds by layer index.
    """
    gm = graph.gm
    env: dict[fx.Node, Any] = {}
    args_iter = iter(inputs)
    fwd: dict[int, float] = {}
    known: set[Any] = set()
    timer = BackwardTimer(device, clock)
    output: Any = None
    nodes = list(gm.graph.nodes)
    last_use = {n: i for i, node in enumerate(nodes) for n in node.all_input_nodes}
    for index, node in enumerate(nodes):
        for done in [n for n in env if last_use.get(n, -1) < index]:
            del env[
                done
            ]  # autograd keeps what the backward needs; drop the rest, as eager code does
        if node.op == "placeholder":
            env[node] = next(args_iter)
            continue
        args = fx.node.map_arg(node.args, env.__getitem__)
        if node.op == "output":
            output = args[0]
            if loss is not None:
                fwd[index], output = timed_ms(device, functools.partial(loss, output), clock)
                timer.watch(index, _new_grad_fns(output, known))
            break
        kwargs = fx.node.map_arg(node.kwargs, env.__getitem__)
        ms, out = timed_ms(device, bind_node(gm, node, args, kwargs), clock)
        fwd[index] = ms
        env[node] = out
        timer.watch(index, _new_grad_fns(out, known))
    outs = [t for t in tensors_of(output) if t.requires_grad]
    if outs:
        torch.autograd.backward(outs, [torch.ones_like(t) for t in outs])
    gm.zero_grad(set_to_none=True)
    return fwd, timer.result()
