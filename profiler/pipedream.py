"""Import PipeDream ``graph.txt`` profiles into the hetpipe profile table.

PipeDream (msr-fiddle/pipedream) stores one profiled model as a text DAG::

    node4 -- Conv2d(3, 64, ...) -- forward_compute_time=1.2, backward_compute_time=2.5, activation_size=822083584.0, parameter_size=7168.000
    \tnode4 -- node5

A node line gives the layer's forward and backward time (ms), output activation size
(bytes; a ``[a; b; c]`` list for tuple outputs, summed here) and parameter size (bytes).
A tab-indented line is a directed edge. Nodes are ordered topologically with networkx
(ties broken by PipeDream node number, model inputs first); every ``Input*`` node becomes
a ``placeholder`` row and one ``output`` row consumes the sinks, so cut bytes work exactly
as for fx graphs. Sums of times and sizes equal the file's.
"""

from __future__ import annotations

import logging
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import networkx as nx
import pandas as pd

from profiler.errors import ProfileError, shown
from profiler.inputs import read_text
from profiler.table import COLUMNS, Profile, ProfileMeta, check_table
from profiler.units import MAX_BYTES

__all__ = ["PipeDreamNode", "import_pipedream", "parse_graph_txt"]

log = logging.getLogger(__name__)

_NODE_RE = re.compile(
    r"^(?P<id>node\d+) -- (?P<desc>.*) -- forward_compute_time=(?P<fwd>[^,]+), "
    r"backward_compute_time=(?P<bwd>[^,]+), activation_size=(?P<act>\[[^\]]*\]|[^,]+), "
    r"parameter_size=(?P<param>\S+)\s*$"
)
_EDGE_RE = re.compile(r"^\t(?P<src>node\d+) -- (?P<dst>node\d+)\s*$")
_INPUT_RE = re.compile(r"^Input\d*$")


@dataclass(frozen=True)
class PipeDreamNode:
    """One node line of a ``graph.txt``.

    Attributes:
        node_id: PipeDream node name, e.g. ``node12``.
        desc: the layer's ``repr`` as PipeDream printed it.
        fwd_ms: forward compute time, milliseconds.
        bwd_ms: backward compute time, milliseconds.
        act_bytes: output activation bytes (all outputs summed).
        param_bytes: parameter bytes.
    """

    node_id: str
    desc: str
    fwd_ms: float
    bwd_ms: float
    act_bytes: float
    param_bytes: float

    @property
    def number(self) -> int:
        """The numeric part of ``node_id`` (used to break topological ties)."""
        return int(self.node_id[4:])

    @property
    def is_input(self) -> bool:
        """True for model inputs (``Input``, ``Input0``, ...)."""
        return bool(_INPUT_RE.match(self.desc.strip()))

    @property
    def op(self) -> str:
        """Operation name: the repr up to its first parenthesis (``Conv2d``), ``placeholder`` for inputs."""
        if self.is_input:
            return "placeholder"
        return self.desc.split("(", 1)[0].strip() or "unknown"


