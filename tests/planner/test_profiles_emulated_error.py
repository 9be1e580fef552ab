"""A model an emulated cluster cannot build is named as such, not as a missing profile."""

from __future__ import annotations

from pathlib import Path

import pytest

from planner.cluster import load_cluster
from planner.profiles import resolve_profiles
from profiler.errors import ModelError

CLUSTER = Path(__file__).resolve().parents[2] / "examples" / "emulated_cluster.yaml"


def test_a_factory_returning_the_wrong_thing_is_a_model_error_without_a_profile_hint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "mynet.py").write_text(
        "from torch import nn\n\ndef net():\n    return nn.Sequential(nn.Linear(8, 3))\n"
    )
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ModelError, match="returned Sequential; it must return") as info:
        resolve_profiles(load_cluster(CLUSTER), None, "mynet:net", 8)
    assert "hetpipe profile" not in str(info.value)
