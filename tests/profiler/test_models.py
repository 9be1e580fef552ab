"""Built-in model references, including sized ones such as ``mlp(hidden=1024, depth=8)``."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from profiler.errors import ModelError
from profiler.models import resolve_model


def test_sized_mlp_reference_builds_that_size() -> None:
    spec = resolve_model("mlp(hidden=32, depth=2)", 4)
    linears = [m for m in spec.module.modules() if isinstance(m, torch.nn.Linear)]
    assert [(m.in_features, m.out_features) for m in linears] == [(64, 32), (32, 32), (32, 10)]
    assert spec.name == "mlp(hidden=32,depth=2)"
    assert spec.batch_size == 4


@pytest.mark.parametrize(
    ("ref", "needle"),
    [
        ("mlp(width=3)", "'width=3' is not a size argument"),
        ("mlp(hidden=0)", "N >= 1"),
        ("resnet(depth=3)", "takes no size arguments"),
    ],
)
def test_sized_reference_errors_name_the_argument(ref: str, needle: str) -> None:
    with pytest.raises(ModelError, match=needle):
        resolve_model(ref, 4)


def test_factory_that_raises_is_one_line_naming_where(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "badfactory.py").write_text(
        "def build(batch_size=32):\n    raise ValueError('vocab file missing\\nsecond line')\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ModelError) as err:
        resolve_model("badfactory:build", 4)
    msg = str(err.value)
    assert "\n" not in msg
    assert "raised ValueError at " in msg and "badfactory.py:2" in msg
    assert "vocab file missing" in msg and "fix the factory" in msg
