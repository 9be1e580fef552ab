"""PipeDream graph.txt import: every shared profile, DAG edges, sums, and malformed files."""

from __future__ import annotations

import re
from pathlib import Path

import networkx as nx
import pytest

from profiler.errors import ProfileError
from profiler.pipedream import import_pipedream, parse_graph_txt
from tests.conftest import PIPEDREAM

MODELS = ["vgg16", "resnet50", "gnmt"]


def _file_facts(path: Path) -> dict[str, float]:
    """Counts and sums read straight from the text, independently of the importer."""
    lines = path.read_text().splitlines()
    nodes = [ln for ln in lines if ln.startswith("node")]
    edges = {tuple(ln.strip().split(" -- ")) for ln in lines if ln.startswith("\t")}

    def total(field: str) -> float:
        out = 0.0
        for ln in nodes:
            value = re.search(rf"{field}=(\[[^\]]*\]|[^,]+)", ln)
            assert value is not None
            out += sum(float(v) for v in value.group(1).strip("[]").split(";"))
        return out

    return {
        "nodes": len(nodes),
        "edges": len(edges),
        "fwd": total("forward_compute_time"),
        "bwd": total("backward_compute_time"),
        "act": total("activation_size"),
        "param": total("parameter_size"),
        "inputs": sum(1 for ln in nodes if re.match(r"node\d+ -- Input\d* -- ", ln)),
    }


@pytest.mark.parametrize("model", MODELS)
def test_import_matches_file(model: str) -> None:
    path = PIPEDREAM / model / "graph.txt"
    facts = _file_facts(path)
    prof = import_pipedream(path)
    t = prof.table
    assert len(t) == facts["nodes"] + 1  # + the output row
    assert t["fwd_ms"].sum() == pytest.approx(facts["fwd"], rel=1e-12)
    assert t["bwd_ms"].sum() == pytest.approx(facts["bwd"], rel=1e-12)
    assert t["act_bytes"].sum() == pytest.approx(facts["act"], abs=facts["nodes"])
    assert t["param_bytes"].sum() == pytest.approx(facts["param"], abs=facts["nodes"])
    # DAG edges: one per (producer, consumer) pair of the file, plus output <- sinks.
    pairs = {(src, row.layer) for row in t.itertuples() for src in row.inputs.split(";") if src}
    sinks = set(t["inputs"].iloc[-1].split(";"))
    assert len(pairs) - len(sinks) == facts["edges"]
    # inputs first (placeholders), output last, topological order
    n_in = int(facts["inputs"])
    assert list(t["op"][:n_in]) == ["placeholder"] * n_in
    assert t["op"].iloc[-1] == "output"
    dag = nx.DiGraph(list(pairs))
    assert nx.is_directed_acyclic_graph(dag)
    position = {name: i for i, name in enumerate(t["layer"])}
    assert all(position[a] < position[b] for a, b in pairs)
    assert prof.meta.source == "pipedream"
    assert prof.meta.batch_size == 64


def test_cut_bytes_count_skip_connections() -> None:
    prof = import_pipedream(PIPEDREAM / "resnet50" / "graph.txt")
    cuts = prof.cut_bytes()
    assert len(cuts) == len(prof.table) + 1
    assert cuts[0] == 0 and cuts[-1] == 0
    acts = dict(zip(prof.table["layer"], prof.table["act_bytes"], strict=True))
    # somewhere inside a residual block two tensors cross: more than any single output
    assert max(cuts) > max(acts.values())


def test_order_is_deterministic() -> None:
    path = PIPEDREAM / "gnmt" / "graph.txt"
    assert import_pipedream(path).layers == import_pipedream(path).layers


def test_tuple_activation_sizes_are_summed() -> None:
    text = (
        "node1 -- Input0 -- forward_compute_time=0.000, backward_compute_time=0.000, "
        "activation_size=8.0, parameter_size=0.000\n"
        "node2 -- LSTM(2, 2) -- forward_compute_time=1.5, backward_compute_time=2.5, "
        "activation_size=[6.0; 2.0; 2.0], parameter_size=4.000\n"
        "\tnode1 -- node2\n"
    )
    nodes, edges = parse_graph_txt(text)
    assert [n.act_bytes for n in nodes] == [8.0, 10.0]
    assert nodes[1].op == "LSTM" and nodes[0].op == "placeholder"
    assert edges == [("node1", "node2")]


def _write(tmp_path: Path, content: bytes) -> Path:
    path = tmp_path / "graph.txt"
    path.write_bytes(content)
    return path


@pytest.mark.parametrize(
    "content, message",
    [
        (b"", "no PipeDream nodes"),
        (b"\x00\xff\xfe garbage \x89PNG", "cannot read"),
        (b"hello world\n", "not a PipeDream node or edge line"),
        (
            b"node1 -- Input0 -- forward_compute_time=abc, backward_compute_time=0, "
            b"activation_size=0, parameter_size=0\n",
            "non-numeric",
        ),
        (
            b"node1 -- Input0 -- forward_compute_time=0, backward_compute_time=0, "
            b"activation_size=0, parameter_size=0\n\tnode1 -- node9\n",
            "undefined node node9",
        ),
        (
            b"node1 -- A -- forward_compute_time=0, backward_compute_time=0, activation_size=0, "
            b"parameter_size=0\nnode2 -- B -- forward_compute_time=0, backward_compute_time=0, "
            b"activation_size=0, parameter_size=0\n\tnode1 -- node2\n\tnode2 -- node1\n",
            "cycle",
        ),
    ],
)
def test_malformed_files_raise_one_line(tmp_path: Path, content: bytes, message: str) -> None:
    with pytest.raises(ProfileError, match=message) as info:
        import_pipedream(_write(tmp_path, content))
    assert "\n" not in str(info.value)


def test_truncated_real_file_raises(tmp_path: Path) -> None:
    text = (PIPEDREAM / "vgg16" / "graph.txt").read_bytes()
    with pytest.raises(ProfileError):
        import_pipedream(_write(tmp_path, text[: len(text) // 3]))


def test_missing_file_raises(tmp_path: Path) -> None:
    with pytest.raises(ProfileError, match="cannot read"):
        import_pipedream(tmp_path / "nope.txt")


@pytest.mark.parametrize("keep_lines", [5, 41, 60])
def test_truncated_at_line_boundary_raises(tmp_path: Path, keep_lines: int) -> None:
    lines = (PIPEDREAM / "vgg16" / "graph.txt").read_text().splitlines(keepends=True)
    with pytest.raises(ProfileError, match="truncated"):
        import_pipedream(_write(tmp_path, "".join(lines[:keep_lines]).encode()))