def _number(text: str, field: str, where: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise ProfileError(f"{where}: field {field} has non-numeric value {shown(text)}") from None
    if not 0 <= value <= MAX_BYTES:  # NaN, infinite, negative or absurd
        raise ProfileError(
            f"{where}: field {field} must be a finite number from 0 to 2**60, got {shown(text)}"
        )
    return value


def _activation(text: str, where: str) -> float:
    text = text.strip()
    if text.startswith("["):
        parts = [p for p in text[1:-1].split(";") if p.strip()]
        return sum(_number(p.strip(), "activation_size", where) for p in parts)
    return _number(text, "activation_size", where)


def parse_graph_txt(
    text: str, source: str = "graph.txt"
) -> tuple[list[PipeDreamNode], list[tuple[str, str]]]:
    """Parse the text of a PipeDream ``graph.txt``.

    Args:
        text: the file's content.
        source: file name used in error messages.

    Returns:
        The nodes in file order and the edges ``(src, dst)`` in file order.

    Raises:
        ProfileError: a line matches neither the node nor the edge format, a node is defined
            twice, an edge names an unknown node, a node has no edge at all (truncated file)
            or the graph is empty.
    """
    nodes: dict[str, PipeDreamNode] = {}
    edges: list[tuple[str, str]] = []
    for lineno, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        where = f"{source}:{lineno}"
        edge = _EDGE_RE.match(line)
        if edge:
            edges.append((edge["src"], edge["dst"]))
            continue
        m = _NODE_RE.match(line)
        if m is None:
            raise ProfileError(
                f"{where}: not a PipeDream node or edge line ({line[:60]!r}); "
                "expected 'nodeN -- <layer> -- forward_compute_time=..., ...' or '\\tnodeA -- nodeB'"
            )
        if m["id"] in nodes:
            raise ProfileError(f"{where}: node {m['id']} is defined twice")
        nodes[m["id"]] = PipeDreamNode(
            m["id"],
            m["desc"],
            _number(m["fwd"], "forward_compute_time", where),
            _number(m["bwd"], "backward_compute_time", where),
            _activation(m["act"], where),
            _number(m["param"], "parameter_size", where),
        )
    if not nodes:
        raise ProfileError(f"{source}: no PipeDream nodes found (empty or truncated file?)")
    for src, dst in edges:
        for end in (src, dst):
            if end not in nodes:
                raise ProfileError(
                    f"{source}: edge {src} -> {dst} names undefined node {end} (truncated file?)"
                )
    linked = {end for edge in edges for end in edge}
    isolated = [n for n in nodes if n not in linked]
    if len(nodes) > 1 and isolated:
        raise ProfileError(
            f"{source}: node {isolated[0]} has no edges ({len(isolated)} such nodes); "
            "the file looks truncated: re-copy it"
        )
    return list(nodes.values()), edges


def _order(nodes: list[PipeDreamNode], edges: list[tuple[str, str]], source: str) -> list[str]:
    dag = nx.DiGraph()
    by_id = {n.node_id: n for n in nodes}
    dag.add_nodes_from(by_id)
    dag.add_edges_from(edges)
    if not nx.is_directed_acyclic_graph(dag):
        cycle = nx.find_cycle(dag)
        raise ProfileError(
            f"{source}: the graph has a cycle through {cycle[0][0]}; a profile must be a DAG"
        )

    def key(node_id: str) -> tuple[int, int]:
        node = by_id[node_id]
        return (0 if node.is_input else 1, node.number)

    return list(nx.lexicographical_topological_sort(dag, key=key))


def _rows(
    nodes: list[PipeDreamNode], edges: list[tuple[str, str]], source: str
) -> list[dict[str, Any]]:
    """The profile rows of a parsed graph: one per node in a topological order, then ``output``
    reading the sinks."""
    by_id = {n.node_id: n for n in nodes}
    preds: dict[str, list[str]] = {n: [] for n in by_id}
    succs: dict[str, int] = {n: 0 for n in by_id}
    for src, dst in edges:
        if src not in preds[dst]:
            preds[dst].append(src)
        succs[src] += 1
    order = _order(nodes, edges, source)
    rank = {n: i for i, n in enumerate(order)}
    rows = []
    for node_id in order:
        node = by_id[node_id]
        act = round(node.act_bytes)
        param = round(node.param_bytes)
        rows.append(
            {
                "layer": node_id,
                "op": node.op,
                "inputs": ";".join(sorted(preds[node_id], key=rank.__getitem__)),
                "fwd_ms": node.fwd_ms,
                "bwd_ms": node.bwd_ms,
                "act_bytes": act,
                "saved_bytes": act,
                "param_bytes": param,
                "buffer_bytes": 0,
                "mem_per_mb_bytes": act + param,
                "peak_bytes": 0,
                "flops": 0.0,
            }
        )
    sinks = [n for n in order if succs[n] == 0]
    rows.append(
        {
            **{c: 0 for c in COLUMNS},
            "layer": "output",
            "op": "output",
            "inputs": ";".join(sinks),
            "fwd_ms": 0.0,
            "bwd_ms": 0.0,
            "flops": 0.0,
        }
    )
    return rows


def import_pipedream(
    path: str | os.PathLike[str], batch_size: int = 64, device_type: str = "unknown GPU"
) -> Profile:
    """Read a PipeDream ``graph.txt`` as a hetpipe :class:`Profile`.

    ``saved_bytes`` (unknown to PipeDream) is taken as the output activation, which is what
    PipeDream's own memory model stashes; ``mem_per_mb_bytes`` = saved + one weight version.

    Args:
        path: the ``graph.txt`` file.
        batch_size: minibatch size it was profiled with (PipeDream's image models use 64).
        device_type: GPU type it was measured on, stored in the metadata.

    Returns:
        A profile with ``placeholder`` rows for the inputs, one row per node, and an ``output`` row.

    Raises:
        ProfileError: the file is unreadable or malformed.
    """
    p = Path(path)
    text = read_text(p, "PipeDream graph", ProfileError)
    nodes, edges = parse_graph_txt(text, str(p))
    rows = _rows(nodes, edges, str(p))
    table = check_table(pd.DataFrame(rows, columns=list(COLUMNS)), str(p))
    meta = ProfileMeta(
        model=p.parent.name if p.name == "graph.txt" else p.stem,
        device_type=device_type,
        batch_size=batch_size,
        source="pipedream",
        extra={"file": str(p), "nodes": len(nodes), "edges": len(edges)},
    )
    log.info("imported %s: %d nodes, %d edges", p, len(nodes), len(edges))
    return Profile(table, meta)
