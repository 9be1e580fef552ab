"""cluster.yaml: nodes of (possibly emulated) GPUs and the links between them.

Example (the HetPipe paper's cluster, ``examples/paper_cluster.yaml``)::

    name: hetpipe-paper
    nodes:
      - {name: V, gpu: TITAN V, count: 4}
      - {name: R, gpu: TITAN RTX, count: 4}
      - {name: G, gpu: GeForce RTX 2060, count: 4}
      - {name: Q, gpu: Quadro P4000, count: 4}
    links:
      intra_node: {bandwidth: 15.75GB/s, latency: 5us}
      inter_node: {bandwidth: 56Gbit/s, latency: 2us}

A node may set ``memory`` (overrides the catalog), ``host`` (address for multi-host
runs) and ``host_memory`` (host memory its GPUs may offload to, shared equally; default
unbounded). ``links: {host_link: ...}`` is the GPU <-> host-memory link offloaded data
crosses (:mod:`planner.offload`; PCIe 3.0 x16 by default). ``emulate: {speed: 0.25, memory: 64MiB}``
runs the node's GPUs as CPU processes whose layers are paced to ``calibrated CPU time / speed``
and whose memory is capped; ``straggle: {p: 0.05, factor: 3}`` inside it makes 5 % of the
(VW, wave)s 3x slower (:mod:`planner.straggle`, reproducible: ``seed`` defaults to 0).
``runtime_overhead: {ms_per_task: 0.4, cores: 2, ms_per_wave: 1.0, ms_per_mb: 2.0}`` is the
runtime's own cost per task, and per stage per wave through parameter servers (plus per MB of
the stage's parameters), the planner predicts with (:mod:`planner.overhead`; fitted by
``benchmarks/fit_overhead.py``; absent: none).
The file is validated with pydantic (the schema: :mod:`planner.cluster_schema`) and turned
into frozen dataclasses; every error is one line naming the file, the field and the fix. Values are range-checked: sizes, bandwidths
and latencies finite (bandwidth positive), an emulated memory cap at most the GPU's own memory,
names printable and short (no newlines or terminal escapes).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from functools import cached_property
from typing import Any

from pydantic import (
    ValidationError,
)

from planner.cluster_schema import PCIE_BPS, ClusterIn, LinkIn, pydantic_error
from planner.offload import HostShare
from planner.overhead import NO_OVERHEAD, RuntimeOverhead
from planner.straggle import NO_STRAGGLE, Straggle
from profiler.catalog import lookup_gpu
from profiler.errors import ConfigError, shown
from profiler.inputs import load_document

__all__ = [
    "NODE_CARD",
    "OWN_LINK",
    "Cluster",
    "Device",
    "Emulation",
    "Link",
    "LinkTable",
    "Node",
    "allreduce_s",
    "fifo_slot",
    "load_cluster",
    "parse_cluster",
    "parse_links",
    "sender_queue",
]


# ---------------------------------------------------------------- typed, frozen result


@dataclass(frozen=True)
class Emulation:
    """How a CPU process stands in for a GPU.

    Attributes:
        speed: relative speed; each layer takes ``calibrated CPU time / speed``.
        memory_bytes: memory cap enforced by byte accounting at run time.
        straggle: per-(VW, wave) slowdown (``emulate: {straggle: {p: 0.05, factor: 3}}``,
            :mod:`planner.straggle`); none by default.
    """

    speed: float
    memory_bytes: int
    straggle: Straggle = NO_STRAGGLE


@dataclass(frozen=True)
class Link:
    """A link class modelled as ``latency_s + bytes / bandwidth_bps`` seconds per message."""

    bandwidth_bps: float
    latency_s: float

    def time_s(self, nbytes: float) -> float:
        """Seconds to move ``nbytes`` over this link (0 bytes cost nothing).

        The one formula every link charge uses: the cost model, the simulator, the AllReduce
        prediction and the runtime's emulated-link pacing (:mod:`runtime.link_pacing`).

        >>> Link(1e9, 1e-5).time_s(1e6)
        0.00101
        """
        return 0.0 if nbytes <= 0 else self.latency_s + nbytes / self.bandwidth_bps

    def scaled(self, factor: float) -> Link:
        """This link with every transfer ``factor`` times longer (latency times ``factor``,
        bandwidth divided by it): ``scaled(f).time_s(n) == f * time_s(n)``."""
        return self if factor == 1.0 else Link(self.bandwidth_bps / factor, self.latency_s * factor)


def allreduce_s(link: Link, param_bytes: float, n: int) -> float:
    """Seconds of a ring all-reduce of ``param_bytes`` over ``n`` workers on ``link``:
    ``2 (n - 1)`` steps, each moving ``param_bytes / n``. What :func:`planner.predict.simulate_allreduce`
    charges and the runtime's AllReduce paces (:mod:`runtime.link_pacing`).

    >>> allreduce_s(Link(1e9, 0.0), 4e6, 4)
    0.006
    """
    return 2 * (n - 1) * link.time_s(param_bytes / n) if n > 1 else 0.0


PCIE = Link(PCIE_BPS, 10e-6)
"""The default host link (GPU <-> host memory; offloaded data moves over it)."""


OWN_LINK = "own"  # a GPU's own link: one queue per GPU
NODE_CARD = "card"  # a node's network card: one queue shared by every GPU of the node


def sender_queue(src_node: str, dst_node: str) -> str:
    """The sender's queue a transfer from a GPU of ``src_node`` to one of ``dst_node`` waits
    in (each queue carries one transfer at a time, first come first served): the sending
    GPU's own link inside a node (:data:`OWN_LINK`), its node's network card, shared by
    every GPU of that node, to another node (:data:`NODE_CARD`). The simulator charges and
    the runtime paces each transfer on this queue (activations, gradients, a push's parts).

    >>> sender_queue("V", "V"), sender_queue("V", "R")
    ('own', 'card')
    """
    return OWN_LINK if src_node == dst_node else NODE_CARD


def fifo_slot(free: float, ready: float, charge: float) -> tuple[float, float]:
    """The ``(begin, end)`` of a transfer of ``charge`` ready at ``ready`` on a queue that is
    free at ``free`` (one transfer at a time, first come first served): it begins when both
    hold and ends ``charge`` later, when the queue is free again. The one rule of every link
    queue: the simulator's (ms) and the runtime's (:mod:`runtime.link_pacing`, seconds).

    >>> fifo_slot(free=2.0, ready=1.0, charge=0.5), fifo_slot(free=0.0, ready=1.0, charge=0.5)
    ((2.0, 2.5), (1.0, 1.5))
    """
    begin = free if free > ready else ready
    return begin, begin + charge


@dataclass(frozen=True)
class LinkTable:
    """The links a transfer between two nodes crosses, as charged (scaled) time.

    Attributes:
        intra_node: the link between two GPUs of one node, as written in the cluster file.
        inter_node: the link between GPUs of two nodes, as written.
        scale: how many times longer every transfer takes than the written links say
            (``links: {scale: F}``, emulated clusters only): set it to the emulated compute's
            slowdown against the real GPUs so the emulated cluster keeps the real one's
            communication/computation ratio. 1 on real clusters.
    """

    intra_node: Link
    inter_node: Link
    scale: float = 1.0
    host_link: Link = PCIE

    @property
    def host(self) -> Link:
        """The charged GPU <-> host-memory link (offloaded bytes cross it; scaled)."""
        return self.host_link.scaled(self.scale)

    def describe(self, paced: bool) -> str:
        """One line for printouts: the written links, and how the runtime charges them.

        >>> print(LinkTable(Link(2e9, 5e-5), Link(1e9, 8e-5), 10.0).describe(True))
        links intra-node 2 GB/s + 50 us, inter-node 1 GB/s + 80 us; emulated: paced x10
        """

        def one(link: Link) -> str:
            return f"{link.bandwidth_bps / 1e9:.3g} GB/s + {link.latency_s * 1e6:.3g} us"

        how = f"emulated: paced x{self.scale:g}" if paced else "real, not paced"
        return f"links intra-node {one(self.intra_node)}, inter-node {one(self.inter_node)}; {how}"

    def between(self, a: str, b: str) -> Link:
        """The charged link between a GPU of node ``a`` and one of node ``b`` (scaled)."""
        return (self.intra_node if a == b else self.inter_node).scaled(self.scale)


@dataclass(frozen=True)
class Node:
    """A machine with ``count`` identical GPUs."""

    name: str
    host: str
    gpu_type: str
    letter: str
    count: int
    memory_bytes: int
    emulation: Emulation | None = None
    host_memory_bytes: int = 0  # host memory the node's GPUs may offload to (0: unbounded)


@dataclass(frozen=True)
class Device:
    """One GPU of the cluster: ``node`` name, ``index`` on that node, catalog ``type``."""

    node: str
    index: int
    type: str
    letter: str
    memory_bytes: int
    emulation: Emulation | None = None

    @property
    def label(self) -> str:
        """Short unique label, e.g. ``V:2``."""
        return f"{self.node}:{self.index}"


@dataclass(frozen=True)
class Cluster:
    """A parsed cluster.yaml."""

    name: str
    nodes: tuple[Node, ...]
    intra_node: Link
    inter_node: Link
    source: str = "<memory>"
    host_link: Link = PCIE
    link_scale: float = 1.0  # emulated clusters: every link transfer takes this many times longer
    runtime_overhead: RuntimeOverhead = NO_OVERHEAD  # the runtime's own cost (planner.overhead)

    @cached_property
    def devices(self) -> tuple[Device, ...]:
        """All GPUs, node by node (built once)."""
        return tuple(
            Device(n.name, i, n.gpu_type, n.letter, n.memory_bytes, n.emulation)
            for n in self.nodes
            for i in range(n.count)
        )

    @property
    def emulated(self) -> bool:
        """True when every node is emulated on CPU processes."""
        return all(n.emulation is not None for n in self.nodes)

    @cached_property
    def _by_name(self) -> dict[str, Node]:
        """Nodes by name (built once: planning 10,000 GPUs looks nodes up ~10^5 times)."""
        out: dict[str, Node] = {}
        for n in self.nodes:
            out.setdefault(n.name, n)
        return out

    def node(self, name: str) -> Node:
        """The node called ``name``."""
        found = self._by_name.get(name)
        if found is None:
            raise ConfigError(f"{self.source}: no node named {shown(name)}")
        return found

    def host_memory_bytes(self, node: str) -> int:
        """Host memory one GPU of ``node`` may offload to: the node's share per GPU (0: unbounded)."""
        n = self.node(node)
        return n.host_memory_bytes // n.count

    def host_share(self, node: str) -> HostShare:
        """One GPU of ``node``'s share of its host link and host memory (:mod:`planner.offload`)."""
        return HostShare(self.node(node).count, self.host_memory_bytes(node))

    def host_shares(self) -> dict[str, HostShare]:
        """:meth:`host_share` of every node, by node name."""
        return {n.name: self.host_share(n.name) for n in self.nodes}

    @property
    def links(self) -> LinkTable:
        """The links between nodes, as charged (:attr:`link_scale` applied)."""
        return LinkTable(self.intra_node, self.inter_node, self.link_scale, self.host_link)

    def link(self, a: Device, b: Device) -> Link:
        """The charged link between two devices: intra-node when they share a node."""
        return self.links.between(a.node, b.node)

    def to_dict(self) -> dict[str, Any]:
        """A cluster.yaml-shaped dict (plain units) that :func:`parse_cluster` reads back."""
        nodes = []
        for n in self.nodes:
            d: dict[str, Any] = {
                "name": n.name,
                "host": n.host,
                "gpu": n.gpu_type,
                "count": n.count,
                "memory": n.memory_bytes,
            }
            if n.emulation is not None:
                emu = n.emulation
                d["emulate"] = {"speed": emu.speed, "memory": emu.memory_bytes}
                if emu.straggle.active:
                    st = emu.straggle
                    d["emulate"]["straggle"] = {"p": st.p, "factor": st.factor, "seed": st.seed}
            if n.host_memory_bytes:
                d["host_memory"] = n.host_memory_bytes
            nodes.append(d)
        pairs = (
            ("intra_node", self.intra_node),
            ("inter_node", self.inter_node),
            ("host_link", self.host_link),
        )
        links: dict[str, Any] = {
            k: {"bandwidth": v.bandwidth_bps, "latency": v.latency_s} for k, v in pairs
        }
        if self.link_scale != 1.0:  # absent = 1: older plan files load unchanged
            links["scale"] = self.link_scale
        out = {"name": self.name, "nodes": nodes, "links": links}
        if self.runtime_overhead != NO_OVERHEAD:  # absent = none: older plan files load unchanged
            ro = self.runtime_overhead
            model: dict[str, float] = {"ms_per_task": ro.ms_per_task, "cores": ro.cores}
            if ro.ms_per_wave or ro.ms_per_mb:  # absent = 0: older plan files load unchanged
                model |= {"ms_per_wave": ro.ms_per_wave, "ms_per_mb": ro.ms_per_mb}
            out["runtime_overhead"] = model
        return out


def parse_cluster(data: object, source: str = "<memory>") -> Cluster:
    """Validate a cluster.yaml document (already parsed from YAML).

    Raises:
        ConfigError: one line naming ``source``, the field and the fix.
    """
    if not isinstance(data, dict):
        raise ConfigError(
            f"{source}: the document must be a mapping with 'nodes:' (and optional 'links:'), "
            f"got {type(data).__name__}"
        )
    try:
        parsed = ClusterIn.model_validate(data)
    except ValidationError as exc:
        raise pydantic_error(exc, source) from None
    nodes = []
    seen: set[str] = set()
    for i, n in enumerate(parsed.nodes):
        if n.name in seen:
            raise ConfigError(
                f"{source}: nodes[{i}].name: duplicate node name {n.name!r} (names must be unique)"
            )
        seen.add(n.name)
        try:
            spec = lookup_gpu(n.gpu)
            gpu_type, letter, memory = spec.name, spec.letter, spec.memory_bytes
        except ConfigError as exc:
            if n.memory is None:
                raise ConfigError(f"{source}: nodes[{i}].gpu: {exc}") from None
            gpu_type, letter, memory = n.gpu, n.gpu[:1].upper(), n.memory
        memory = n.memory if n.memory is not None else memory
        if n.emulate is not None and n.emulate.memory > memory:
            raise ConfigError(
                f"{source}: nodes[{i}].emulate.memory: {n.emulate.memory} bytes is more than the "
                f"{gpu_type}'s own {memory} bytes; lower it (or set the node's memory)"
            )
        emu = None
        if n.emulate is not None:
            st = n.emulate.straggle
            straggle = Straggle(st.p, st.factor, st.seed) if st is not None else NO_STRAGGLE
            emu = Emulation(n.emulate.speed, n.emulate.memory, straggle)
        host_mem = n.host_memory or 0
        nodes.append(
            Node(n.name, n.host or n.name, gpu_type, letter, n.count, memory, emu, host_mem)
        )
    emulated = [n.emulation is not None for n in nodes]
    if any(emulated) and not all(emulated):
        raise ConfigError(
            f"{source}: nodes: either every node has 'emulate:' or none does (mixed clusters cannot run)"
        )
    links = parsed.links
    if links.scale != 1.0 and not all(emulated):
        raise ConfigError(
            f"{source}: links.scale: {links.scale:g} applies to emulated clusters only (real "
            "GPUs move bytes at the links' own speed); drop it or add 'emulate:' to every node"
        )
    return Cluster(
        parsed.name,
        tuple(nodes),
        Link(links.intra_node.bandwidth, links.intra_node.latency),
        Link(links.inter_node.bandwidth, links.inter_node.latency),
        source,
        Link(links.host_link.bandwidth, links.host_link.latency),
        links.scale,
        RuntimeOverhead(**parsed.runtime_overhead.model_dump()),
    )


def load_cluster(path: str | os.PathLike[str]) -> Cluster:
    """Read and validate a cluster.yaml file.

    Raises:
        ConfigError: unreadable file, YAML syntax error or invalid content.
    """
    return parse_cluster(load_document(path, "cluster file", ConfigError), os.fspath(path))


def parse_links(data: object, source: str) -> dict[str, Link]:
    """Validate a links document (``intra_node``/``inter_node``, each with ``bandwidth`` and
    optional ``latency``, as in cluster.yaml's ``links:``; a top-level ``links:`` key is accepted).

    Returns:
        The link classes the document names (at least one).

    Raises:
        ConfigError: one line naming ``source``, the field and the fix.
    """
    if isinstance(data, dict) and isinstance(data.get("links"), dict):
        data = data["links"]
    if not isinstance(data, dict) or not ({"intra_node", "inter_node"} & set(data)):
        raise ConfigError(
            f"{source}: the links file names neither intra_node nor inter_node (write e.g. "
            "'intra_node: {bandwidth: 12GB/s, latency: 5us}')"
        )
    out: dict[str, Link] = {}
    for key in ("intra_node", "inter_node"):
        if key in data:
            try:
                link = LinkIn.model_validate(data[key])
            except ValidationError as exc:
                raise pydantic_error(exc, f"{source}: {key}") from None
            out[key] = Link(link.bandwidth, link.latency)
    return out
