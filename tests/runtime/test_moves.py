"""Moves of weight versions, optimizer state and gradients to host memory (runtime.stage.moves):
on the CPU (device = host = cpu) they run the same code as on CUDA; results stay bit-equal."""

from __future__ import annotations

import pytest
import torch
from torch import Tensor, nn
from torch.func import functional_call

from planner.offload import VERSION_BUFFERS, MemoryPlacement, StageBytes, device_bytes, host_bytes
from planner.schedule import HETPIPE
from runtime.config import OptimizerConfig
from runtime.stage.moves import ClassMoves, HostCopies, class_moves
from runtime.stage.offload import ResidencyMeter
from runtime.stage.weights import VersionedWeights

NM, STEPS = 5, 12
CPU = torch.device("cpu")


def _schedule(nm: int, steps: int) -> list[tuple[str, int]]:
    """Stage 0's task order with ``nm`` in flight: F1..Fnm, then B1 F(nm+1) B2 ..."""
    out = [("F", mb) for mb in range(1, min(nm, steps) + 1)]
    for mb in range(1, steps + 1):
        out.append(("B", mb))
        if mb + nm <= steps:
            out.append(("F", mb + nm))
    return out


def _train(memory: str) -> tuple[list[float], dict[str, Tensor], ClassMoves | None, int, int]:
    """Runs stage 0 of a pipeline (its loss stands in for the next stage's gradients)."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 4))
    moves = class_moves(memory, "test", CPU)
    cfg = OptimizerConfig(name="adam", lr=1e-2)
    w = VersionedWeights(dict(net.named_parameters()), NM, cfg, moves=moves)
    graphs: dict[int, Tensor] = {}
    losses: list[float] = []
    most_on_device = 0
    for kind, mb in _schedule(NM, STEPS):
        w.prefetch()
        if kind == "F":
            gen = torch.Generator().manual_seed(mb)
            graphs[mb] = functional_call(net, w.acquire(mb), (torch.randn(3, 6, generator=gen),))
            w.park(mb)
        else:
            leaves = w.leaves(mb)
            loss = graphs.pop(mb).square().mean()
            losses.append(float(loss.detach()))
            grads = torch.autograd.grad(loss, list(leaves.values()))
            w.update(mb, w.park_grads(dict(zip(leaves, grads, strict=True))))
        if moves is not None:  # stashed versions whose storage is on the device
            stashed = [v for v in w._versions if w._stashed(v)]
            here = [v for v in stashed if id(w._versions[v]) not in moves._on_host]
            most_on_device = max(most_on_device, len(here))
    state = {n: p.detach().clone() for n, p in net.named_parameters()}
    return losses, state, moves, w.param_bytes, most_on_device


@pytest.mark.parametrize(
    "memory", ["weights:offload", "optimizer:offload", "gradients:offload", "OKOO"]
)
def test_each_class_offloaded_is_bit_equal_to_all_keep(memory: str) -> None:
    ref_losses, ref_state, _, _, _ = _train("keep")
    losses, state, moves, param, on_device = _train(memory)
    assert losses == ref_losses
    for name, p in ref_state.items():
        assert torch.equal(state[name], p)
    assert moves is not None and moves.copies.moved_bytes > 0
    pl = MemoryPlacement.parse(memory)
    peak = moves.peak_host_bytes
    # the classes the placement offloads sit in host memory, as the planner counts them
    assert peak["gradients"] == (param if pl.gradients.value == "offload" else 0)
    assert peak["optimizer"] == (2 * param if pl.optimizer.value == "offload" else 0)  # Adam
    if pl.weights.value == "offload":
        assert on_device <= VERSION_BUFFERS
        assert peak["weights"] >= (NM - 1 - VERSION_BUFFERS) * param
    else:
        assert peak["weights"] == 0
    # between updates the state stays in host memory; no gradient waits once all are applied
    assert moves.host_bytes["optimizer"] == peak["optimizer"]
    assert moves.host_bytes["gradients"] == 0


def test_meter_matches_the_planner_memory_model() -> None:
    pl = MemoryPlacement.parse("OKOO")
    param, saved, o = 1000, 300, 2.0
    meter = ResidencyMeter("s", 10**9, param, 0, o, pl)
    k = HETPIPE.in_flight_bound(0, 2, NM)
    for mb in range(1, k + 1):  # stage 0 holds Nm minibatches and Nm - 1 stashed versions
        meter.check(mb, saved, stashed_bytes=(NM - 1) * param)
    b = StageBytes(param=param, buffer=0, saved=saved, cut=0)
    assert meter.peak_bytes == device_bytes(b, pl, NM, k, o)
    assert meter.peak_host_bytes == host_bytes(b, pl, NM, k, o)


def test_host_copies_are_fresh_storage() -> None:
    copies = HostCopies()
    t = torch.arange(6.0)
    down = copies.down(t)
    up = copies.ready(copies.up(down, CPU))
    assert torch.equal(up, t) and up.data_ptr() != t.data_ptr() != down.data_ptr()
    assert copies.moved_bytes == 2 * t.numel() * t.element_size()
    assert class_moves("activations:offload", "s", CPU) is None


def test_an_emulated_device_counts_moves_without_copying() -> None:
    copies = HostCopies(copy=False)  # the emulated device is host memory: no CPU time spent
    t = torch.arange(6.0)
    assert copies.down(t).data_ptr() == t.data_ptr() == copies.up(t, CPU).data_ptr()
    assert copies.moved_bytes == 2 * t.numel() * t.element_size()
