"""`hetpipe profile`: the four ways to get a profile, and one-line errors for bad input."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest
from typer.testing import CliRunner

from hetpipe.cli import app
from profiler.table import load_profile
from tests.conftest import PIPEDREAM


def _run(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(app, ["profile", *args])
    return result.exit_code, result.output


def _files(folder: Path) -> list[Path]:
    return sorted(p for p in folder.rglob("*") if p.is_file()) if folder.exists() else []


def test_measure_writes_a_loadable_profile(tmp_path: Path) -> None:
    code, out = _run(
        "--model", "mlp", "-b", "4", "--repeats", "1", "--warmup", "0", "-o", str(tmp_path)
    )
    assert code == 0, out
    (path,) = _files(tmp_path)
    assert path.name == "mlp_cpu_b4.csv"
    prof = load_profile(path)
    assert prof.meta.batch_size == 4 and prof.meta.source == "measured"


def test_analytic_for_several_types_without_a_gpu(tmp_path: Path) -> None:
    code, out = _run(
        "--model",
        "vgg19",
        "--analytic",
        "--device-type",
        "TITAN V",
        "--device-type",
        "Quadro P4000",
        "-o",
        str(tmp_path),
    )
    assert code == 0, out
    names = [p.name for p in _files(tmp_path)]
    assert names == ["vgg19_quadro-p4000_b32.csv", "vgg19_titan-v_b32.csv"]
    assert load_profile(tmp_path / names[1]).meta.device_type == "TITAN V"


def test_import_pipedream_and_scale(tmp_path: Path) -> None:
    out_csv = tmp_path / "vgg16.csv"
    code, out = _run(
        "--import-pipedream",
        str(PIPEDREAM / "vgg16" / "graph.txt"),
        "--device-type",
        "TITAN V",
        "-o",
        str(out_csv),
    )
    assert code == 0, out
    assert load_profile(out_csv).meta.source == "pipedream"
    code, out = _run(
        "--scale", str(out_csv), "--device-type", "GeForce RTX 2060", "-o", str(tmp_path / "scaled")
    )
    assert code == 0, out
    (scaled,) = _files(tmp_path / "scaled")
    assert load_profile(scaled).meta.device_type == "GeForce RTX 2060"


@pytest.fixture()
def factories(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    pkg = tmp_path / "hp_user_models.py"
    pkg.write_text(
        textwrap.dedent(
            """
        def boom(batch_size):
            raise RuntimeError("kaboom")

        def not_a_module(batch_size):
            return 42
        """
        )
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    return "hp_user_models"


def _bad_cases(tmp_path: Path, mod: str) -> list[tuple[list[str], str]]:
    garbage = tmp_path / "garbage.bin"
    garbage.write_bytes(b"\x00\x89PNG\xff\xfe" * 50)
    graph = (PIPEDREAM / "resnet50" / "graph.txt").read_text()
    truncated = tmp_path / "truncated.txt"
    truncated.write_text(graph[: len(graph) // 2])
    prof = tmp_path / "ok.csv"
    code, _ = _run("--import-pipedream", str(PIPEDREAM / "vgg16" / "graph.txt"), "-o", str(prof))
    assert code == 0
    text = prof.read_text()
    half = tmp_path / "half.csv"
    half.write_text(text[: len(text) // 2])
    return [
        (["--model", "no_such_model"], "unknown model"),
        (["--model", f"{mod}:boom"], "kaboom"),
        (["--model", f"{mod}:not_a_module"], "returned int"),
        (["--model", "mlp", "--batch-size", "0"], "batch-size"),
        (["--model", "mlp", "--batch-size", "-3"], "batch-size"),
        (["--model", "mlp", "--device", "cuda:3"], "does not exist"),
        (["--model", "mlp", "--device", "tpu"], "tpu"),
        (["--model", "mlp", "--analytic", "--device-type", "TPU v9"], "unknown GPU type"),
        (["--import-pipedream", str(tmp_path / "missing.txt")], "cannot read"),
        (["--import-pipedream", str(garbage)], "garbage.bin"),
        (["--import-pipedream", str(truncated)], "truncated.txt"),
        (["--scale", str(garbage), "--device-type", "TITAN V"], "garbage.bin"),
        (["--scale", str(half), "--device-type", "TITAN V"], "half.csv"),
        (["--scale", str(tmp_path), "--device-type", "TITAN V"], "cannot read"),
        (
            ["--model", "mlp", "--analytic", "--device-type", "TITAN V", "--calibrate", str(half)],
            "half.csv",
        ),
        (["--model", "mlp", "--analytic", "--links"], "choose one"),
        (["--links", "--peer", "no-port"], "give ADDR:PORT"),
    ]


def test_bad_input_is_one_line_exit_2_and_no_file(tmp_path: Path, factories: str) -> None:
    for args, needle in _bad_cases(tmp_path, factories):
        out_dir = tmp_path / "out"
        code, out = _run(*args, "-o", str(out_dir))
        lines = [ln for ln in out.splitlines() if ln.strip()]
        assert code == 2, (args, out)
        assert len(lines) == 1 and lines[0].startswith("error:"), (args, out)
        assert needle in out.replace("\n", " "), (args, out)
        assert "Traceback" not in out
        assert _files(out_dir) == [], args
