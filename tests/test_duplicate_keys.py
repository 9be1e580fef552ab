"""A key written twice in one mapping of any YAML/JSON input is refused (the parsers would keep
the last value silently): one line naming the file, the line and the key; exit 2 from the CLI."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from hetpipe.cli import app
from planner.cluster import load_cluster
from planner.costmodel import load_links
from planner.plan_file import load_plan, load_plan_or_cluster
from profiler.errors import ConfigError, PlanError
from profiler.inputs import load_document

CLUSTER = """name: t
nodes:
  - {name: A, gpu: TITAN V, count: 2}
  - name: B
    gpu: TITAN V
    count: 1
    count: 4
"""


def test_a_cluster_with_a_key_twice_is_refused_naming_line_and_key(tmp_path: Path) -> None:
    path = tmp_path / "cluster.yaml"
    path.write_text(CLUSTER)
    with pytest.raises(ConfigError) as info:
        load_cluster(path)
    msg = str(info.value)
    assert msg.startswith(f"{path}: line 7: key 'count' is written twice") and "\n" not in msg
    assert "keep one of them" in msg


@pytest.mark.parametrize("suffix", [".yaml", ".json"])
def test_a_plan_file_with_a_key_twice_is_refused(tmp_path: Path, suffix: str) -> None:
    path = tmp_path / f"plan{suffix}"
    text = '{"version": 1,\n "model": "mlp",\n "model": "resnet"}\n'
    path.write_text(text)
    with pytest.raises(PlanError, match=r"line 3: key 'model' is written twice"):
        load_plan(path)
    with pytest.raises(ConfigError, match=r"line 3: key 'model' is written twice"):
        load_plan_or_cluster(path)


def test_a_links_file_with_a_key_twice_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "links.yaml"
    path.write_text("intra_node: {bandwidth: 12GB/s, bandwidth: 1GB/s}\n")
    with pytest.raises(ConfigError, match=r"line 1: key 'bandwidth' is written twice"):
        load_links(path)


def test_yaml_merge_keys_may_still_be_overridden(tmp_path: Path) -> None:
    path = tmp_path / "doc.yaml"
    path.write_text("base: &b {gpu: TITAN V, count: 2}\nnode: {<<: *b, count: 1}\n")
    doc = load_document(path, "test file", ConfigError)
    assert doc == {"base": {"gpu": "TITAN V", "count": 2}, "node": {"gpu": "TITAN V", "count": 1}}


def test_the_cli_exits_2_with_the_one_line(tmp_path: Path) -> None:
    path = tmp_path / "cluster.yaml"
    path.write_text(CLUSTER)
    res = CliRunner().invoke(app, ["plan", str(path), "--model", "mlp"])
    assert res.exit_code == 2
    assert "key 'count' is written twice" in res.output and "Traceback" not in res.output
