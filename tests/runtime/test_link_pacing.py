"""Emulated links in the runtime: every transfer paced to what the simulator charges.

One process, an injected clock: a wait jumps the clock to its deadline, so the tests see
exactly when each transfer would end, with no sleeping and no timed assertion.
"""

from __future__ import annotations

import dataclasses
import threading
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from planner.cluster import Cluster, Link, load_cluster
from planner.predict import ring_link, simulate_allreduce
from planner.sim.simulator import pipeline_specs, stage_shard_bytes
from runtime.launch.roles import stage_links
from runtime.link_pacing import (
    NO_LINKS,
    LinkPacer,
    Pace,
    StageLinks,
    active_links,
    links_statement,
)
from runtime.ps.client import PSClient
from runtime.ps.layout import make_shard_specs
from runtime.ps.wire import HEADER_BYTES, TAG_PULL_HEADER, TAG_PUSH
from runtime.results.metrics import StageResult
from runtime.sync.allreduce import AllReduceSync
from tests.conftest import EXAMPLES
from tests.planner.simplan import make_plan, paper_cluster

SCALE = 40.0


class FakeClock:
    """A clock that only moves when a pacing wait jumps it to its deadline."""

    def __init__(self, now: float = 3.0) -> None:
        self.now = now
        self.waits: list[float] = []

    def __call__(self) -> float:
        return self.now

    def wait(self, deadline: float, clock: Any) -> float:
        self.waits.append(deadline)
        self.now = max(self.now, deadline)
        return 0.0

    @property
    def pace(self) -> Pace:
        return Pace(self, self.wait)


def emulated(scale: float = SCALE) -> Cluster:
    return dataclasses.replace(load_cluster(EXAMPLES / "emulated_cluster.yaml"), link_scale=scale)


def test_single_send_is_paced_to_the_simulators_receive_charge() -> None:
    plan = make_plan([[("V", 1.0, 2.0), ("R", 1.0, 2.0)]], nm=2, cluster=emulated())
    spec = pipeline_specs(plan)[0]
    nbytes = plan.virtual_workers[0].stages[1].recv_bytes
    for stage, link, want_ms in (
        (1, stage_links(plan, 0, 1).prev, spec.recv_fwd_ms[1]),  # activations into stage 1
        (0, stage_links(plan, 0, 0).next, spec.recv_bwd_ms[0]),  # gradients back into stage 0
    ):
        clock = FakeClock()
        waited = LinkPacer(link, clock.pace).arrived(nbytes)
        assert waited * 1e3 == pytest.approx(want_ms), stage
        assert clock.now == pytest.approx(3.0 + want_ms / 1e3)
    assert want_ms == pytest.approx(1e3 * SCALE * plan.cluster.inter_node.time_s(nbytes))


def test_a_transfer_slower_than_its_charge_is_not_paced_further() -> None:
    clock = FakeClock()
    pacer = LinkPacer(Link(1e9, 1e-5), clock.pace)
    assert pacer.arrived(1e6, start_s=clock.now - 1.0) == 0.0
    assert clock.waits == []


def test_messages_on_one_link_are_charged_one_after_another() -> None:
    clock = FakeClock()
    link = Link(1e9, 1e-5)
    pacer = LinkPacer(link, clock.pace)
    pacer.arrived(1e6, start_s=3.0)
    pacer.arrived(1e6, start_s=3.0)  # arrived together: the link carried them in turn
    assert clock.now == pytest.approx(3.0 + 2 * link.time_s(1e6))


def test_a_real_cluster_is_not_paced() -> None:
    plan = make_plan([[("V", 1.0, 2.0), ("R", 1.0, 2.0)]], nm=2, cluster=paper_cluster())
    assert all(stage_links(plan, 0, s) == NO_LINKS for s in range(2))
    clock = FakeClock()
    assert LinkPacer(None, clock.pace).arrived(1e9) == 0.0
    assert clock.waits == [] and not NO_LINKS.paced
    assert "real, not paced" in links_statement(plan.cluster, emulate=True)
    emulated_plan = make_plan([[("V", 1.0, 2.0), ("R", 1.0, 2.0)]], nm=2, cluster=emulated())
    paced = stage_links(emulated_plan, 0, 1)
    assert paced.paced and active_links(paced, emulate=True) == paced
    assert active_links(paced, emulate=False) == NO_LINKS  # --no-emulate
    emu = emulated_plan.cluster
    assert "real, not paced" in links_statement(emu, emulate=False)
    assert f"paced x{SCALE:g}" in links_statement(emu, emulate=True)


class _Done:
    """A transport request that completes after ``held_s`` of the clock (0: at once)."""

    def __init__(self, clock: FakeClock | None = None, held_s: float = 0.0) -> None:
        self.clock, self.held_s = clock, held_s

    def wait(self, timeout: Any = None) -> bool:
        if self.clock is not None:
            self.clock.now += self.held_s  # e.g. the shard held the reply for the global clock
            self.held_s = 0.0
        return True


