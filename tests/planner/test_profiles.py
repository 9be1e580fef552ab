"""Cached measured CPU profiles (deterministic plans for emulated clusters) and the Nm choice."""

from __future__ import annotations

from pathlib import Path

import pytest

import profiler.measure
from planner import profiles as prof_mod
from planner.cluster import load_cluster
from planner.planner import NM_TOLERANCE, _stable_best_nm
from tests.conftest import EXAMPLES


@pytest.fixture()
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv(prof_mod.CACHE_ENV, str(tmp_path))
    return tmp_path


def test_measured_cpu_profile_is_cached_and_reused(
    cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cluster = load_cluster(EXAMPLES / "emulated_cluster.yaml")
    first, prov1, _, _ = prof_mod.resolve_profiles(cluster, None, "mlp", 16)
    files = list((cache / "profiles").glob("cpu-mlp-b16-*.csv"))
    assert len(files) == 1

    def no_measuring(*args: object, **kwargs: object) -> None:
        raise AssertionError("the cached profile should have been used")

    monkeypatch.setattr(profiler.measure, "measure_profile", no_measuring)
    second, prov2, _, _ = prof_mod.resolve_profiles(cluster, None, "mlp", 16)
    assert prov1 == prov2
    for gpu_type, p in first.items():
        assert p.table[["fwd_ms", "bwd_ms"]].equals(second[gpu_type].table[["fwd_ms", "bwd_ms"]])


def test_other_batch_size_is_a_different_cache_entry(cache: Path) -> None:
    a = prof_mod._cache_path("mlp", 16)
    b = prof_mod._cache_path("mlp", 32)
    assert a is not None and b is not None and a != b


def test_unreadable_cache_file_is_measured_again(cache: Path) -> None:
    path = prof_mod._cache_path("mlp", 8)
    assert path is not None
    path.parent.mkdir(parents=True)
    path.write_text("not a profile\n")
    prof, src = prof_mod._cpu_profile("mlp", 8)
    assert src == "cpu measured" and len(prof.table) > 0
    assert prof_mod.load_profile(path).meta.model == "mlp"  # rewritten with the measurement


@pytest.mark.parametrize("value", ["off", "0", ""])
def test_cache_can_be_switched_off(value: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(prof_mod.CACHE_ENV, value)
    assert prof_mod.profile_cache_dir() is None
    assert prof_mod._cache_path("mlp", 8) is None


def test_default_cache_follows_xdg(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv(prof_mod.CACHE_ENV, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert prof_mod.profile_cache_dir() == tmp_path / "hetpipe"


def test_stable_best_nm_prefers_the_smallest_nm_within_tolerance() -> None:
    top = 100.0
    near = top * (1 - NM_TOLERANCE / 2)
    assert _stable_best_nm([(near, -2), (top, -8), (50.0, -1)]) == 2
    assert _stable_best_nm([(top * (1 - 2 * NM_TOLERANCE), -2), (top, -8)]) == 8
    assert _stable_best_nm([(10.0, -1)]) == 1
