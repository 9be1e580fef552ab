"""Every way to fit a model that a VW cannot hold: the remedies ``hetpipe plan`` lists on refusal.

When a VW cannot hold the model even with Nm = 1, the planner says each way out it can prove:

- ``--memory auto``: some offload/recompute placement (:data:`planner.offload.LADDER`,
  GeePS-style) fits the VW as it is;
- more memory: every GPU of the VW with the smallest shortfall more (emulated nodes: the new
  ``emulate.memory`` value);
- fewer, larger VWs: the largest VW count (same policy first, then the others) whose every VW
  fits, i.e. more GPUs per VW.

:func:`fit_remedies` is pure: memory checks are passed in, so it is tested without planning.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from planner.allocation import Allocation, allocate
from planner.cluster import Cluster, Device
from profiler.errors import PlanError
from profiler.units import format_bytes

__all__ = ["Refusal", "fit_remedies", "refusal_message"]

FitsFn = Callable[[Sequence[Device]], bool]
"""Whether some order and partition of these GPUs hold the model at Nm = 1."""


@dataclass(frozen=True)
class Refusal:
    """Why one VW cannot hold the model, and what the memory checks say.

    Attributes:
        vw: index of the VW that cannot hold the model.
        gpus: its GPUs.
        model: model name.
        shortfall_bytes: bytes every GPU of the VW would need in addition (Nm = 1).
        offload_fits: some ``--memory auto`` placement fits this VW (``None``: already auto).
    """

    vw: int
    gpus: tuple[Device, ...]
    model: str
    shortfall_bytes: int
    offload_fits: bool | None


def _vw_counts_below(cluster: Cluster, current: int) -> list[int]:
    """VW counts smaller than ``current`` dividing the GPU total, largest first."""
    total = len(cluster.devices)
    return [v for v in range(current - 1, 0, -1) if total % v == 0]


def _fewer_vws(
    cluster: Cluster, alloc: Allocation, fits: FitsFn, max_vw_gpus: int
) -> Allocation | None:
    """The allocation with the most VWs, fewer than ``alloc``'s, whose every VW fits: the same
    policy first, then the others; ``None`` when none does."""
    policies = [alloc.policy] + [p for p in ("np", "ed", "hd") if p != alloc.policy]
    for policy in policies:
        for v in _vw_counts_below(cluster, len(alloc.groups)):
            if len(cluster.devices) // v > max_vw_gpus:
                break
            try:
                cand = allocate(cluster, policy, v)
            except PlanError:
                continue
            if all(_fits_or_false(fits, g) for g in cand.groups):
                return cand
    return None


def _fits_or_false(fits: FitsFn, gpus: Sequence[Device]) -> bool:
    try:
        return fits(gpus)
    except PlanError:  # e.g. more GPUs than the model has candidate segments
        return False


def fit_remedies(
    cluster: Cluster,
    alloc: Allocation,
    refusal: Refusal,
    fits: FitsFn,
    max_vw_gpus: int,
) -> list[str]:
    """Each way to make the model fit, in hetpipe's words (most local first).

    Args:
        cluster: the cluster as planned (emulated caps applied).
        alloc: the allocation that failed.
        refusal: the VW that cannot hold the model.
        fits: the memory check under the user's ``--memory`` (Nm = 1).
        max_vw_gpus: largest VW worth proposing (the model's candidate segments).
    """
    out: list[str] = []
    if refusal.offload_fits:
        out.append("let the memory manager offload or recompute (--memory auto)")
    short = format_bytes(refusal.shortfall_bytes)
    emulated = {g.node: g.emulation for g in refusal.gpus if g.emulation is not None}
    if emulated:
        out.append(
            "raise emulate.memory in the cluster file: "
            + ", ".join(
                f"node {node} {format_bytes(e.memory_bytes)} -> "
                f"{format_bytes(e.memory_bytes + refusal.shortfall_bytes + 1)}"
                for node, e in sorted(emulated.items())
            )
        )
    else:
        out.append(f"{short} more memory per stage (on each GPU of VW {refusal.vw})")
    bigger = _fewer_vws(cluster, alloc, fits, max_vw_gpus)
    if bigger is not None:
        size = max(len(g) for g in bigger.groups)
        out.append(
            f"more GPUs per VW: --policy {bigger.policy} --vws {len(bigger.groups)} "
            f"(VWs of {size} GPUs fit)"
        )
    return out


def refusal_message(refusal: Refusal, remedies: Sequence[str]) -> str:
    """The one-line refusal: what does not fit, then every remedy."""
    sig = "".join(d.letter for d in refusal.gpus)
    more_gpus = any(r.startswith("more GPUs per VW") for r in remedies)
    return (
        f"VW {refusal.vw} ({sig}) cannot hold {refusal.model} even with Nm=1: smallest "
        f"shortfall {format_bytes(refusal.shortfall_bytes)} on one stage; to fit it: "
        + "; or ".join(remedies)
        + ("" if more_gpus else " (no smaller VW count fits)")
    )
