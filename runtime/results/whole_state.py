"""The whole trained state under every name the user's module has: parameters and buffers.

The shards hold the global parameters, each stage process its buffers (batch-norm running
statistics, a BART ``final_logits_bias``), each under one canonical name: the first name
``module.named_parameters()`` / ``named_buffers()`` gives a tensor. A tied or shared tensor
has more names in ``module.state_dict()`` (Qwen2's ``lm_head.weight`` is
``model.embed_tokens.weight``); :func:`state_keys` lists them all, so the exported state
loads into the user's module with ``strict=True``.

Buffers each VW updates on its own (every VW's batch norm sees its own data) are exported
as :func:`merge_buffers` says: the mean over the VWs for floating-point buffers (the running
statistics of all the data the VWs saw, what DDP's ``broadcast_buffers`` approximates by
copying rank 0's), the largest value for integer ones (``num_batches_tracked``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
from torch import Tensor, nn

__all__ = ["merge_buffers", "state_keys", "user_state"]


def state_keys(module: nn.Module) -> tuple[tuple[str, str], ...]:
    """Every key of ``module.state_dict()``, in its order, with the canonical name of the
    tensor it holds (the first name ``named_parameters`` / ``named_buffers`` gives it; works
    on the ``meta`` device). A non-persistent buffer is not a key, as in the module's own."""
    canonical: dict[int, str] = {}
    for name, t in [*module.named_parameters(), *module.named_buffers()]:
        canonical.setdefault(id(t), name)
    return tuple(
        (key, canonical.get(id(t), key)) for key, t in module.state_dict(keep_vars=True).items()
    )


def merge_buffers(per_vw: Sequence[Mapping[str, Tensor]]) -> dict[str, Tensor]:
    """One value per buffer from every VW's (the VWs that hold it): the mean of a
    floating-point buffer (computed in float64, returned in its dtype), the largest value of
    an integer one. One VW: its own values.

    >>> a = {"bn.running_mean": torch.tensor([1.0, 2.0]), "bn.num_batches_tracked": torch.tensor(3)}
    >>> b = {"bn.running_mean": torch.tensor([3.0, 4.0]), "bn.num_batches_tracked": torch.tensor(5)}
    >>> out = merge_buffers([a, b])
    >>> out["bn.running_mean"].tolist(), int(out["bn.num_batches_tracked"])
    ([2.0, 3.0], 5)
    """
    names: dict[str, None] = {}
    for bufs in per_vw:
        names.update(dict.fromkeys(bufs))
    out: dict[str, Tensor] = {}
    for name in names:
        values = [bufs[name] for bufs in per_vw if name in bufs]
        if len(values) == 1:
            out[name] = values[0]
        elif values[0].is_floating_point() or values[0].is_complex():
            mean = torch.stack([v.to(torch.float64) for v in values]).mean(dim=0)
            out[name] = mean.to(values[0].dtype)
        else:
            out[name] = torch.stack(values).amax(dim=0)
    return out


def user_state(trained: Mapping[str, Tensor], keys: Sequence[tuple[str, str]]) -> dict[str, Tensor]:
    """``trained`` (by canonical name) under every key of the user's ``state_dict`` (``keys``:
    :func:`state_keys`; none: ``trained`` as it is). A key whose tensor was not trained (the
    model's forward never reads it) is left out."""
    if not keys:
        return dict(trained)
    return {key: trained[canon] for key, canon in keys if canon in trained}
