"""The data check before any process starts: every integer target below the model's width."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import Subset, TensorDataset

from profiler.errors import ConfigError
from runtime.data_source import RunData, check_targets


def _labels(*ys: int) -> TensorDataset:
    return TensorDataset(torch.zeros(len(ys), 2), torch.tensor(ys))


def test_a_target_beyond_the_width_names_the_origin_set_and_fix() -> None:
    data = RunData(_labels(0, 1, 2), [(torch.zeros(2), 0), (torch.zeros(2), 7)], "", "--data m:f")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=r"^--data m:f: a test target is 7, .* 3 classes"):
        check_targets(data, 3, data.origin)
    check_targets(data, 8, data.origin)  # wide enough: nothing to say


def test_negative_targets_and_subsets_are_read_through() -> None:
    base = _labels(0, 9, 1, -1)
    check_targets(RunData(Subset(Subset(base, [0, 2, 3]), [0, 1])), 2, "x")  # 0 and 1 only
    with pytest.raises(ConfigError, match="a train target is -1"):
        check_targets(RunData(Subset(base, [0, 3])), 2, "x")


def test_a_failing_sample_is_one_line() -> None:
    class Broken(torch.utils.data.Dataset[tuple[torch.Tensor, int]]):
        def __len__(self) -> int:
            return 2

        def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
            raise KeyError(i)

    with pytest.raises(ConfigError, match="reading the train set's targets raised KeyError"):
        check_targets(RunData(Broken()), 2, "--data m:f")
