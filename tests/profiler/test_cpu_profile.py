"""The CPU profile an emulated cluster is planned on: measured by the front end, cached, never by the planner."""

from __future__ import annotations

from pathlib import Path

import pytest

import profiler.measure
from planner.cluster import load_cluster
from planner.profiles import resolve_profiles
from profiler import cpu_profile as cpu_mod
from profiler.errors import ModelError, ProfileError
from profiler.table import load_profile
from tests.conftest import EXAMPLES

CLUSTER = EXAMPLES / "emulated_cluster.yaml"


@pytest.fixture()
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv(cpu_mod.CACHE_ENV, str(tmp_path))
    return tmp_path


def test_measured_cpu_profile_is_cached_and_reused(
    cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cluster = load_cluster(CLUSTER)
    first, prov1, _, _ = resolve_profiles(
        cluster, cpu_mod.emulation_profiles([], "mlp", 16), "mlp", 16
    )
    files = list((cache / "profiles").glob("cpu-mlp-b16-*.csv"))
    assert len(files) == 1

    def no_measuring(*args: object, **kwargs: object) -> None:
        raise AssertionError("the cached profile should have been used")

    monkeypatch.setattr(profiler.measure, "measure_profile", no_measuring)
    second, prov2, _, _ = resolve_profiles(
        cluster, cpu_mod.emulation_profiles([], "mlp", 16), "mlp", 16
    )
    assert prov1 == prov2 and all(p.startswith("emulated: cpu measured") for p in prov1.values())
    for gpu_type, p in first.items():
        assert p.table[["fwd_ms", "bwd_ms"]].equals(second[gpu_type].table[["fwd_ms", "bwd_ms"]])


def test_the_planner_never_measures_an_emulated_clusters_profile(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Without the front end's cpu profile the planner says so; it does not run the model."""

    def no_measuring(*args: object, **kwargs: object) -> None:
        raise AssertionError("the planner measured a model")

    monkeypatch.setattr(profiler.measure, "measure_profile", no_measuring)
    with pytest.raises(ProfileError, match=r"emulated-paper.*cpu profile of 'mlp'.*emulation_pro"):
        resolve_profiles(load_cluster(CLUSTER), None, "mlp", 16)


def test_given_cpu_profile_is_kept_and_others_set_model_and_batch(cache: Path) -> None:
    cpu = cpu_mod.emulation_profiles([], "mlp", 8)
    assert [p.meta.device_type for p in cpu] == ["cpu"] and cpu[0].meta.batch_size == 8
    assert cpu_mod.emulation_profiles(cpu, "other", 99) == cpu  # a cpu profile is given
    gpu = cpu[0].with_table(cpu[0].table, device_type="TITAN V")
    added = cpu_mod.emulation_profiles([gpu], None, None)
    assert added[0] is gpu and added[1].meta.device_type == "cpu"
    assert (added[1].meta.model, added[1].meta.batch_size) == ("mlp", 8)  # the profiles' own
    assert cpu_mod.emulation_profiles([], None, 8) == []  # no model: the planner asks for one


def test_other_batch_size_is_a_different_cache_entry(cache: Path) -> None:
    a = cpu_mod._cache_path("mlp", 16)
    b = cpu_mod._cache_path("mlp", 32)
    assert a is not None and b is not None and a != b


def test_unreadable_cache_file_is_measured_again(cache: Path) -> None:
    path = cpu_mod._cache_path("mlp", 8)
    assert path is not None
    path.parent.mkdir(parents=True)
    path.write_text("not a profile\n")
    prof = cpu_mod.cpu_profile("mlp", 8)
    assert prof.meta.source == "measured" and len(prof.table) > 0
    assert load_profile(path).meta.model == "mlp"  # rewritten with the measurement


@pytest.mark.parametrize("value", ["off", "0", ""])
def test_cache_can_be_switched_off(value: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(cpu_mod.CACHE_ENV, value)
    assert cpu_mod.profile_cache_dir() is None
    assert cpu_mod._cache_path("mlp", 8) is None


def test_default_cache_follows_xdg(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv(cpu_mod.CACHE_ENV, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert cpu_mod.profile_cache_dir() == tmp_path / "hetpipe"


def test_a_factory_returning_the_wrong_thing_is_a_model_error_without_a_profile_hint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A model an emulated cluster cannot build is named as such, not as a missing profile."""
    (tmp_path / "mynet.py").write_text(
        "from torch import nn\n\ndef net():\n    return nn.Sequential(nn.Linear(8, 3))\n"
    )
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ModelError, match="returned Sequential; it must return") as info:
        cpu_mod.emulation_profiles([], "mynet:net", 8)
    assert "hetpipe profile" not in str(info.value)
