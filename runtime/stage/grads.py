"""What a stage holds for a minibatch in flight, and the gradients of its backward pass."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

__all__ = ["Held", "backward_grads", "outputs_backward"]


@dataclass
class Held:
    """One minibatch in flight on a stage.

    Attributes:
        inputs: the stage's inputs (received activations, or stage 0's minibatch).
        outputs: the forward's outputs (kept for the backward; not on the last stage).
        grads_in: the gradients of ``outputs`` from the next stage.
        targets: single-stage pipelines: the targets, read with the inputs.
    """

    inputs: tuple[Tensor, ...]
    outputs: tuple[Tensor, ...] = ()
    grads_in: tuple[Tensor, ...] = field(default_factory=tuple)
    targets: Tensor | None = None


def backward_grads(
    held: Held, leaves: dict[str, Tensor], outs: list[Tensor], gouts: list[Tensor] | None
) -> tuple[dict[str, Tensor | None], list[Tensor | None]]:
    """The gradients of ``outs`` (seeded by ``gouts``) with respect to the weight version
    ``leaves`` and to the floating-point inputs of ``held`` (``None`` where unused), in the
    inputs' order: what the update takes and what goes back to the previous stage."""
    names = list(leaves)
    wrt = [*leaves.values(), *(x for x in held.inputs if x.requires_grad)]
    res: tuple[Tensor | None, ...] = (None,) * len(wrt)
    if outs and wrt:
        res = torch.autograd.grad(outs, wrt, gouts, allow_unused=True)
    grads_w: dict[str, Tensor | None] = dict(zip(names, res[: len(names)], strict=True))
    needs = [x for x in held.inputs if x.requires_grad]
    by_id = {id(x): g for x, g in zip(needs, res[len(names) :], strict=True)}
    return grads_w, [by_id.get(id(x)) for x in held.inputs if x.is_floating_point()]


def outputs_backward(
    held: Held, leaves: dict[str, Tensor]
) -> tuple[dict[str, Tensor | None], list[Tensor | None]]:
    """The backward of a stage before the last: its floating-point outputs that need a
    gradient, seeded by the next stage's gradients (:func:`backward_grads`)."""
    outs = (o for o in held.outputs if o.is_floating_point())
    pairs = [(o, g) for o, g in zip(outs, held.grads_in, strict=True) if o.requires_grad]
    return backward_grads(held, leaves, [o for o, _ in pairs], [g for _, g in pairs])
