"""cluster.yaml parsing: the examples load; bad input is one clear line and exit code 2."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from typer.testing import CliRunner

from hetpipe.cli import app
from planner.cluster import load_cluster, parse_cluster
from profiler.catalog import CATALOG, lookup_gpu
from profiler.errors import ConfigError
from profiler.units import parse_bandwidth, parse_bytes, parse_seconds
from tests.conftest import EXAMPLES

GOOD = """
name: t
nodes:
  - {name: a, gpu: TITAN V, count: 2}
  - {name: b, gpu: Quadro P4000, count: 1, memory: 4GiB}
links:
  intra_node: {bandwidth: 10GB/s, latency: 5us}
  inter_node: {bandwidth: 56Gbit/s, latency: 2us}
"""


def test_paper_cluster_matches_table_1() -> None:
    c = load_cluster(EXAMPLES / "paper_cluster.yaml")
    assert [n.gpu_type for n in c.nodes] == [
        "TITAN V",
        "TITAN RTX",
        "GeForce RTX 2060",
        "Quadro P4000",
    ]
    assert [n.memory_bytes // 2**30 for n in c.nodes] == [12, 24, 6, 8]
    assert len(c.devices) == 16
    assert not c.emulated
    a, b = c.devices[0], c.devices[5]
    assert c.link(a, c.devices[1]) is c.intra_node
    assert c.link(a, b) is c.inter_node


def test_emulated_cluster_is_runnable_here() -> None:
    c = load_cluster(EXAMPLES / "emulated_cluster.yaml")
    assert c.emulated
    demand = sum(n.emulation.speed * n.count for n in c.nodes if n.emulation)
    assert demand < 2 / 2.5  # well under the 2 cores, so pacing stays accurate
    speeds = {n.letter: n.emulation.speed for n in c.nodes if n.emulation}
    assert speeds["R"] > speeds["V"] > speeds["G"] > speeds["Q"]


def test_good_cluster_and_round_trip(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text(GOOD)
    c = load_cluster(path)
    assert c.nodes[1].memory_bytes == 4 * 2**30  # override beats the catalog
    assert c.inter_node.bandwidth_bps == pytest.approx(7e9)
    assert c.inter_node.latency_s == pytest.approx(2e-6)
    assert parse_cluster(c.to_dict()) == parse_cluster(c.to_dict())
    assert parse_cluster(c.to_dict()).nodes == c.nodes


def test_catalog_has_the_required_types() -> None:
    for name in [
        "TITAN V",
        "TITAN RTX",
        "GeForce RTX 2060",
        "Quadro P4000",
        "V100",
        "T4",
        "A100",
        "H100",
        "K80",
        "P100",
    ]:
        assert lookup_gpu(name).name in CATALOG
    assert lookup_gpu("titan-v").name == "TITAN V"
    assert lookup_gpu("rtx 2060").name == "GeForce RTX 2060"


def test_units() -> None:
    assert parse_bytes("12GiB") == 12 * 2**30
    assert parse_bytes("1.5 MB") == 1_500_000
    assert parse_bandwidth("56Gbit/s") == pytest.approx(7e9)
    assert parse_seconds("250us") == pytest.approx(250e-6)
    with pytest.raises(ValueError, match="unknown unit"):
        parse_bytes("12 parsecs")


BAD = [
    # (file content, expected fragment of the one-line message)
    ("nodes: [", "YAML syntax error at line"),
    ("- a\n- b\n", "must be a mapping"),
    ("42\n", "must be a mapping"),
    ("name: x\n", "nodes: Field required (add it)"),
    ("nodes: []\n", "nodes: List should have at least 1 item"),
    ("nodes:\n  - {gpu: TITAN V, count: 1}\n", "nodes[0].name: Field required"),
    ("nodes:\n  - {name: a, count: 1}\n", "nodes[0].gpu: Field required"),
    ("nodes:\n  - {name: a, gpu: TITAN V}\n", "nodes[0].count: Field required"),
    ("nodes:\n  - {name: a, gpu: TITAN Z, count: 1}\n", "nodes[0].gpu: unknown GPU type 'TITAN Z'"),
    (
        "nodes:\n  - {name: a, gpu: TITAN V, count: -2}\n",
        "nodes[0].count: Input should be greater than or equal to 1",
    ),
    (
        "nodes:\n  - {name: a, gpu: TITAN V, count: 2.5}\n",
        "nodes[0].count: count must be a whole number",
    ),
    (
        "nodes:\n  - {name: a, gpu: TITAN V, count: 1, memory: 12 parsecs}\n",
        "nodes[0].memory: unknown unit 'parsecs'",
    ),
    (
        "nodes:\n  - {name: a, gpu: TITAN V, count: 1, memory: -1GiB}\n",
        "nodes[0].memory: cannot read '-1GiB'",
    ),
    (
        "nodes:\n  - {name: a, gpu: TITAN V, count: 1, colour: red}\n",
        "nodes[0].colour: Extra inputs are not permitted (unknown field",
    ),
    (
        "nodes:\n  - {name: a, gpu: TITAN V, count: 1}\nruntime_overhead: 5\n",
        "runtime_overhead: 5 is not a mapping (give its keys as `key: value` lines",
    ),
    (
        "nodes:\n  - {name: a, gpu: TITAN V, count: 1, emulate: [1]}\n",
        "nodes[0].emulate: [1] is not a mapping",
    ),
    (
        "nodes:\n  - 5\n",
        "nodes[0]: 5 is not a mapping",
    ),
    (
        "nodes:\n  - {name: a, gpu: TITAN V, count: 1}\nlinks:\n  inter_node: {bandwidth: 56 furlongs}\n",
        "links.inter_node.bandwidth: unknown unit 'furlongs'",
    ),
    (
        "nodes:\n  - {name: a, gpu: TITAN V, count: 1}\nlinks:\n  inter_node: {bandwidth: 0GB/s}\n",
        "links.inter_node.bandwidth: bandwidth must be positive",
    ),
    (
        "nodes:\n  - {name: a, gpu: TITAN V, count: 1}\nlinks:\n  intra_node: {bandwidth: 1GB/s, latency: 3 fortnights}\n",
        "links.intra_node.latency: unknown unit",
    ),
    (
        "nodes:\n  - {name: a, gpu: TITAN V, count: 1}\n  - {name: a, gpu: T4, count: 1}\n",
        "nodes[1].name: duplicate node name 'a'",
    ),
    (
        "nodes:\n  - {name: a, gpu: T4, count: 1, emulate: {speed: 0.2, memory: 8MiB}}\n  - {name: b, gpu: T4, count: 1}\n",
        "either every node has 'emulate:' or none",
    ),
    (
        "nodes:\n  - {name: a, gpu: T4, count: 1, emulate: {speed: 0, memory: 8MiB}}\n",
        "nodes[0].emulate.speed: Input should be greater than 0",
    ),
    (
        "nodes:\n  - {name: a, gpu: T4, count: 1, emulate: {speed: 0.2}}\n",
        "nodes[0].emulate.memory: Field required",
    ),
    # range checks: finite, positive, sane units, printable bounded names
    (
        "nodes:\n  - {name: a, gpu: TITAN V, count: 1, memory: 1e400GiB}\n",
        "nodes[0].memory: a size in bytes (e.g. 12GiB) must be a finite number, got '1e400GiB'",
    ),
    (
        "nodes:\n  - {name: a, gpu: TITAN V, count: 1, memory: 4e9TiB}\n",
        "nodes[0].memory: a size in bytes (e.g. 12GiB) must be at most 1 EiB",
    ),
    (
        "nodes:\n  - {name: a, gpu: TITAN V, count: 1}\nlinks:\n  inter_node: {bandwidth: .nan}\n",
        "links.inter_node.bandwidth: a bandwidth (e.g. 15.75GB/s or 56Gbit/s) must be a finite number, got nan",
    ),
    (
        "nodes:\n  - {name: a, gpu: TITAN V, count: 1}\nlinks:\n  intra_node: {bandwidth: .inf}\n",
        "links.intra_node.bandwidth: a bandwidth (e.g. 15.75GB/s or 56Gbit/s) must be a finite number, got inf",
    ),
    (
        "nodes:\n  - {name: a, gpu: TITAN V, count: 1}\nlinks:\n  intra_node: {bandwidth: 1GB/s, latency: -.inf}\n",
        "links.intra_node.latency: a duration (e.g. 5us or 0.2ms) must be a finite number",
    ),
    (
        "nodes:\n  - {name: a, gpu: T4, count: 1, emulate: {speed: 0.2, memory: 32GiB}}\n",
        "nodes[0].emulate.memory: 34359738368 bytes is more than the T4's own 17179869184 bytes",
    ),
    (
        "nodes:\n  - {name: a, gpu: T4, count: 1, emulate: {speed: .nan, memory: 1GiB}}\n",
        "nodes[0].emulate.speed: Input should be a finite number",
    ),
    (
        'nodes:\n  - {name: "a\\nb\\e[31m", gpu: T4, count: 1}\n',
        "nodes[0].name: 'a\\nb\\x1b[31m' cannot be a name: it is not printable text",
    ),
    (
        f"nodes:\n  - {{name: a, gpu: T4, count: 1, host: {'h' * 5000}}}\n",
        "nodes[0].host: 'hhhhhhhhhh",
    ),
    ("[" * 10_000 + "]" * 10_000, "cluster file is nested too deeply (at most 32 levels)"),
    (
        "a: &a [x, x, x, x, x, x, x, x, x, x]\nb: &b [*a, *a, *a, *a, *a, *a, *a, *a, *a, *a]\n"
        "c: &c [*b, *b, *b, *b, *b, *b, *b, *b, *b, *b]\nd: &d [*c, *c, *c, *c, *c, *c, *c, *c, *c, *c]\n"
        "e: &e [*d, *d, *d, *d, *d, *d, *d, *d, *d, *d]\nf: &f [*e, *e, *e, *e, *e, *e, *e, *e, *e, *e]\n"
        "g: &g [*f, *f, *f, *f, *f, *f, *f, *f, *f, *f]\nnodes: *g\n",
        "holds more than 2,000,000 values once its YAML aliases are expanded",
    ),
]


@pytest.mark.parametrize(("text", "fragment"), BAD, ids=[f"bad{i}" for i in range(len(BAD))])
def test_bad_cluster_is_one_clear_line(tmp_path: Path, text: str, fragment: str) -> None:
    path = tmp_path / "cluster.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as info:
        load_cluster(path)
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith(str(path))
    assert fragment in message


def test_host_echo_is_cut(tmp_path: Path) -> None:
    path = tmp_path / "cluster.yaml"
    path.write_text(BAD[-3][0])
    with pytest.raises(ConfigError) as info:
        load_cluster(path)
    assert len(str(info.value)) < 400  # the 5,000-character host is not echoed whole


@pytest.mark.parametrize(
    ("data", "fragment"),
    [
        (b"nodes:\n  - {name: \xe9, gpu: T4, count: 1}\n", "not UTF-8 text (byte 0xe9 at line 2)"),
        (bytes(range(256)), "not UTF-8 text (byte 0x80 at line 2)"),
        (b"\x00\x01\x02 binary", "YAML syntax error"),
    ],
)
def test_non_text_cluster_is_one_line(tmp_path: Path, data: bytes, fragment: str) -> None:
    path = tmp_path / "cluster.yaml"
    path.write_bytes(data)
    with pytest.raises(ConfigError, match=re.escape(fragment)):
        load_cluster(path)


def test_unreadable_cluster_is_one_line(tmp_path: Path) -> None:
    for path, why in ((tmp_path / "none.yaml", "No such file"), (tmp_path, "Is a directory")):
        result = CliRunner().invoke(app, ["cluster", str(path)])
        assert result.exit_code == 2
        lines = result.output.strip().splitlines()
        assert len(lines) == 1 and f"{path}: cannot read cluster file ({why}" in lines[0]


def test_names_with_style_tags_are_refused_and_others_shown_literally(tmp_path: Path) -> None:
    """'[/x]' in a name would crash or restyle every table that prints it; 'gpu[0]' is fine."""
    path = tmp_path / "cluster.yaml"
    path.write_text('nodes:\n  - {name: "[/path:553]", gpu: T4, count: 1}\n')
    with pytest.raises(ConfigError, match=re.escape("which the console would read as a style tag")):
        load_cluster(path)
    path.write_text(
        'name: "c [0]"\nnodes:\n  - {name: "gpu[0]", gpu: "X[1]", count: 1, memory: 1GiB}\n'
    )
    result = CliRunner().invoke(app, ["cluster", str(path)])
    assert result.exit_code == 0, result.output
    assert "gpu[0]" in result.output and "X[1]" in result.output and "c [0]" in result.output


def test_bad_cluster_through_the_cli_exits_2_without_traceback(tmp_path: Path) -> None:
    path = tmp_path / "cluster.yaml"
    path.write_text(BAD[8][0])
    result = CliRunner().invoke(app, ["cluster", str(path)])
    assert result.exit_code == 2
    assert "unknown GPU type 'TITAN Z'" in result.output
    assert "Traceback" not in result.output


def test_unknown_type_with_explicit_memory_is_accepted() -> None:
    c = parse_cluster(
        {"nodes": [{"name": "x", "gpu": "MyAccel 9000", "count": 2, "memory": "3GiB"}]}
    )
    assert c.nodes[0].memory_bytes == 3 * 2**30
    assert c.devices[1].label == "x:1"


def test_emulated_whimpy_devices_cannot_hold_the_default_model_alone() -> None:
    from hetpipe.planning import profiles_for
    from planner.planner import make_plan
    from profiler.errors import PlanError

    c = load_cluster(EXAMPLES / "emulated_cluster.yaml")
    cpu = profiles_for(c, [], "mlp", 32)
    with pytest.raises(PlanError, match=r"VW \d \((G|Q)\) cannot hold mlp even with Nm=1") as info:
        make_plan(c, cpu, model="mlp", batch_size=32, policy="np")
    # the message says which emulate.memory to raise and to what (above today's cap)
    fixes = re.findall(r"node (\w) ([\d.]+ \w+) -> ([\d.]+ \w+)", str(info.value))
    assert "raise emulate.memory" in str(info.value) and fixes, str(info.value)
    for _, old, new in fixes:
        assert parse_bytes(new.replace(" ", "")) > parse_bytes(old.replace(" ", ""))
