"""Built-in model references, including sized ones such as ``mlp(hidden=1024, depth=8)``."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from profiler.errors import ModelError
from profiler.host_memory import check_fits_host
from profiler.models import resolve_model, resolve_model_for_graph


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


def _factory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, raises: str) -> str:
    """A factory module raising ``raises``, named apart per case (imports are cached)."""
    name = f"bigfactory{sum(map(ord, raises))}"
    (tmp_path / f"{name}.py").write_text(
        f"import torch\n\ndef build(batch_size=32):\n    raise {raises}\n", encoding="utf-8"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    return f"{name}:build"


@pytest.mark.parametrize(
    ("raises", "needle"),
    [
        (
            "RuntimeError(\"DefaultCPUAllocator: can't allocate memory: you tried to allocate "
            '123456 bytes. Error code 12\\nmore")',
            "tried to allocate 123,456 bytes, RuntimeError",
        ),
        ("torch.OutOfMemoryError('CUDA out of memory')", "an allocation failed, OutOfMemoryError"),
        ("MemoryError()", "an allocation failed, MemoryError"),
    ],
)
def test_a_factory_out_of_memory_is_one_line_naming_the_bytes_and_the_fix(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, raises: str, needle: str
) -> None:
    ref = _factory(tmp_path, monkeypatch, raises)
    with pytest.raises(ModelError) as err:
        resolve_model(ref, 4)
    msg = str(err.value)
    assert "\n" not in msg and msg.startswith(f"model {ref!r} does not fit"), msg
    assert needle in msg and "use a smaller model, or plan it from --profiles" in msg, msg


def test_a_built_in_whose_build_runs_out_of_memory_is_a_model_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Weights that fit the host on paper but fail to allocate (a busy host): one line."""
    import profiler.models as models

    def mlp(**kwargs: int) -> torch.nn.Module:
        if torch.get_default_device().type != "meta":  # only the real build fails
            raise MemoryError
        return nn_mlp(**kwargs)

    nn_mlp = models.mlp
    monkeypatch.setattr(models, "mlp", mlp)
    assert resolve_model_for_graph("mlp(hidden=8)", 4).name == "mlp(hidden=8)"  # meta: fine
    with pytest.raises(ModelError, match=r"^model 'mlp\(hidden=8\)' does not fit .* MemoryError"):
        resolve_model("mlp(hidden=8)", 4)


def test_weights_larger_than_the_host_are_refused_before_any_allocation() -> None:
    with torch.device("meta"):
        module = resolve_model("mlp(hidden=64,depth=1)", 4).module
    check_fits_host("mlp", module, host_bytes=10**9)  # fits
    with pytest.raises(ModelError, match=r"needs 19,240 bytes of weights .* has 1,000 bytes"):
        check_fits_host("mlp", module, host_bytes=1000)
    huge = "mlp(hidden=1000000000000,depth=1)"  # 512 TB of weights: counted on meta only
    with pytest.raises(ModelError, match=r"needs [\d,]+ bytes of weights but this host has"):
        resolve_model(huge, 4)
    assert resolve_model_for_graph(huge, 4).module[0].weight.is_meta  # planning on meta: fine
