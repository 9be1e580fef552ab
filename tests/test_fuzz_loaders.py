"""Property tests of every input-file loader: for ANY bytes, a loader returns a value or raises
the project's one-line error (a :class:`HetPipeError`), never another exception or a crash.

Inputs are random bytes, random edits of valid files (bytes flipped, cut, spliced), and valid
documents with one value replaced by an arbitrary one (wrong types, NaN, huge numbers, control
characters, deep lists). Each loader gets 100 examples per property; the whole module takes seconds.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from hetpipe.cli import app
from planner.cluster import load_cluster
from planner.costmodel import load_links
from planner.plan_file import load_plan
from profiler.errors import HetPipeError
from profiler.pipedream import import_pipedream
from profiler.table import load_profile
from tests.conftest import EXAMPLES
from tests.planner.test_plan_validation import good_plan
from tests.profiler.test_table import small_profile

FUZZ = settings(
    max_examples=100,
    deadline=None,
    derandomize=True,  # the same examples every run: a failure is reproducible
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)

GRAPH_TXT = (
    "node1 -- Input0 -- forward_compute_time=0.000, backward_compute_time=0.000, "
    "activation_size=602112.0, parameter_size=0.000\n"
    "node2 -- Conv2d(3, 64, kernel_size=(3, 3)) -- forward_compute_time=1.5, "
    "backward_compute_time=2.5, activation_size=[1024.0; 2048.0], parameter_size=7168.000\n"
    "node3 -- ReLU() -- forward_compute_time=0.1, backward_compute_time=0.2, "
    "activation_size=1024.0, parameter_size=0.000\n"
    "\tnode1 -- node2\n\tnode2 -- node3\n"
)
LINKS_YAML = (
    "links:\n  intra_node: {bandwidth: 2.1e9, latency: 4.2e-05}\n  inter_node: {bandwidth: 1GB/s}\n"
)


def _valid_files(tmp: Path) -> dict[str, tuple[Path, Callable[[Path], object]]]:
    """One valid file per loader (written once), with the loader to call on it."""
    files: dict[str, tuple[Path, Callable[[Path], object]]] = {}
    files["cluster"] = (EXAMPLES / "emulated_cluster.yaml", load_cluster)
    files["plan_yaml"] = (good_plan().save(tmp / "plan.yaml"), load_plan)
    files["plan_json"] = (good_plan().save(tmp / "plan.json"), load_plan)
    files["profile"] = (small_profile().save(tmp / "profile.csv"), load_profile)
    (tmp / "graph.txt").write_text(GRAPH_TXT)
    files["pipedream"] = (tmp / "graph.txt", import_pipedream)
    (tmp / "links.yaml").write_text(LINKS_YAML)
    files["links"] = (tmp / "links.yaml", load_links)
    return files


@pytest.fixture(scope="module")
def valid(
    tmp_path_factory: pytest.TempPathFactory,
) -> dict[str, tuple[Path, Callable[[Path], object]]]:
    return _valid_files(tmp_path_factory.mktemp("valid"))


def _loads_or_one_line(load: Callable[[Path], object], path: Path, data: bytes) -> None:
    path.write_bytes(data)
    try:
        load(path)
    except HetPipeError as exc:
        message = str(exc)
        assert message.startswith(str(path)), message
        assert "\n" not in message and "\r" not in message, message
        assert len(message) < 2_000, message[:200]


LOADERS = ["cluster", "plan_yaml", "plan_json", "profile", "pipedream", "links"]


@st.composite
def _edited(draw: st.DrawFn, original: bytes) -> bytes:
    """``original`` with a few random edits: flip, delete, insert, cut, duplicate a span."""
    data = bytearray(original)
    for _ in range(draw(st.integers(1, 4))):
        kind = draw(st.sampled_from(["flip", "delete", "insert", "cut", "repeat"]))
        at = draw(st.integers(0, max(0, len(data) - 1)))
        if kind == "flip" and data:
            data[at] = draw(st.integers(0, 255))
        elif kind == "delete":
            del data[at : at + draw(st.integers(1, 40))]
        elif kind == "insert":
            data[at:at] = draw(st.binary(min_size=1, max_size=20))
        elif kind == "cut":
            del data[at:]
        else:
            data[at:at] = data[at : at + draw(st.integers(1, 200))] * draw(st.integers(2, 50))
    return bytes(data)


@pytest.mark.parametrize("name", LOADERS)
def test_random_bytes(valid: dict[str, Any], tmp_path: Path, name: str) -> None:
    _, load = valid[name]
    path = tmp_path / Path(valid[name][0]).name

    @FUZZ
    @given(st.binary(max_size=2000))
    def check(data: bytes) -> None:
        _loads_or_one_line(load, path, data)

    check()


@pytest.mark.parametrize("name", LOADERS)
def test_edited_valid_file(valid: dict[str, Any], tmp_path: Path, name: str) -> None:
    source, load = valid[name]
    original = Path(source).read_bytes()
    path = tmp_path / Path(source).name

    @FUZZ
    @given(_edited(original))
    def check(data: bytes) -> None:
        _loads_or_one_line(load, path, data)

    check()


# a value of any kind a YAML/JSON document can hold, nasty ones favoured
_ODD = st.one_of(
    st.sampled_from([None, True, -1, 0, 1e400, -1e400, float("nan"), 2**70, -(2**70), "", "1e400GiB"]),
    st.integers(),
    st.floats(),
    st.text(max_size=30),
    st.text(alphabet=st.sampled_from("\n\r\t\x1b[]/\x00\u2028ab"), max_size=10),
    st.recursive(st.integers(-3, 3) | st.text(max_size=3), lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=3), c, max_size=3), max_leaves=8),
)  # fmt: skip


def _paths(doc: object, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    """Every key/index path inside a parsed document."""
    out = [prefix]
    if isinstance(doc, dict):
        for k, v in doc.items():
            out += _paths(v, (*prefix, k))
    elif isinstance(doc, list):
        for i, v in enumerate(doc):
            out += _paths(v, (*prefix, i))
    return out


@pytest.mark.parametrize("name", ["cluster", "plan_yaml", "plan_json", "links"])
def test_one_value_replaced(valid: dict[str, Any], tmp_path: Path, name: str) -> None:
    source, load = valid[name]
    original = yaml.safe_load(Path(source).read_text())
    paths = [p for p in _paths(original) if p]
    path = tmp_path / Path(source).name

    @FUZZ
    @given(st.sampled_from(paths), _ODD, st.booleans())
    def check(where: tuple[Any, ...], value: object, drop: bool) -> None:
        doc = json.loads(json.dumps(original))
        target = doc
        for key in where[:-1]:
            target = target[key]
        if drop:
            del target[where[-1]]
        else:
            target[where[-1]] = value
        if path.suffix == ".json":
            text = json.dumps(doc)
        else:
            text = yaml.safe_dump(doc, allow_unicode=True)
        _loads_or_one_line(load, path, text.encode("utf-8", "surrogatepass"))

    check()


NASTY_SCALARS = [
    "9" * 5000,  # beyond Python's 4,300-digit int conversion limit
    "0x" + "f" * 5000,
    "2001-13-45",  # a YAML timestamp with month 13
    "2001-01-01 12:00:00",  # a valid timestamp: a datetime where a number is expected
    "!!binary '@@@'",
    "!!python/object:os.system x",
    "!!set {a, b}",
    "*nowhere",
    "1e400",
    "-.inf",
    "!!float 1e999999",
]


@pytest.mark.parametrize("token", NASTY_SCALARS, ids=range(len(NASTY_SCALARS)))
@pytest.mark.parametrize("name", ["cluster", "plan_yaml", "plan_json", "links"])
def test_nasty_scalars(valid: dict[str, Any], tmp_path: Path, name: str, token: str) -> None:
    source, load = valid[name]
    text = Path(source).read_text()
    if name == "plan_json":
        text = text.rstrip()[:-1] + f', "zz": {token}}}'
    else:
        text += f"\nzz: {token}\n"
    _loads_or_one_line(load, tmp_path / Path(source).name, text.encode())


def test_cli_bad_input_is_exit_2_and_one_stderr_line(tmp_path: Path) -> None:
    """Exit code 2, exactly one line on stderr, nothing on stdout: once in a real process (the
    console writes to a terminal-less pipe), then for more commands through typer's runner."""
    import subprocess
    import sys

    bad = tmp_path / "bad.yaml"
    bad.write_bytes(b'nodes:\n  - {name: "\\e[31m[/path:553]", gpu: T4, count: 1}\n')
    done = subprocess.run(
        [sys.executable, "-m", "hetpipe", "cluster", str(bad)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert (done.returncode, done.stdout) == (2, ""), done.stderr
    assert done.stderr.splitlines() == [
        f"error: {bad}: nodes[0].name: '\\x1b[31m[/path:553]' cannot be a name: it is not "
        "printable text (a newline, tab or terminal escape); rename it"
    ]
    deep = tmp_path / "deep.yaml"
    deep.write_text("[" * 100_000)
    binary = tmp_path / "binary.json"
    binary.write_bytes(bytes(range(256)))
    for command in (
        ["simulate", str(deep)],
        ["run", str(binary)],
        ["simulate", str(tmp_path)],
        ["plan", str(bad)],
        ["plan", str(EXAMPLES / "paper_cluster.yaml"), "--profiles", str(binary)],
    ):
        result = CliRunner().invoke(app, command)
        assert (result.exit_code, result.stdout) == (2, ""), (command, result.output)
        assert len(result.stderr.splitlines()) == 1, (command, result.stderr)


def test_error_printer_escapes_markup_and_control_characters() -> None:
    """A gloo message with '[/path:553]' once crashed the printer; now it is printed literally."""
    from hetpipe._common import handle_errors

    @handle_errors
    def boom() -> None:
        raise HetPipeError("rank 3 failed: [/path/gloo.cc:553] Connection closed\n\x1b[31mby peer")

    CliRunner().invoke(app, ["--help"])  # the app imports; the printer is exercised below
    import typer

    runner_app = typer.Typer()
    runner_app.command()(boom)
    result = CliRunner().invoke(runner_app, [])
    assert result.exit_code == 2
    lines = result.output.strip().splitlines()
    assert lines == [
        "error: rank 3 failed: [/path/gloo.cc:553] Connection closed | \\x1b[31mby peer"
    ], result.output


def test_file_oserror_is_one_line_and_other_oserrors_keep_their_traceback() -> None:
    import typer

    from hetpipe._common import handle_errors, one_line

    @handle_errors
    def write() -> None:
        raise PermissionError(13, "Permission denied", "/out/plan.yaml")

    @handle_errors
    def connect() -> None:
        raise ConnectionResetError(104, "Connection reset by peer")

    runner_app = typer.Typer()
    runner_app.command()(write)
    result = CliRunner().invoke(runner_app, [])
    assert result.exit_code == 2
    assert result.output.strip() == "error: /out/plan.yaml: Permission denied"
    with pytest.raises(ConnectionResetError):
        connect()
    assert one_line("x" * 5000, limit=10) == "xxxxxxxxxx... (5000 characters)"
    assert one_line("a\r\n\n  b\u2028c\x07") == "a | b | c\\x07"