def _client(
    plan_links: StageLinks,
    numel: int,
    clock: FakeClock,
    pushed: list[float],
    held_s: float = 0.0,
) -> PSClient:
    """A PS client of one parameter on shard 0 whose transport completes at once, but for
    pull replies, ``held_s`` late; the clock at each push message sent goes to ``pushed``."""
    specs = make_shard_specs({"w": (numel,)}, {"w": 0}, [1], [(0, 0, 0, ["w"])])
    client = PSClient(0, 0, [("w", (numel,))], specs, paced=plan_links, pace=clock.pace)

    def irecv(link: Any, tensor: torch.Tensor, tag: int, what: str) -> _Done:
        if tag == TAG_PULL_HEADER:  # [status OK, global clock, push status, seq]
            head = tensor[:HEADER_BYTES].view(torch.int64)  # a one-message reply: its head
            head.copy_(torch.tensor([0, 1_000, 0, client._seq[0]]))
            return _Done(clock, held_s)
        return _Done()

    client._irecv = irecv  # type: ignore[method-assign,assignment]

    def isend(link: Any, tensor: torch.Tensor, tag: int, what: str) -> _Done:
        if tag == TAG_PUSH:
            pushed.append(clock.now)
        return _Done()

    client._isend = isend  # type: ignore[method-assign,assignment]
    return client


def test_push_and_pull_are_paced_to_the_simulators_charge() -> None:
    plan = make_plan([[("V", 1.0, 2.0), ("R", 1.0, 2.0)]], nm=2, cluster=emulated())
    vw, st = plan.virtual_workers[0], plan.virtual_workers[0].stages[0]
    spec = pipeline_specs(plan)[0]
    shard, nbytes = next(
        (plan.shards[i], b)
        for i, (node, b) in enumerate(stage_shard_bytes(plan, vw, st, None))
        if node != "V"
    )
    link = stage_links(plan, 0, 0).shard(shard.id)
    assert link is not None
    one = StageLinks(shards=((0, link),))  # the client's shard 0 stands for that shard
    charge_ms = 1e3 * link.time_s(nbytes)
    assert charge_ms == pytest.approx(spec.push_inter_ms[0])  # the simulator's push to it
    clock = FakeClock()
    pushed: list[float] = []
    client = _client(one, nbytes // 4, clock, pushed)
    client.pull(0)
    assert (clock.now - 3.0) * 1e3 == pytest.approx(charge_ms)
    start = clock.now
    client.push_pull(0, [torch.zeros(nbytes // 4)], 0).wait()  # push, then the pull it carries
    assert (clock.now - start) * 1e3 == pytest.approx(2 * charge_ms)
    start = clock.now
    client.push(1, [torch.zeros(nbytes // 4)])  # returns at once: the stage goes on
    client.flush()
    assert (clock.now - start) * 1e3 == pytest.approx(charge_ms)
    assert (pushed[-1] - start) * 1e3 == pytest.approx(charge_ms)  # the shard gets it then


def test_allreduce_is_paced_to_the_predicted_ring(tmp_path: Path) -> None:
    cl = emulated()
    ring = ring_link(cl, ["V", "R", "G", "Q"])
    grads = {"w": torch.ones(250_000), "b": torch.ones(10)}
    nbytes = sum(g.numel() * 4 for g in grads.values())
    want = simulate_allreduce([1.0] * 4, nbytes, ring, 32, ["V", "R", "G", "Q"]).allreduce_ms
    clock = FakeClock()
    result = StageResult(0, 0, 0, "V:0")
    links = StageLinks(ring=ring, ring_size=4)
    sync = AllReduceSync(None, 1, links=links, pace=clock.pace, result=result)
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    try:
        out = sync.reduce_grads(1, dict(grads))  # (a group of one: the mean is the gradient)
    finally:
        dist.destroy_process_group()
    torch.testing.assert_close(out["w"], grads["w"], rtol=0, atol=0)
    assert (clock.now - 3.0) * 1e3 == pytest.approx(want)
    assert result.wait_s * 1e3 == pytest.approx(want)  # not device time: the window grows


def test_a_reply_held_for_the_global_clock_is_charged_from_its_arrival() -> None:
    link = Link(1e9, 1e-4)
    clock = FakeClock()
    client = _client(StageLinks(shards=((0, link),)), 250_000, clock, [], held_s=5.0)
    client.pull(0)  # the shard answered 5 s later (slower VWs), then the reply crossed the link
    assert clock.now == pytest.approx(3.0 + 5.0 + link.time_s(1e6))


class _Held:
    """A transport request that completes when ``release`` is set."""

    def __init__(self, release: threading.Event) -> None:
        self.release = release

    def wait(self, timeout: Any = None) -> bool:
        return self.release.wait(10.0)


def test_replies_in_flight_are_watched_by_one_thread() -> None:
    # a thread per paced reply cost more than the rest of a pull on a loaded machine
    clock, release = FakeClock(), threading.Event()
    client = _client(StageLinks(shards=((0, Link(1e9, 1e-4)),)), 1_000, clock, [])
    plain_irecv = client._irecv

    def irecv(link: Any, tensor: torch.Tensor, tag: int, what: str) -> Any:
        plain_irecv(link, tensor, tag, what)
        return _Held(release) if tag == TAG_PULL_HEADER else _Done()

    client._irecv = irecv  # type: ignore[method-assign,assignment]
    before = threading.active_count()
    handles = [client.pull_async(k) for k in range(4)]
    watching = threading.active_count() - before
    release.set()
    assert [h.wait().clock for h in handles] == [1_000] * 4
    client.close()
    assert watching == 1
