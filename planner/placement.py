"""Parameter-server shard placement and the bytes each VW moves across nodes (paper Sec. 8.1).

One shard runs on every node. ``default`` places the layers that own parameters round-robin over
the shards in layer order (as TensorFlow does). ``local`` (meant for ED, where every VW runs
stage ``j`` on the same node) places each stage's layers on the shard of the node running that
stage, so pushes and pulls never leave the node.

Per wave (``Nm`` minibatches) a VW moves across nodes: for every pipeline boundary between GPUs
on different nodes, the activations and the gradients of ``Nm`` minibatches; and for every
layer whose shard is on another node than the GPU that runs it, one push of its update and one
pull of the new global weights (WSP synchronises once per wave).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from planner.cluster import Cluster, Device
from planner.plan import ShardPlan
from profiler.errors import PlanError

__all__ = ["PLACEMENTS", "PipelineLayout", "cross_node_bytes_per_wave", "place_shards"]

PLACEMENTS = ("default", "local")


@dataclass(frozen=True)
class PipelineLayout:
    """Where one VW runs each layer.

    Attributes:
        gpus: GPUs in pipeline order.
        cuts: stage bounds as layer indices ``0 = c_0 < ... < c_K = L``.
        cut_bytes: bytes crossing each stage boundary ``c_1 .. c_{K-1}``.
    """

    gpus: tuple[Device, ...]
    cuts: tuple[int, ...]
    cut_bytes: tuple[int, ...]

    def node_of_layer(self, layer: int) -> str:
        """Node of the GPU that runs ``layer``."""
        for j in range(len(self.gpus)):
            if self.cuts[j] <= layer < self.cuts[j + 1]:
                return self.gpus[j].node
        raise PlanError(f"layer index {layer} is outside the pipeline's cuts {self.cuts}")


def place_shards(
    cluster: Cluster,
    layouts: Sequence[PipelineLayout],
    layer_names: Sequence[str],
    param_bytes: Sequence[int],
    placement: str = "default",
) -> tuple[ShardPlan, ...]:
    """One shard per node holding the parameters of its layers.

    Raises:
        PlanError: unknown placement, or ``local`` with VWs that run a stage on different nodes.
    """
    nodes = [n.name for n in cluster.nodes]
    owned: dict[str, list[int]] = {n: [] for n in nodes}
    with_params = [i for i, b in enumerate(param_bytes) if b > 0]
    if placement == "default":
        for r, i in enumerate(with_params):
            owned[nodes[r % len(nodes)]].append(i)
    elif placement == "local":
        ref = layouts[0]
        for v, lay in enumerate(layouts[1:], start=1):
            same = lay.cuts == ref.cuts and all(
                a.node == b.node for a, b in zip(lay.gpus, ref.gpus, strict=True)
            )
            if not same:
                raise PlanError(
                    f"placement 'local' needs every VW to run each stage's layers on the same node (policy ed); "
                    f"VW {v} differs from VW 0 ({''.join(d.letter for d in lay.gpus)} vs "
                    f"{''.join(d.letter for d in ref.gpus)}); use --placement default"
                )
        for i in with_params:
            owned[ref.node_of_layer(i)].append(i)
    else:
        raise PlanError(f"unknown placement {placement!r}; use one of {', '.join(PLACEMENTS)}")
    return tuple(
        ShardPlan(
            s,
            n,
            tuple(layer_names[i] for i in owned[n]),
            int(sum(param_bytes[i] for i in owned[n])),
        )
        for s, n in enumerate(nodes)
    )


def cross_node_bytes_per_wave(
    layout: PipelineLayout,
    shards: Sequence[ShardPlan],
    layer_names: Sequence[str],
    param_bytes: Sequence[int],
    nm: int,
) -> int:
    """Bytes one VW sends and receives across nodes per wave (activations, gradients, push, pull)."""
    total = 0
    for j in range(len(layout.gpus) - 1):
        if layout.gpus[j].node != layout.gpus[j + 1].node:
            total += 2 * nm * layout.cut_bytes[j]
    index = {name: i for i, name in enumerate(layer_names)}
    for shard in shards:
        for name in shard.layers:
            i = index[name]
            if layout.node_of_layer(i) != shard.node:
                total += 2 * int(param_bytes[i])
    return total
