"""Exact local staleness with weight stashing (paper Sec. 4, made deterministic).

Minibatch ``p`` runs on every stage with exactly the weights ``w0 + u1 + ... + u(p-Nm)``
(:func:`planner.wsp.local_version`). A stage applies its update ``u_q`` right after the
backward pass of minibatch ``q`` to its *master* parameters with a real ``torch.optim``
optimizer; the versions still needed by in-flight or future minibatches are kept
copy-on-write: before the master moves on, its current storage is handed to the old
version and the master continues on a fresh copy. At any time a stage therefore holds
exactly ``Nm`` weight versions (the master plus ``Nm - 1`` stashed ones), the
``(Nm - 1) * param_bytes`` term of the planner's memory model.

A forward pass uses leaf tensors that alias a version's storage (``param.data``, with their
own autograd version counter), so the backward pass of the same minibatch differentiates
with respect to the version its forward used (weight stashing).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import TYPE_CHECKING

import torch
from torch import Tensor, nn

from planner.rules import get_rule
from planner.staleness import pipemare_lr, predict_scale, stage_delay
from planner.wsp import local_version
from profiler.errors import HetPipeRuntimeError
from runtime.config import OptimizerConfig
from runtime.stage.moves import ClassMoves

if TYPE_CHECKING:
    from runtime.sync.rule import SyncSpec

__all__ = [
    "VersionedWeights",
    "build_optimizer",
    "lr_at",
    "predict_syncing",
    "predicted",
    "stage_lr",
    "velocity",
]


def lr_at(cfg: OptimizerConfig, update: int, total_updates: int = 0) -> float:
    """Learning rate of the ``update``-th update (0-based) under ``cfg``'s schedule.

    Args:
        cfg: optimizer settings.
        update: number of updates applied before this one.
        total_updates: run length, used by ``cosine`` when ``cfg.total_updates`` is 0.
    """
    if cfg.lr_schedule == "step":
        return cfg.lr * cfg.gamma ** (update // max(1, cfg.step_size))
    if cfg.lr_schedule == "cosine":
        horizon = cfg.total_updates or total_updates or 1
        return cfg.lr * 0.5 * (1.0 + math.cos(math.pi * min(update, horizon) / horizon))
    if cfg.lr_schedule == "warmup" and update < cfg.warmup:
        return cfg.lr * (update + 1) / cfg.warmup
    return cfg.lr


def stage_lr(cfg: OptimizerConfig, update: int, total_updates: int, nm: int) -> float:
    """Learning rate of a stage's ``update``-th update: :func:`lr_at`, rescheduled by
    PipeMare (:func:`planner.staleness.pipemare_lr`) under ``cfg.remedy == "pipemare"``."""
    lr = lr_at(cfg, update, total_updates)
    if cfg.remedy != "pipemare":
        return lr
    return pipemare_lr(lr, update, stage_delay(nm), cfg.remedy_warmup)


def velocity(
    optimizer: torch.optim.Optimizer | None,
    params: dict[str, nn.Parameter],
    last_grads: dict[str, Tensor],
) -> dict[str, Tensor]:
    """Each parameter's velocity ``v`` of the prediction ``w - s * lr * v``: SGD's momentum
    buffer, else the last applied gradient (``last_grads``); absent: nothing to predict."""
    out: dict[str, Tensor] = {}
    for name, p in params.items():
        state = optimizer.state.get(p, {}) if optimizer is not None else {}
        buf = state.get("momentum_buffer")
        v = buf if isinstance(buf, Tensor) else last_grads.get(name)
        if v is not None:
            out[name] = v
    return out


def predicted(
    params: Mapping[str, Tensor], vel: Mapping[str, Tensor], scale: float
) -> dict[str, Tensor]:
    """New leaf tensors ``w - scale * v`` (``w`` where ``v`` is absent): weight prediction."""
    with torch.no_grad():
        out = {
            n: (p.detach() - scale * vel[n].to(p.device)) if n in vel else p.detach().clone()
            for n, p in params.items()
        }
    return {n: t.requires_grad_() for n, t in out.items()}


def predict_syncing(sync: SyncSpec, n_vws: int) -> tuple[int, int]:
    """``(VWs, D)`` of a stage's :class:`VersionedWeights` under ``sync`` with ``n_vws`` VWs in
    the plan: the rule's own count (:attr:`planner.rules.SyncRule.time_delays`) when the VWs
    synchronise through the shards, else ``(1, 0)`` (one VW alone, AllReduce, a rule without
    a delay count such as ``easgd``: ``predict`` counts the local staleness only)."""
    rule = get_rule(sync.rule, sync.plugins)
    if not rule.uses_shards or rule.time_delays is None:
        return 1, 0
    return rule.time_delays(dict(sync.params), n_vws, sync.D)


def build_optimizer(params: list[nn.Parameter], cfg: OptimizerConfig) -> torch.optim.Optimizer:
    """The ``torch.optim`` optimizer ``cfg`` describes, over ``params``."""
    if cfg.name == "adam":
        return torch.optim.Adam(
            params, lr=cfg.lr, betas=cfg.betas, eps=cfg.eps, weight_decay=cfg.weight_decay
        )
    return torch.optim.SGD(
        params, lr=cfg.lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay, foreach=True
    )


class VersionedWeights:
    """The weight versions of one stage and its optimizer.

    Call :meth:`acquire` at the start of each forward pass (minibatches in increasing
    order), :meth:`gradients_for` for the backward pass, and :meth:`update` after each
    backward pass (in the same order) with the minibatch's gradients.

    Args:
        params: the stage's master parameters, by name.
        nm: minibatches in flight (local staleness ``nm - 1``).
        cfg: optimizer settings.
        total_updates: run length (for the ``cosine`` schedule).
        first_update: updates before this run (a resumed run's lr-schedule position).
        moves: the stage's moves of stashed versions, optimizer state and gradients to host
            memory (:mod:`runtime.stage.moves`; ``None``: all on the device).
        syncing: ``(VWs, D)``: the VWs whose updates reach the stage through the run's
            synchronisation rule and their threshold (:func:`predict_syncing`); ``predict``
            counts the updates of the others its gradients miss.
    """

    def __init__(
        self,
        params: dict[str, nn.Parameter],
        nm: int,
        cfg: OptimizerConfig,
        total_updates: int = 0,
        first_update: int = 0,
        moves: ClassMoves | None = None,
        syncing: tuple[int, int] = (1, 0),
    ) -> None:
        self.master = params
        self.syncing = syncing
        self.nm = nm
        self.cfg = cfg
        self.total_updates = total_updates
        self.optimizer = build_optimizer(list(params.values()), cfg) if params else None
        self.version = 0  # updates applied to the master
        self.first_update = (
            first_update  # updates before this run (a resumed run's lr-schedule position)
        )
        self._versions: dict[int, dict[str, Tensor]] = {}
        self._users: dict[int, int] = {}
        self._last_acquired = 0
        self._mb_version: dict[int, int] = {}
        self._resumed = False  # versions -(nm-1)..-1 restored: the first minibatches use them
        self.param_bytes = sum(p.numel() * p.element_size() for p in params.values())
        self.moves = moves
        self._last_grads: dict[str, Tensor] = {}  # plain SGD's velocity under ``predict``

    # ------------------------------------------------------------ versions

    def _last_user(self, v: int) -> int:
        """The last minibatch that runs with version ``v``."""
        return self.nm if v == 0 else v + self.nm

    def acquire(self, mb: int) -> dict[str, Tensor]:
        """Leaf tensors of the version minibatch ``mb`` uses (``w0 + u1..u(mb-Nm)``).

        Raises:
            HetPipeRuntimeError: minibatches out of order or a version that was not kept.
        """
        if mb != self._last_acquired + 1:
            raise HetPipeRuntimeError(
                f"forward of minibatch {mb} after {self._last_acquired}: out of order"
            )
        v = mb - self.nm if self._resumed and mb < self.nm else local_version(mb, self.nm)
        if self.nm == 1 and v == self.version:  # no staleness: the master itself, no copies
            self._versions.setdefault(v, dict(self.master))
        if v not in self._versions:
            if v != self.version:
                raise HetPipeRuntimeError(
                    f"minibatch {mb} needs weight version {v} but the stage is at {self.version} "
                    "and did not keep it (scheduler violated the Nm bound)"
                )
            self._versions[v] = self._new_version(v)
        self._users[v] = self._users.get(v, 0) + 1
        self._mb_version[mb] = v
        self._last_acquired = mb
        if self.moves is not None:
            self.moves.version_up(self._versions[v])
        return self._versions[v]

    def _new_version(self, k: int) -> dict[str, Tensor]:
        """Leaf tensors of version ``k``, made while the master is at version ``k``: its
        storage, or under ``remedy: predict`` the weights predicted for the minibatch that
        will run on it (``k + Nm``; :func:`planner.staleness.predict_scale`). A resumed run
        predicts as the run that stopped, except plain SGD's first one (the last gradient is
        not in the snapshot)."""
        scale = 0.0
        if self.cfg.remedy == "predict":
            lr = lr_at(self.cfg, self.first_update + k, self.total_updates)
            mb = self.first_update + k + self.nm  # whole-run count
            scale = predict_scale(mb, self.nm, lr, *self.syncing)
        if scale == 0.0:
            return {n: p.data.requires_grad_() for n, p in self.master.items()}
        return predicted(
            self.master, velocity(self.optimizer, self.master, self._last_grads), scale
        )

    def _aliases_master(self, k: int) -> bool:
        """Whether version ``k``'s leaves share the master's storage."""
        leaves = self._versions[k]
        return any(leaves[n].data_ptr() == p.data_ptr() for n, p in self.master.items())

    def leaves(self, mb: int) -> dict[str, Tensor]:
        """The leaf tensors minibatch ``mb``'s forward used (on the device)."""
        leaves = self._versions[self._mb_version[mb]]
        if self.moves is not None:
            self.moves.version_up(leaves)
        return leaves

    def _stashed(self, v: int) -> bool:
        """Whether version ``v`` is kept and no longer the master's storage."""
        leaves = self._versions.get(v)
        if not leaves or not self.master:
            return False
        name = next(iter(self.master))
        return leaves[name] is not self.master[name] and (
            leaves[name].data_ptr() != self.master[name].data_ptr()
        )

    def park(self, mb: int) -> None:
        """Minibatch ``mb``'s task is done with its version: a stashed one goes to host memory
        (``weights: offload``)."""
        v = self._mb_version.get(mb, self.version - 1)
        if self.moves is not None and self._stashed(v):
            self.moves.version_down(self._versions[v])

    def prefetch(self) -> None:
        """Start bringing the next backward's version back (the oldest minibatch in flight)."""
        if self.moves is not None and self._mb_version:
            leaves = self._versions[self._mb_version[min(self._mb_version)]]
            self.moves.version_up(leaves, wait=False)

    def park_grads(self, grads: dict[str, Tensor | None]) -> dict[str, Tensor | None]:
        """Gradients waiting for the push: in host memory under ``gradients: offload``."""
        return grads if self.moves is None else self.moves.grads_down(grads)

    def _release(self, mb: int) -> None:
        v = self._mb_version.pop(mb)
        self._users[v] -= 1
        if self._users[v] == 0:
            del self._users[v]
            if self._last_acquired >= self._last_user(v):
                dropped = self._versions.pop(v)
                if self.moves is not None:
                    self.moves.forget(dropped)

    def update(self, mb: int, grads: dict[str, Tensor | None], apply: bool = True) -> None:
        """Release minibatch ``mb``'s version and apply its update ``u_mb`` to the master.

        Args:
            mb: the minibatch whose backward pass just finished (in increasing order).
            grads: gradient of the loss with respect to each parameter (``None`` = unused).
            apply: ``False``: a skipped update (``--on-nonfinite skip``): ``u_mb`` is zero,
                the optimizer state stays as it was, the versions and the lr schedule move on.

        Raises:
            HetPipeRuntimeError: updates out of order.
        """
        if mb != self.version + 1:
            raise HetPipeRuntimeError(
                f"update of minibatch {mb} after {self.version}: out of order"
            )
        v = self._mb_version[mb]
        self._release(mb)
        if self.moves is not None and self._stashed(v):  # kept for a later minibatch
            self.moves.version_down(self._versions[v])
        k = self.version
        if self._last_user(k) > mb:  # version k is still needed: keep its storage, move the master
            if k not in self._versions:
                self._versions[k] = self._new_version(k)
            if self._aliases_master(k):
                for p in self.master.values():
                    p.data = p.data.clone()
            if self.moves is not None:  # version k is stashed from now on
                self.moves.version_down(self._versions[k])
        if self.moves is not None:
            grads = self.moves.grads_up(grads)
            if self.optimizer is not None and apply:
                self.moves.state_up(self.optimizer)
        if self.optimizer is not None and apply:
            lr = stage_lr(self.cfg, self.first_update + k, self.total_updates, self.nm)
            for group in self.optimizer.param_groups:
                group["lr"] = lr
            for name, p in self.master.items():
                p.grad = grads.get(name)
            self.optimizer.step()
            for p in self.master.values():
                p.grad = None
            if self.cfg.remedy == "predict" and not self.cfg.momentum:
                self._last_grads = {
                    n: g.detach().clone() for n, g in grads.items() if g is not None
                }
            if self.moves is not None:
                self.moves.state_down(self.optimizer)
        self.version += 1

    def in_flight_versions(self) -> dict[int, dict[str, Tensor]]:
        """Copies of the versions the next ``Nm - 1`` minibatches run on, by their offset from
        the master (``-(Nm-1) .. -1``): at a wave end (``version`` a multiple of ``Nm``) what
        a snapshot must hold for a resumed run to go on exactly (:meth:`restore_versions`).

        Raises:
            HetPipeRuntimeError: one of them was not kept (called while minibatches are out
                of the admission order).
        """
        out: dict[int, dict[str, Tensor]] = {}
        for k in range(max(0, self.version - self.nm + 1), self.version):
            leaves = self._versions.get(k)
            if leaves is None:
                raise HetPipeRuntimeError(
                    f"weight version {k} is not kept at version {self.version} (Nm {self.nm})"
                )
            out[k - self.version] = {n: t.detach().clone() for n, t in leaves.items()}
        return out

    def restore_versions(self, versions: dict[int, dict[str, Tensor]]) -> None:
        """Before the first minibatch: the versions ``-(Nm-1) .. -1`` (relative to the master,
        :meth:`in_flight_versions`) that minibatches ``1 .. Nm-1`` of a resumed run use, as
        in the run that stopped (version ``0``, the master, serves minibatch ``Nm``).

        Raises:
            HetPipeRuntimeError: after the first forward, or a version missing or misshapen.
        """
        if self._last_acquired or self.version:
            raise HetPipeRuntimeError("weight versions are restored before the first minibatch")
        for k in range(1 - self.nm, 0):
            leaves = versions.get(k)
            if (
                leaves is None
                or set(leaves) != set(self.master)
                or any(leaves[n].shape != p.shape for n, p in self.master.items())
            ):
                raise HetPipeRuntimeError(
                    f"weight version {k} (of the {self.nm - 1} in flight) missing or misshapen"
                )
            self._versions[k] = {
                n: leaves[n].to(p.dtype).clone().requires_grad_() for n, p in self.master.items()
            }
        self._resumed = True

    def add_from(self, version: int, corrections: dict[str, Tensor]) -> None:
        """Add ``corrections`` (by parameter name) to the master and to every kept version
        ``>= version``, each distinct storage once (a WSP pull folded into the local copy)."""
        groups: list[dict[str, Tensor]] = [dict(self.master)]
        groups += [v for k, v in self._versions.items() if k >= version]
        seen: set[int] = set()
        with torch.no_grad():
            for group in groups:
                for name, c in corrections.items():
                    t = group[name]
                    if t.data_ptr() not in seen:
                        seen.add(t.data_ptr())
                        t.data.add_(c.to(t.device))  # a version may be in host memory

    @property
    def stashed_versions(self) -> int:
        """Weight versions held besides the master's storage."""
        if not self.master:
            return 0
        master_ptr = next(iter(self.master.values())).data_ptr()
        return sum(
            1
            for leaves in self._versions.values()
            if next(iter(leaves.values())).data_ptr() != master_ptr
        )

    @property
    def stashed_bytes(self) -> int:
        """Bytes of the stashed versions (``<= (Nm - 1) * param_bytes``)."""
        return self.stashed_versions * self.param_bytes
