"""The real-text lm data (benchmarks/tta_tasks.py ``lm_text_data``): one process, no training."""

from __future__ import annotations

import sysconfig
from pathlib import Path

import pytest
import torch

from benchmarks.tta_tasks import (
    LM_TEST,
    LM_TRAIN,
    TEXT_IDS,
    TEXT_SEQ,
    TEXT_TEST_FILES,
    TEXT_TRAIN_FILES,
    TEXT_UNKNOWN,
    _text_ids,
    lm_data,
    lm_text_data,
)
from profiler.errors import ConfigError


def test_text_samples_have_the_lm_tasks_format_and_ids_in_range() -> None:
    train, test = lm_text_data()
    chain_train, chain_test = lm_data()
    assert (len(train), len(test)) == (len(chain_train), len(chain_test)) == (LM_TRAIN, LM_TEST)
    got, want = train[5], chain_train[5]
    assert got.keys() == want.keys()
    for k in want:
        assert (got[k].shape, got[k].dtype) == (want[k].shape, want[k].dtype)
    assert torch.equal(got["input_ids"], got["labels"])
    for ds in (train, test):
        assert int(ds.ids.min()) >= 0 and int(ds.ids.max()) < TEXT_IDS <= 512  # tiny's vocabulary
    a, b = lm_text_data(seed=3)
    assert torch.equal(a.ids, train.ids) and torch.equal(b.ids, test.ids)  # fixed data


def test_training_and_test_text_come_from_their_own_files() -> None:
    assert not set(TEXT_TRAIN_FILES) & set(TEXT_TEST_FILES)
    root = Path(sysconfig.get_paths()["stdlib"])
    train, test = lm_text_data()
    first = (root / TEXT_TRAIN_FILES[0]).read_bytes()[:TEXT_SEQ]
    assert bytes(train.ids[0].tolist()) == first
    assert bytes(test.ids[0].tolist()) == (root / TEXT_TEST_FILES[0]).read_bytes()[:TEXT_SEQ]
    test_text = b"".join((root / n).read_bytes() for n in TEXT_TEST_FILES)
    assert all(bytes(r.tolist()) in test_text for r in test.ids[:: len(test.ids) // 8])


def test_each_file_is_cut_on_its_own_and_other_bytes_map_to_one_id(tmp_path: Path) -> None:
    (tmp_path / "a.py").write_bytes(b"x" * (TEXT_SEQ + 5))  # one sequence, 5 bytes dropped
    (tmp_path / "b.py").write_bytes("é".encode() + b"y" * (2 * TEXT_SEQ - 2))
    ids = _text_ids(("a.py", "b.py"), 3, tmp_path)
    assert ids.shape == (3, TEXT_SEQ)
    assert ids[0].tolist() == [ord("x")] * TEXT_SEQ
    assert ids[1, :3].tolist() == [TEXT_UNKNOWN, TEXT_UNKNOWN, ord("y")]  # é: two bytes
    assert ids[2].tolist() == [ord("y")] * TEXT_SEQ
    assert torch.equal(_text_ids(("a.py", "b.py"), 2, tmp_path), ids[:2])


def test_missing_or_short_files_are_one_line_errors(tmp_path: Path) -> None:
    (tmp_path / "a.py").write_bytes(b"x" * TEXT_SEQ)
    with pytest.raises(ConfigError, match=r"1 sequences of 32 characters, 2 needed"):
        _text_ids(("a.py",), 2, tmp_path)
    with pytest.raises(ConfigError, match=r"nope\.py: not found"):
        _text_ids(("a.py", "nope.py"), 2, tmp_path)
