"""The memory-placement rule (planner.offload): bytes on device and host, transfers, overlap."""

from __future__ import annotations

import doctest

import pytest
from hypothesis import given
from hypothesis import strategies as st

import planner.offload as off
from planner.offload import (
    CANDIDATES,
    KEEP_ALL,
    LADDER,
    MemoryPlacement,
    Place,
    StageBytes,
    device_bytes,
    effective,
    exposed_ms,
    host_bytes,
    recompute_ms,
    transfer_bytes,
)

B = StageBytes(param=1000, buffer=10, saved=300, cut=50)


def test_doctest() -> None:
    assert doctest.testmod(off).failed == 0


def test_keep_all_is_the_old_memory_model() -> None:
    # static = P * (2 + o) + buffers + (Nm - 1) * P; plus k * (S + C)
    for nm, k, o in [(1, 1, 0.0), (4, 4, 1.0), (6, 1, 2.0)]:
        old = B.param * (2 + o) + B.buffer + (nm - 1) * B.param + k * (B.saved + B.cut)
        assert device_bytes(B, KEEP_ALL, nm, k, o) == round(old)
        assert host_bytes(B, KEEP_ALL, nm, k, o) == 0
        assert transfer_bytes(B, KEEP_ALL, nm, k, o) == 0


def test_each_class_saves_what_the_rule_says() -> None:
    nm, k, o = 6, 6, 1.0
    keep = device_bytes(B, KEEP_ALL, nm, k, o)
    w = MemoryPlacement(weights=Place.OFFLOAD)
    assert keep - device_bytes(B, w, nm, k, o) == (nm - 1 - 2) * B.param
    assert host_bytes(B, w, nm, k, o) == (nm - 1 - 2) * B.param
    a = MemoryPlacement(activations=Place.OFFLOAD)
    assert keep - device_bytes(B, a, nm, k, o) == (k - 2) * (B.saved + B.cut)
    assert transfer_bytes(B, a, nm, k, o) == 2 * (B.saved + B.cut)
    r = MemoryPlacement(activations=Place.RECOMPUTE)
    assert keep - device_bytes(B, r, nm, k, o) == (k - 1) * B.saved
    assert host_bytes(B, r, nm, k, o) == 0 and transfer_bytes(B, r, nm, k, o) == 0
    og = MemoryPlacement(optimizer=Place.OFFLOAD, gradients=Place.OFFLOAD)
    assert keep - device_bytes(B, og, nm, k, o) == 2 * B.param
    assert transfer_bytes(B, og, nm, k, o) == 2 * B.param + 2 * o * B.param  # update on device
    opt = MemoryPlacement(optimizer=Place.OFFLOAD)
    assert transfer_bytes(B, opt, nm, k, o) == 2 * o * B.param


@given(
    st.sampled_from(CANDIDATES),
    st.integers(1, 12),
    st.integers(1, 12),
    st.sampled_from([0.0, 1.0, 2.0]),
)
def test_device_plus_host_covers_the_kept_bytes(
    pl: MemoryPlacement, nm: int, k: int, o: float
) -> None:
    """Moving data never loses it: device + host >= all-keep, recompute aside."""
    dev, host = device_bytes(B, pl, nm, k, o), host_bytes(B, pl, nm, k, o)
    keep = device_bytes(B, KEEP_ALL, nm, k, o)
    assert dev <= keep
    rebuilt = (k - 1) * B.saved if pl.activations is Place.RECOMPUTE else 0
    assert dev + host + rebuilt >= keep
    eff = effective(pl, nm, k)  # undoing the useless moves changes no device byte
    assert device_bytes(B, eff, nm, k, o) == dev


def test_effective_undoes_moves_that_save_nothing() -> None:
    pl = MemoryPlacement(Place.OFFLOAD, Place.OFFLOAD, Place.KEEP, Place.KEEP)
    assert effective(pl, nm=3, in_flight=2) == KEEP_ALL
    assert effective(pl, nm=4, in_flight=3) == pl
    assert effective(MemoryPlacement(activations=Place.RECOMPUTE), 2, 1) == KEEP_ALL


def test_overlap_and_recompute_time() -> None:
    assert exposed_ms(3.0, 5.0) == 0.0
    assert exposed_ms(7.5, 5.0) == 2.5
    r = MemoryPlacement(activations=Place.RECOMPUTE)
    assert recompute_ms(r, 4.0, in_flight=3) == 4.0
    assert recompute_ms(r, 4.0, in_flight=1) == 0.0
    assert recompute_ms(KEEP_ALL, 4.0, in_flight=3) == 0.0


def test_names_round_trip_and_errors() -> None:
    for pl in CANDIDATES:
        assert MemoryPlacement.parse(str(pl)) == pl
        assert MemoryPlacement.parse(pl.code) == pl
    assert len(set(CANDIDATES)) == 24 and CANDIDATES[0] == KEEP_ALL
    assert LADDER[0] == KEEP_ALL
    with pytest.raises(ValueError, match="class:place"):
        MemoryPlacement.parse("weights:recycle")
    with pytest.raises(ValueError, match="cannot be recomputed"):
        MemoryPlacement(weights=Place.RECOMPUTE)


def test_ladder_device_bytes_decrease() -> None:
    bytes_ = [device_bytes(B, pl, 8, 8, 1.0) for pl in LADDER]
    assert bytes_ == sorted(bytes_, reverse=True) and bytes_[-1] < bytes_[0]
