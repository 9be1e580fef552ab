"""The tensors crossing each cut of a layer order (skip connections included)."""

from __future__ import annotations

from collections.abc import Sequence

from profiler.errors import ModelError

__all__ = ["crossing_sets"]


def crossing_sets(
    inputs: Sequence[Sequence[int]], positions: Sequence[int] | None = None
) -> list[tuple[int, ...]]:
    """For every cut ``k`` (between layer ``k-1`` and layer ``k``), the layers whose output crosses it.

    Args:
        inputs: ``inputs[j]`` lists the producers that layer ``j`` reads.
        positions: where each layer counts for the cuts (default: its index). A getitem of a
            tuple counts at its producer and a parameter holder at its user, so neither a
            tuple nor a parameter is ever cut from what reads it.

    Returns:
        ``result[k]`` for ``k`` in ``0..L``: sorted producers ``i`` at a position below ``k``
        with a consumer at ``k`` or above. ``result[0]`` and ``result[L]`` are empty.
    """
    n = len(inputs)
    pos = list(range(n)) if positions is None else list(positions)
    last_use = list(pos)  # a layer's output is "used" until its last consumer
    for j, preds in enumerate(inputs):
        for i in preds:
            if i >= j or pos[i] > pos[j]:
                raise ModelError(
                    f"layer {j} reads layer {i}, which is not earlier: the order is not topological"
                )
            last_use[i] = max(last_use[i], pos[j])
    starts: dict[int, list[int]] = {}
    for i in range(n):
        if last_use[i] > pos[i]:
            starts.setdefault(pos[i] + 1, []).append(i)
    result: list[tuple[int, ...]] = [()]
    live: set[int] = set()
    for k in range(1, n + 1):
        live.update(starts.get(k, ()))
        live = {i for i in live if last_use[i] >= k}
        result.append(tuple(sorted(live)))
    result[n] = ()
    return result
