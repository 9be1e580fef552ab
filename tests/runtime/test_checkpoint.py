"""Snapshots: parts, atomic commit by manifest, retention of committed ones only, verified loads."""

from __future__ import annotations

import errno
from pathlib import Path

import pytest
import torch

from profiler.errors import ConfigError, HetPipeRuntimeError
from runtime.persist.checkpoint import load_checkpoint, shard_from_payload, shard_payload
from runtime.persist.snapshot import (
    MANIFEST,
    SnapshotSpec,
    WriteFault,
    clean,
    committed_clocks,
    load_part,
    read_manifest,
    select,
    snapshot_dir,
    write_part,
)
from runtime.ps.core import ShardCore
from runtime.ps.outcome import Status
from tests.runtime.test_ps import all_pushes, init_weights, specs, update

PARTS = ("shard-0", "vw0-stage0")


def _spec(tmp_path: Path, attempt: str = "a1", keep: int = 2, **kw: object) -> SnapshotSpec:
    return SnapshotSpec(tmp_path, "run1", attempt, PARTS, (("nm", "2"),), 1, keep, **kw)  # type: ignore[arg-type]


def _snapshot(spec: SnapshotSpec, clock: int, parts: tuple[str, ...] = PARTS) -> None:
    for name in parts:
        write_part(spec, clock, name, {"clock": clock, "x": torch.full((4,), float(clock))})


def test_shard_round_trip_and_resume_equals_uninterrupted(tmp_path: Path) -> None:
    spec = specs()[0]
    core = ShardCore(spec, init_weights(spec), momentum=0.5)
    pushes = sorted(all_pushes(spec, 6), key=lambda t: t[2])
    half = [t for t in pushes if t[2] < 3]
    for vw, st, w in half:
        core.push(vw, st, w, update(vw, st, w, spec.client_numel(spec.client(vw, st))))
    snaps = SnapshotSpec(tmp_path, "r", "a", ("shard-0",), (), 1)
    write_part(snaps, 3, "shard-0", shard_payload(core.state()))
    state = shard_from_payload(load_part(read_manifest(snapshot_dir(tmp_path, 3)), "shard-0"), "x")
    assert state.clock == 3 and state.ledger == core.ledger
    resumed = ShardCore(spec, state=state)
    for vw, st, w in pushes[len(half) :]:
        u = update(vw, st, w, spec.client_numel(spec.client(vw, st)))
        core.push(vw, st, w, u)
        resumed.push(vw, st, w, u)
    torch.testing.assert_close(resumed.weights(), core.weights(), rtol=0, atol=0)
    torch.testing.assert_close(
        resumed.state().optimizer["momentum"], core.state().optimizer["momentum"]
    )
    zero = torch.zeros(spec.client_numel(spec.client(0, 0)))
    assert resumed.push(0, 0, 1, zero).status == Status.DUPLICATE  # the ledger survived


def test_commit_needs_every_part_of_the_same_attempt(tmp_path: Path) -> None:
    spec = _spec(tmp_path)
    _snapshot(spec, 1, PARTS[:1])
    assert committed_clocks(tmp_path) == []  # one part missing: not committed
    _snapshot(_spec(tmp_path, attempt="other"), 1, PARTS[1:])
    assert committed_clocks(tmp_path) == []  # a leftover of another attempt does not count
    _snapshot(spec, 1, PARTS[1:])
    assert committed_clocks(tmp_path) == [1]
    m = read_manifest(snapshot_dir(tmp_path, 1))
    assert (m.run_id, m.clock, m.settings, sorted(m.parts)) == ("run1", 1, {"nm": "2"}, list(PARTS))
    assert load_part(m, "vw0-stage0")["clock"] == 1
    assert not list(tmp_path.rglob("*.tmp"))


def test_retention_counts_committed_snapshots_only(tmp_path: Path) -> None:
    spec = _spec(tmp_path, keep=2)
    for clock in (1, 2, 3):
        _snapshot(spec, clock)
    _snapshot(spec, 7, PARTS[1:])  # a VW running ahead wrote a later clock's part
    _snapshot(spec, 4, PARTS[:1])  # clock 4 in progress
    assert committed_clocks(tmp_path) == [2, 3]
    assert snapshot_dir(tmp_path, 7).is_dir() and snapshot_dir(tmp_path, 4).is_dir()
    _snapshot(spec, 4, PARTS[1:])
    assert committed_clocks(tmp_path) == [3, 4] and snapshot_dir(tmp_path, 7).is_dir()


