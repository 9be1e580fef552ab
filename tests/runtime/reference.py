"""Single-process references the pipeline must reproduce (no torch.distributed)."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn
from torch.func import functional_call

from planner.staleness import predict_scale
from runtime.config import OptimizerConfig
from runtime.data import MinibatchSource
from runtime.stage.weights import build_optimizer, lr_at, predicted, stage_lr, velocity


def plain_loop(
    model: nn.Module, data: MinibatchSource, loss_fn: Any, cfg: OptimizerConfig, steps: int
) -> tuple[list[float], dict[str, Tensor]]:
    """A plain PyTorch training loop: forward, backward, optimizer step."""
    model.train()
    opt = build_optimizer(list(model.parameters()), cfg)
    losses = []
    for p in range(1, steps + 1):
        for g in opt.param_groups:
            g["lr"] = lr_at(cfg, p - 1, steps)
        x, y = data.batch(p)
        opt.zero_grad(set_to_none=True)
        loss = loss_fn(model(*x), y)
        loss.backward()
        opt.step()
        losses.append(float(loss.item()))
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}


def delayed_loop(
    model: nn.Module, data: MinibatchSource, loss_fn: Any, cfg: OptimizerConfig, steps: int, nm: int
) -> tuple[list[float], dict[str, Tensor]]:
    """Minibatch p computes its gradient on w0 + u1..u(p-nm): each update lands nm minibatches
    late; under ``cfg.remedy`` on that version predicted ahead with its velocity (``predict``)
    or with PipeMare's step size (``pipemare``)."""
    model.train()
    params = dict(model.named_parameters())
    opt = build_optimizer(list(params.values()), cfg)
    history = [{n: p.detach().clone() for n, p in params.items()}]
    velocities: list[dict[str, Tensor]] = [{}]  # each version's velocity (predict)
    last: dict[str, Tensor] = {}
    losses = []
    for p in range(1, steps + 1):
        v = max(0, p - nm)
        version = history[v]
        scale = predict_scale(p, nm, lr_at(cfg, v, steps)) if cfg.remedy == "predict" else 0.0
        if scale:
            w = predicted(version, velocities[v], scale)
        else:
            w = {n: t.clone().requires_grad_() for n, t in version.items()}
        x, y = data.batch(p)
        loss = loss_fn(functional_call(model, w, tuple(x)), y)
        grads = torch.autograd.grad(loss, list(w.values()), allow_unused=True)
        for g in opt.param_groups:
            g["lr"] = stage_lr(cfg, p - 1, steps, nm)
        for (_, prm), grad in zip(params.items(), grads, strict=True):
            prm.grad = grad
        opt.step()
        for prm in params.values():
            prm.grad = None
        last = {n: g.clone() for n, g in zip(params, grads, strict=True) if g is not None}
        history.append({n: q.detach().clone() for n, q in params.items()})
        velocities.append({n: t.clone() for n, t in velocity(opt, params, last).items()})
        losses.append(float(loss.item()))
    return losses, {n: q.detach().clone() for n, q in params.items()}
