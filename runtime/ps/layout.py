"""Static layout of the parameter-server shards: which parameters each shard holds, in which
flat order, and which stages (clients) push and pull which of them.

The paper's ``default`` placement (Sec. 8.1) assigns layers round-robin over the shards
(:func:`round_robin_assignment`); ``local`` placement (ED) is any assignment the caller
passes to :func:`make_shard_specs`. A :class:`ShardSpec` validates that the stages of every
virtual worker hold each of the shard's parameters exactly once (partitions may differ per
virtual worker, as with the HD and NP allocation policies).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from profiler.errors import ConfigError

__all__ = [
    "ClientSpec",
    "ParamSlot",
    "ShardSpec",
    "export_state_dict",
    "make_shard_specs",
    "round_robin_assignment",
    "shard_specs_for_layout",
]


@dataclass(frozen=True)
class ParamSlot:
    """One parameter tensor inside a shard's flat weight tensor.

    Attributes:
        name: parameter name in the model's ``state_dict`` (e.g. ``fc1.weight``).
        shape: tensor shape.
        offset: first element in the shard's flat tensor.
    """

    name: str
    shape: tuple[int, ...]
    offset: int

    @property
    def numel(self) -> int:
        """Number of elements."""
        n = 1
        for s in self.shape:
            n *= s
        return n


@dataclass(frozen=True)
class ClientSpec:
    """A stage of a VW that owns some of a shard's parameters.

    Attributes:
        vw: virtual-worker id.
        stage: stage index inside the VW.
        rank: the stage's rank in the process group.
        params: names of the shard's parameters this stage holds, in shard order.
    """

    vw: int
    stage: int
    rank: int
    params: tuple[str, ...]


@dataclass(frozen=True)
class ShardSpec:
    """Static description of one shard: its parameters and clients (validated on creation).

    Attributes:
        id: shard id (``ShardPlan.id``).
        rank: the shard process's rank in the process group.
        params: the shard's parameters, in flat order.
        clients: every (vw, stage) that pushes to and pulls from this shard, sorted.
        D: WSP staleness threshold; pushes of waves ``> clock + D`` are rejected.
            ``None`` disables that check (and bounds nothing).
    """

    id: int
    rank: int
    params: tuple[ParamSlot, ...]
    clients: tuple[ClientSpec, ...]
    D: int | None = None

    def __post_init__(self) -> None:
        names = [p.name for p in self.params]
        if len(set(names)) != len(names):
            raise ConfigError(f"shard {self.id}: duplicate parameter names in {names}")
        by_vw: dict[int, list[str]] = {}
        for c in self.clients:
            unknown = set(c.params) - set(names)
            if unknown:
                raise ConfigError(
                    f"shard {self.id}: client vw {c.vw} stage {c.stage} names unknown parameters {sorted(unknown)}"
                )
            by_vw.setdefault(c.vw, []).extend(c.params)
        for vw, held in by_vw.items():
            if sorted(held) != sorted(names):
                missing = sorted(set(names) - set(held))
                twice = sorted({n for n in held if held.count(n) > 1})
                raise ConfigError(
                    f"shard {self.id}: the stages of vw {vw} must hold each of the shard's parameters exactly "
                    f"once (missing {missing}, held twice {twice}); fix the stage partition"
                )
        if self.D is not None and self.D < 0:
            raise ConfigError(f"shard {self.id}: D must be >= 0, got {self.D}")

    @property
    def numel(self) -> int:
        """Elements of the flat weight tensor."""
        return sum(p.numel for p in self.params)

    @property
    def vws(self) -> tuple[int, ...]:
        """Ids of the VWs using this shard, sorted."""
        return tuple(sorted({c.vw for c in self.clients}))

    def slot(self, name: str) -> ParamSlot:
        """The slot of parameter ``name``."""
        for p in self.params:
            if p.name == name:
                return p
        raise KeyError(name)

    def segments(self, client: ClientSpec) -> list[tuple[int, int]]:
        """``(offset, numel)`` ranges of ``client``'s parameters in the flat tensor, in its message
        order, adjacent ranges merged (a stage's parameters on a shard are usually one range)."""
        out: list[tuple[int, int]] = []
        for s in (self.slot(n) for n in client.params):
            if out and out[-1][0] + out[-1][1] == s.offset:
                out[-1] = (out[-1][0], out[-1][1] + s.numel)
            else:
                out.append((s.offset, s.numel))
        return out

    def client_numel(self, client: ClientSpec) -> int:
        """Length of ``client``'s flat push/pull message."""
        return sum(n for _, n in self.segments(client))

    def flatten(self, tensors: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """The shard's flat float32 tensor from named parameters (e.g. a model's initial
        ``state_dict``); extra names are ignored.

        Raises:
            ConfigError: a parameter of the shard is missing or has another shape.
        """
        out = torch.empty(self.numel, dtype=torch.float32)
        for p in self.params:
            t = tensors.get(p.name)
            if t is None or tuple(t.shape) != p.shape:
                got = None if t is None else tuple(t.shape)
                raise ConfigError(
                    f"shard {self.id}: parameter {p.name!r} has shape {got}, expected {p.shape}"
                )
            out[p.offset : p.offset + p.numel].copy_(t.detach().reshape(-1))
        return out

    def unflatten(self, flat: torch.Tensor) -> dict[str, torch.Tensor]:
        """Named parameter tensors (copies) from the shard's flat tensor: the inverse of :meth:`flatten`."""
        return {
            p.name: flat[p.offset : p.offset + p.numel].clone().view(p.shape) for p in self.params
        }

    def client(self, vw: int, stage: int) -> ClientSpec:
        """The client spec of stage ``stage`` of VW ``vw``."""
        for c in self.clients:
            if (c.vw, c.stage) == (vw, stage):
                return c
        raise KeyError((vw, stage))


def round_robin_assignment(layers: Sequence[Sequence[str]], n_shards: int) -> dict[str, int]:
    """The paper's ``default`` placement: layer ``i``'s parameters go to shard ``i mod n``.

    Args:
        layers: parameter names per layer, in model order (layers without parameters
            are skipped, so they do not unbalance the round robin).
        n_shards: number of shards.

    Returns:
        parameter name -> shard id.
    """
    if n_shards < 1:
        raise ConfigError(f"need at least one parameter-server shard, got {n_shards}")
    out: dict[str, int] = {}
    for i, names in enumerate([ls for ls in layers if ls]):
        for n in names:
            out[n] = i % n_shards
    return out


def make_shard_specs(
    param_shapes: Mapping[str, Sequence[int]],
    assignment: Mapping[str, int],
    shard_ranks: Sequence[int],
    clients: Sequence[tuple[int, int, int, Sequence[str]]],
    D: int | None = None,
) -> tuple[ShardSpec, ...]:
    """Build every shard's spec from a parameter placement and the stages' parameter sets.

    Args:
        param_shapes: parameter name -> shape, in model order (this fixes the flat order).
        assignment: parameter name -> shard id (e.g. :func:`round_robin_assignment`).
        shard_ranks: process-group rank of shard ``i`` at position ``i``.
        clients: ``(vw, stage, rank, parameter names)`` for every stage of every VW.
        D: WSP staleness threshold, enforced by every shard.

    Raises:
        ConfigError: a parameter without a shard, an unknown shard id, or a VW whose stages
            do not hold every parameter exactly once.
    """
    slots: list[list[ParamSlot]] = [[] for _ in shard_ranks]
    offsets = [0] * len(shard_ranks)
    for name, shape in param_shapes.items():
        sid = assignment.get(name)
        if sid is None or not 0 <= sid < len(shard_ranks):
            raise ConfigError(
                f"parameter {name!r} is assigned to shard {sid!r}, not one of 0..{len(shard_ranks) - 1}"
            )
        slot = ParamSlot(name, tuple(int(s) for s in shape), offsets[sid])
        slots[sid].append(slot)
        offsets[sid] += slot.numel
    specs = []
    for sid, rank in enumerate(shard_ranks):
        mine = {p.name for p in slots[sid]}
        cs = sorted(
            (
                ClientSpec(vw, stage, r, tuple(p.name for p in slots[sid] if p.name in set(names)))
                for vw, stage, r, names in clients
                if mine & set(names)
            ),
            key=lambda c: (c.vw, c.stage),
        )
        specs.append(ShardSpec(sid, rank, tuple(slots[sid]), tuple(cs), D))
    return tuple(specs)


def shard_specs_for_layout(
    layers: Sequence[tuple[str, Sequence[str]]],
    param_shapes: Mapping[str, Sequence[int]],
    shard_layers: Sequence[Sequence[str]],
    vw_stages: Sequence[Sequence[tuple[int, int]]],
    shard_ranks: Sequence[int],
    stage_ranks: Sequence[Sequence[int]],
    D: int | None = None,
) -> tuple[ShardSpec, ...]:
    """Shard specs from the plan's view of the model: layers, shard placement, stage ranges.

    Args:
        layers: ``(layer name, parameter names it owns)`` for every layer in graph order
            (``ModelGraph.layers``' ``name`` and ``params``).
        param_shapes: parameter name -> shape, in model order (``named_parameters()``).
        shard_layers: layer names held by shard ``i`` (``Plan.shards[i].layers``).
        vw_stages: per VW, per stage, the inclusive layer-index range ``(first, last)``
            (``StagePlan.first_index``/``last_index``).
        shard_ranks: process-group rank of each shard.
        stage_ranks: process-group rank of each stage of each VW.
        D: WSP threshold every shard enforces.

    Raises:
        ConfigError: a layer named by a shard does not exist, a parameter is on no shard, or
            the layout and rank lists disagree in length.
    """
    by_name = {name: tuple(params) for name, params in layers}
    assignment: dict[str, int] = {}
    for sid, names in enumerate(shard_layers):
        for layer in names:
            if layer not in by_name:
                raise ConfigError(
                    f"shard {sid} holds layer {layer!r}, which the model graph does not have; re-run 'hetpipe plan'"
                )
            for p in by_name[layer]:
                assignment[p] = sid
    if len(shard_ranks) != len(shard_layers) or len(stage_ranks) != len(vw_stages):
        raise ConfigError(
            f"{len(shard_layers)} shards and {len(vw_stages)} VWs need as many rank lists, got "
            f"{len(shard_ranks)} shard ranks and {len(stage_ranks)} VW rank lists"
        )
    clients = []
    for vw, (stages, ranks) in enumerate(zip(vw_stages, stage_ranks, strict=True)):
        if len(stages) != len(ranks):
            raise ConfigError(f"vw {vw} has {len(stages)} stages but {len(ranks)} ranks")
        for s, ((first, last), rank) in enumerate(zip(stages, ranks, strict=True)):
            names = [p for _, params in layers[first : last + 1] for p in params]
            clients.append((vw, s, rank, names))
    return make_shard_specs(param_shapes, assignment, shard_ranks, clients, D)


def export_state_dict(
    specs: Sequence[ShardSpec], weights: Sequence[torch.Tensor]
) -> dict[str, torch.Tensor]:
    """One ordinary ``state_dict`` of the trained parameters from every shard's flat weights.

    Args:
        specs: every shard's spec.
        weights: each shard's flat global weights (``ShardState.weights``), same order.

    Returns:
        parameter name -> tensor (buffers such as batch-norm statistics live on the stages,
        not on the shards: :meth:`runtime.results.run_result.RunResult.state_dict` adds them).
    """
    out: dict[str, torch.Tensor] = {}
    for spec, flat in zip(specs, weights, strict=True):
        out.update(spec.unflatten(flat))
    return out
