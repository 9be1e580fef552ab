"""Shard checkpoints: atomic files, resume equal to an uninterrupted run, bad files refused."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from profiler.errors import ConfigError, HetPipeRuntimeError
from runtime.checkpoint import (
    ShardState,
    load_checkpoint,
    load_shard_state,
    resumable_clock,
    save_shard_state,
    shard_checkpoint_path,
)
from runtime.ps import ShardCore, Status
from tests.runtime.test_ps import all_pushes, init_weights, specs, update


def test_checkpoint_round_trip_and_resume_equals_uninterrupted(tmp_path: Path) -> None:
    spec = specs()[0]
    core = ShardCore(spec, init_weights(spec), momentum=0.5)
    pushes = sorted(all_pushes(spec, 6), key=lambda t: t[2])
    half = [t for t in pushes if t[2] < 3]
    for vw, st, w in half:
        core.push(vw, st, w, update(vw, st, w, spec.client_numel(spec.client(vw, st))))
    path = save_shard_state(core.state(), tmp_path)
    assert path == shard_checkpoint_path(tmp_path, 0, 3) and not list(tmp_path.glob(".*tmp"))
    state = load_shard_state(path)
    assert state.clock == 3 and len(state.ledger) == len(core.ledger)
    assert state.ledger == core.ledger
    resumed = ShardCore(spec, state=state)
    assert resumed.clock == 3 and resumed.local_clocks() == (3, 3, 3)
    for vw, st, w in pushes[len(half) :]:
        u = update(vw, st, w, spec.client_numel(spec.client(vw, st)))
        core.push(vw, st, w, u)
        resumed.push(vw, st, w, u)
    torch.testing.assert_close(resumed.weights(), core.weights(), rtol=0, atol=0)
    torch.testing.assert_close(
        resumed.state().optimizer["momentum"], core.state().optimizer["momentum"]
    )
    # a duplicate of a wave applied before the checkpoint is still rejected after resume
    assert (
        resumed.push(0, 0, 1, torch.zeros(spec.client_numel(spec.client(0, 0)))).status
        == Status.DUPLICATE
    )


def test_checkpoint_keeps_newest_files_and_finds_resumable_clock(tmp_path: Path) -> None:
    s0, s1 = specs()
    for clock in (1, 2, 3):
        save_shard_state(ShardState(0, clock, init_weights(s0)), tmp_path, keep=2)
    for clock in (1, 2):
        save_shard_state(ShardState(1, clock, init_weights(s1)), tmp_path, keep=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "shard-0-clock-2.pt",
        "shard-0-clock-3.pt",
        "shard-1-clock-1.pt",
        "shard-1-clock-2.pt",
    ]
    assert resumable_clock(tmp_path, 2) == 2  # shard 1 has not reached 3 yet
    assert resumable_clock(tmp_path, 3) is None
    assert resumable_clock(tmp_path / "nowhere", 1) is None


def test_checkpoint_load_refuses_bad_files(tmp_path: Path) -> None:
    bad = tmp_path / "shard-0-clock-1.pt"
    bad.write_bytes(b"not a checkpoint")
    with pytest.raises(HetPipeRuntimeError, match="cannot load checkpoint"):
        load_shard_state(bad)
    with pytest.raises(HetPipeRuntimeError, match="not found"):
        load_checkpoint(tmp_path / "missing.pt")
    torch.save({"x": ConfigError("pickled object")}, bad)  # not loadable with weights_only=True
    with pytest.raises(HetPipeRuntimeError, match="cannot load checkpoint"):
        load_shard_state(bad)
    torch.save({"kind": "something else"}, bad)
    with pytest.raises(HetPipeRuntimeError, match="not a hetpipe parameter-server shard"):
        load_shard_state(bad)
    spec = specs()[0]
    with pytest.raises(ConfigError, match="shard 1, not shard 0"):
        ShardCore(spec, state=ShardCore(specs()[1], init_weights(specs()[1])).state())
