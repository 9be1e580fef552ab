"""Supervision of the AllReduce baseline's rank processes (:mod:`runtime.launch.ddp`).

The parent waits for every rank's result on one queue; the first failing rank (not its peers,
whose links then break) is blamed by :func:`runtime.launch.failures.root_cause_rank`.
"""

from __future__ import annotations

import io
from collections.abc import Callable, Sequence
from typing import Any

import torch

from profiler.errors import HetPipeRuntimeError
from runtime.launch.failures import root_cause_rank, watch

__all__ = ["watch_ranks"]


def watch_ranks(
    devices: Sequence[str],
    procs: dict[int, Any],
    events: Any,
    stall_s: float,
    on_progress: Callable[[Any], None] = lambda _: None,
) -> list[dict[str, Any]]:
    """Collect every rank's result from ``events``; raise on the first failure or a stall.

    Args:
        devices: device label of each rank, indexed by rank (``R:0``).
        procs: the rank processes by rank.
        events: the queue the ranks post ``("result", rank, bytes)`` or ``("error", rank, msg)`` to.
        stall_s: give up after this long without any message (s).
        on_progress: called with every progress event (rank 0's ``loss`` and ``done``).

    Returns:
        The ranks' result dicts in rank order.

    Raises:
        HetPipeRuntimeError: a rank failed (the root cause is named) or the run stalled.
    """

    def fail(errors: dict[int, str], results: dict[int, bytes]) -> HetPipeRuntimeError:
        return _failure(devices, procs, events, errors, results)

    # the stall clock starts at the launch: start-up is short (the forkserver preloads torch)
    raw = watch(procs, events, len(devices), on_progress, fail, stall_s, first_event_s=stall_s)
    return [torch.load(io.BytesIO(raw[r]), weights_only=False) for r in range(len(devices))]


def _failure(
    devices: Sequence[str],
    procs: dict[int, Any],
    events: Any,
    errors: dict[int, str],
    results: dict[int, bytes],
) -> HetPipeRuntimeError:
    """Collect failures for a moment and blame the first cause, not its peers' broken links."""
    rank = root_cause_rank(procs, events, errors, results, grace_s=1.0)
    return HetPipeRuntimeError(
        f"AllReduce rank {rank} (device {devices[rank]}) failed: {errors[rank]}; "
        "every other rank was stopped"
    )