def test_keep_zero_keeps_every_committed_snapshot(tmp_path: Path) -> None:
    spec = _spec(tmp_path, keep=0)  # --keep 0: weights at fixed clocks, evaluated after the run
    for clock in (3, 6, 9, 12):
        _snapshot(spec, clock)
    _snapshot(spec, 15, PARTS[:1])  # in progress
    assert committed_clocks(tmp_path) == [3, 6, 9, 12]
    assert [load_part(read_manifest(snapshot_dir(tmp_path, c)), "shard-0")["clock"]
            for c in (3, 6, 9, 12)] == [3, 6, 9, 12]  # fmt: skip


@pytest.mark.parametrize("damage", ["flip", "truncate", "manifest", "missing"])
def test_damaged_snapshot_is_named_and_the_previous_one_used(tmp_path: Path, damage: str) -> None:
    spec = _spec(tmp_path)
    for clock in (1, 2):
        _snapshot(spec, clock)
    part = snapshot_dir(tmp_path, 2) / "shard-0.pt"
    data = bytearray(part.read_bytes())
    if damage == "flip":
        data[len(data) // 2] ^= 0x01
        part.write_bytes(bytes(data))
    elif damage == "truncate":
        part.write_bytes(bytes(data[:-10]))
    elif damage == "manifest":
        (snapshot_dir(tmp_path, 2) / MANIFEST).write_text("{not json")
    else:
        part.unlink()
    m, skipped = select(tmp_path)
    assert m.clock == 1 and len(skipped) == 1
    expected = {"flip": "checksum mismatch", "truncate": "truncated", "manifest": "malformed"}
    assert expected.get(damage, "unreadable") in skipped[0] and "clock-2" in skipped[0]
    with pytest.raises(ConfigError, match="@2"):
        select(tmp_path, 2)
    assert select(tmp_path, 1)[0].clock == 1


def test_select_and_clean(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="no such checkpoint directory"):
        select(tmp_path / "nowhere")
    spec = _spec(tmp_path, keep=5)
    for clock in (1, 2, 3):
        _snapshot(spec, clock)
    _snapshot(spec, 4, PARTS[:1])
    (tmp_path / "clock-2" / ".shard-0.pt.x.tmp").write_bytes(b"left over")
    with pytest.raises(ConfigError, match="no snapshot at clock 9"):
        select(tmp_path, 9)
    clean(tmp_path, 2)  # resuming from 2: later snapshots and incomplete ones go
    assert committed_clocks(tmp_path) == [1, 2] and not snapshot_dir(tmp_path, 4).exists()
    assert not list(tmp_path.rglob("*.tmp"))
    for p in tmp_path.rglob("*.pt"):
        p.write_bytes(b"x")
    with pytest.raises(ConfigError, match="no committed snapshot verifies"):
        select(tmp_path)


def test_write_errors_are_one_line_and_leave_no_tmp(tmp_path: Path) -> None:
    spec = _spec(tmp_path, fault=WriteFault(clock=2, part="shard-0"))
    _snapshot(spec, 1)
    with pytest.raises(HetPipeRuntimeError, match="No space left on device") as info:
        _snapshot(spec, 2)
    assert "\n" not in str(info.value) and "shard-0.pt" in str(info.value)
    assert committed_clocks(tmp_path) == [1] and not list(tmp_path.rglob("*.tmp"))
    assert WriteFault(0).errno == errno.ENOSPC


def test_checkpoint_load_refuses_pickled_code(tmp_path: Path) -> None:
    bad = tmp_path / "x.pt"
    torch.save({"x": ConfigError("pickled object")}, bad)  # not loadable with weights_only=True
    with pytest.raises(HetPipeRuntimeError, match="cannot load checkpoint"):
        load_checkpoint(bad)
    with pytest.raises(HetPipeRuntimeError, match="not found"):
        load_checkpoint(tmp_path / "missing.pt")
    with pytest.raises(HetPipeRuntimeError, match="not a hetpipe parameter-server shard"):
        shard_from_payload({"kind": "something else"}, bad)


def test_torchrun_elastic_restart_resumes_only_from_a_committed_snapshot() -> None:
    from runtime.persist.run_dir import elastic_resume

    assert not elastic_resume(False, 0, [4])  # first attempt: a fresh run
    assert not elastic_resume(False, 2, [])  # restarted before any snapshot: from the start
    assert elastic_resume(False, 1, [2, 4])  # torchrun restarted the group: resume
    assert elastic_resume(True, 0, [])  # --resume asked (select() names a missing snapshot)
