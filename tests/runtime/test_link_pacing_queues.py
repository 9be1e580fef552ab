"""Sender-side link queues: the runtime charges each transfer on the queue the simulator does.

One process, an injected clock (:class:`tests.runtime.test_link_pacing.FakeClock`): stages of
"other processes" are other :class:`SendQueues` over the same card file, so the tests see
every window exactly, with no sleeping and no timed assertion.
"""

from __future__ import annotations

import dataclasses
import math
import queue
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import Tensor

from planner.cluster import NODE_CARD, OWN_LINK, Link, sender_queue
from planner.plan import Plan
from planner.schedule import Kind, Task, schedule_named
from planner.sim.engine import _Sim
from planner.sim.simulator import pipeline_specs, stage_shard_bytes
from runtime.launch.jobs import Prepared, with_cards
from runtime.launch.roles import stage_contexts, stage_links
from runtime.link_pacing import NO_LINKS, LinkPacer, StageLinks
from runtime.ps.client import PSClient
from runtime.ps.layout import make_shard_specs
from runtime.ps.wire import TAG_PUSH
from runtime.results.metrics import StageResult
from runtime.send_queues import Route, SendQueues, make_card
from runtime.stage import comm
from runtime.stage.comm import Channel, Event, TensorSpec, start_activation_receiver
from runtime.stage.job import StageJob
from runtime.sync.rule import StageSync
from tests.planner.simplan import make_plan
from tests.runtime.test_link_pacing import FakeClock, _Done, emulated

LINK = Link(1e9, 1e-5)  # 1 GB/s + 10 us: 1 MB takes 1.01 ms
SPECS = (TensorSpec("h", (250_000,), torch.float32),)  # 1 MB a message


class _Wire:
    """What ``comm._post`` would hand gloo: the buffers sent, in order; a receive takes the
    oldest one sent."""

    def __init__(self) -> None:
        self.sent: list[Tensor] = []

    def post(self, op: Any, t: Tensor, peer: int, group: Any, tag: int) -> _Done:
        if op is dist.isend:
            self.sent.append(t.clone())
        else:
            t.copy_(self.sent.pop(0))
        return _Done()


@pytest.fixture
def wire(monkeypatch: pytest.MonkeyPatch) -> _Wire:
    w = _Wire()
    monkeypatch.setattr(comm, "_post", w.post)
    return w


def deadlines(wire: _Wire) -> list[float]:
    """The delivery deadline each message sent carries."""
    return [float(comm.layout_of(SPECS).message(buf).deadline) for buf in wire.sent]


def queues(tmp_path: Path, clock: FakeClock, node: str = "V") -> SendQueues:
    card = tmp_path / f"card-{node}"
    if not card.exists():
        make_card(card)
    return SendQueues(str(card), clock.pace)


def test_a_stages_forward_and_backward_sends_queue_on_its_own_link(
    wire: _Wire, tmp_path: Path
) -> None:
    clock = FakeClock()
    mine = queues(tmp_path, clock)
    to_next = Channel(2, SPECS, route=Route(mine, LINK, OWN_LINK))
    to_prev = Channel(0, SPECS, route=Route(mine, LINK, OWN_LINK))
    charge = LINK.time_s(1e6)
    to_next.send_activations(1, (torch.ones(250_000),))
    to_prev.send_grads(1, [torch.ones(250_000)])  # posted at once: waits for the activations
    clock.now += 10 * charge  # the link has been idle since
    to_next.send_activations(2, (torch.ones(250_000),))
    to_prev.send_grads(2, [torch.ones(250_000)], not_before_s=3.0 + 30 * charge)  # posted early
    want = [3.0 + charge, 3.0 + 2 * charge, 3.0 + 11 * charge, 3.0 + 31 * charge]
    assert deadlines(wire) == pytest.approx(want)


def test_the_receiver_holds_a_message_until_its_senders_deadline(
    wire: _Wire, tmp_path: Path
) -> None:
    clock = FakeClock()
    mine = queues(tmp_path, clock)
    charge = LINK.time_s(1e6)
    mine.deadline(OWN_LINK, 2 * charge)  # the sender's gradients to its previous stage, first
    to_next = Channel(1, SPECS, route=Route(mine, LINK, OWN_LINK))
    for mb in (1, 2):
        to_next.send_activations(mb, (torch.ones(250_000),))
    to_next.send_stop()  # no transfer of the model's: no window, not held
    assert math.isnan(deadlines(wire)[2])
    inbox: queue.SimpleQueue[Event] = queue.SimpleQueue()
    pacer = LinkPacer(LINK, clock.pace)
    start_activation_receiver(0, SPECS, inbox, timeout_s=5, pacer=pacer).join(10)
    # each is held until its window on the sender's queue ends (behind the gradients), not
    # paced on its own link from its arrival
    assert clock.waits == pytest.approx([3.0 + 3 * charge, 3.0 + 4 * charge])


def test_stages_of_one_node_share_its_card_across_processes(wire: _Wire, tmp_path: Path) -> None:
    clock = FakeClock()
    a, b = queues(tmp_path, clock), queues(tmp_path, clock)  # two processes of node V
    other = queues(tmp_path, clock, node="R")
    charge = LINK.time_s(1e6)
    Channel(5, SPECS, route=Route(a, LINK, NODE_CARD)).send_activations(1, (torch.ones(250_000),))
    Channel(6, SPECS, route=Route(b, LINK, NODE_CARD)).send_activations(1, (torch.ones(250_000),))
    Channel(7, SPECS, route=Route(b, LINK, OWN_LINK)).send_activations(1, (torch.ones(250_000),))
    Channel(8, SPECS, route=Route(other, LINK, NODE_CARD)).send_grads(1, [torch.ones(250_000)])
    got = deadlines(wire)
    # b's cross-node send waits for a's on V's card; its own link and R's card are free
    assert got == pytest.approx([3.0 + charge, 3.0 + 2 * charge, 3.0 + charge, 3.0 + charge])
    a.close()


def _two_shard_client(links: StageLinks, mine: SendQueues, pushed: list[tuple[int, float]]) -> Any:
    """A PS client of one stage with parameter ``r`` on shard 0 and ``v`` on shard 1 (250,000
    floats each) whose transport completes at once; ``(shard rank, clock)`` of each push part
    posted goes to ``pushed``."""
    shapes = {"r": (250_000,), "v": (250_000,)}
    specs = make_shard_specs(shapes, {"r": 0, "v": 1}, [10, 11], [(0, 0, 0, ["r", "v"])])
    client = PSClient(0, 0, list(shapes.items()), specs, paced=links, pace=mine.pace, queues=mine)
    client._irecv = lambda link, tensor, tag, what: _Done()  # type: ignore[method-assign,assignment,return-value]

    def isend(link: Any, tensor: Tensor, tag: int, what: str) -> _Done:
        if tag == TAG_PUSH:
            pushed.append((link.spec.rank, mine.pace.clock()))
        return _Done()

    client._isend = isend  # type: ignore[method-assign,assignment]
    return client


def test_a_pushs_parts_queue_on_the_own_link_then_the_card(tmp_path: Path) -> None:
    clock = FakeClock()
    mine, neighbour = queues(tmp_path, clock), queues(tmp_path, clock)
    inter, intra = Link(1e9, 1e-5), Link(2e9, 5e-6)
    # shard 0 on another node (the card), shard 1 on the stage's node (its own link)
    links = StageLinks(
        shards=((0, inter), (1, intra)), shard_queues=((0, NODE_CARD), (1, OWN_LINK))
    )
    pushed: list[tuple[int, float]] = []
    client = _two_shard_client(links, mine, pushed)
    act_end = mine.deadline(OWN_LINK, LINK.time_s(1e6))  # activations ahead on the own link
    card_end = neighbour.deadline(NODE_CARD, 0.5e-3)  # another process of the node on the card
    client.push(0, [torch.zeros(250_000), torch.zeros(250_000)])
    client.flush()
    local_end = act_end + intra.time_s(1e6)
    # the local part first, after the activations; then the card part, after it and the
    # neighbour's transfer
    assert [rank for rank, _ in pushed] == [11, 10]
    want = [local_end, max(local_end, card_end) + inter.time_s(1e6)]
    assert [t for _, t in pushed] == pytest.approx(want)
    client.close()


class _Replay:
    """The same transfers posted to the simulator's model (``_Sim._transfer``/``_push`` on its
    links) and to the runtime's queues (one :class:`SendQueues` per stage process, a card file
    per node), each returning when the transfer ends (ms)."""

    def __init__(self, plan: Plan, clock: FakeClock, folder: Path) -> None:
        self.plan = plan
        specs = pipeline_specs(plan, overhead_ms_per_task=0.0)
        self.sim = _Sim(specs, plan.nm, plan.D, 2, False, schedule_named(plan.schedule))
        vws = plan.virtual_workers
        self.nodes = {
            (v, s): vw.gpus[st.gpu].node
            for v, vw in enumerate(vws)
            for s, st in enumerate(vw.stages)
        }
        self.procs = {key: queues(folder, clock, node) for key, node in self.nodes.items()}

    def runtime_send(self, v: int, s: int, to: int) -> float:
        links = stage_links(self.plan, v, s)
        link, q = (links.next, links.next_queue) if to > s else (links.prev, links.prev_queue)
        assert link is not None
        nbytes = self.plan.virtual_workers[v].stages[max(s, to)].recv_bytes
        return Route(self.procs[v, s], link, q).deadline(nbytes) * 1e3

    def sim_send(self, v: int, s: int, to: int, now_ms: float) -> float:
        w = self.sim.vws[v]
        receiver, forward = w.stages[to], to > s  # gradients: the receiver's b_* (from to + 1)
        recv, link = (
            (receiver.f_recv, receiver.f_link) if forward else (receiver.b_recv, receiver.b_link)
        )
        self.sim._transfer(w, Task(to, Kind.F if forward else Kind.B, 1), recv, link, now_ms)
        return self.sim.links.free[link]

    def runtime_push(self, v: int, s: int) -> float:
        links, vw, node = (
            stage_links(self.plan, v, s),
            self.plan.virtual_workers[v],
            self.nodes[v, s],
        )
        parts = stage_shard_bytes(self.plan, vw, vw.stages[s], None)
        ends = []
        for shard_node, b in sorted(parts, key=lambda p: p[0] != node):  # local parts first
            sid = next(sh.id for sh in self.plan.shards if sh.node == shard_node)
            link = links.shard(sid)
            assert link is not None
            ends.append(self.procs[v, s].push_deadline(links.shard_queue(sid), link.time_s(b)))
        return max(ends) * 1e3

    def sim_push(self, v: int, s: int, now_ms: float) -> float:
        self.sim._push(self.sim.vws[v], s, 0, now_ms)
        return max(self.sim.heap, key=lambda e: e[1])[0]  # the event scheduled last: its arrival


def test_the_runtimes_windows_are_the_simulators_for_the_same_transfers(tmp_path: Path) -> None:
    # VW 0 runs V -> R, VW 1 runs V -> R too: V's card carries both VWs' activations
    plan = make_plan(
        [[("V", 1.0, 2.0), ("R", 1.0, 2.0)], [("V", 1.0, 2.0), ("R", 1.0, 2.0)]],
        nm=2,
        cluster=emulated(),
    )
    clock = FakeClock(now=0.0)
    replay = _Replay(plan, clock, tmp_path)
    events = [  # (ms, what, vw, stage, to): one order of posts, the same on both sides
        (0.0, "send", 0, 0, 1),
        (0.1, "push", 0, 0, 0),
        (0.2, "send", 1, 0, 1),
        (0.3, "send", 0, 1, 0),
        (0.3, "push", 0, 1, 1),
        (0.4, "send", 1, 1, 0),
        (9.0, "send", 0, 0, 1),
    ]
    for t_ms, what, v, s, to in events:
        clock.now = t_ms / 1e3
        if what == "send":
            assert sender_queue("VR"[s], "VR"[to]) == NODE_CARD  # every send leaves its node
            want, got = replay.sim_send(v, s, to, t_ms), replay.runtime_send(v, s, to)
        else:
            want, got = replay.sim_push(v, s, t_ms), replay.runtime_push(v, s)
        assert got == pytest.approx(want), (t_ms, what, v, s)


def test_the_launcher_gives_each_node_one_card_file(tmp_path: Path) -> None:
    plan = make_plan(
        [[("V", 1.0, 2.0), ("R", 1.0, 2.0)], [("V", 1.0, 2.0)]], nm=2, cluster=emulated()
    )
    ctxs = [c for v in (0, 1) for c in stage_contexts(plan, v, 2, 4)]
    ctxs.append(dataclasses.replace(ctxs[0], links=NO_LINKS))  # not paced (a real cluster)
    jobs = tuple(StageJob(c, None, None, None) for c in ctxs)  # type: ignore[arg-type]
    prep = with_cards(Prepared((), jobs, 4, 0, 2, 0), tmp_path)
    files = [j.ctx.links.card_file for j in prep.stages]
    assert files[0] == files[2] != files[1] and files[3] == ""
    assert prep.stages[3].ctx.links == NO_LINKS
    assert all(Path(f).stat().st_size == 8 for f in files[:3])
    assert all(j.ctx.links.sender_queued for j in prep.stages[:3])


class _Grads:
    """A channel to the previous stage that records each gradient send (and its earliest
    window start) in ``log``."""

    def __init__(self, log: list[tuple[str, float]], route: Route | None) -> None:
        self.log, self.route = log, route

    def send_grads(self, mb: int, grads: Any, not_before_s: float = -math.inf) -> None:
        self.log.append(("grads", not_before_s))


@pytest.mark.parametrize("queued", [True, False])
def test_an_emulated_backward_queues_its_gradients_before_its_updates_push(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, queued: bool
) -> None:
    # the simulator posts a backward's gradients, then the wave's push, at the backward's end:
    # on a shared queue the gradients must hold the earlier window
    from runtime.stage import worker as stage_worker
    from runtime.stage.timers import lap_timer

    log: list[tuple[str, float]] = []
    w = stage_worker.StageWorker.__new__(stage_worker.StageWorker)
    w.timer, w.offload, w.fault = lap_timer(False), None, None
    w.tied = None  # type: ignore[assignment]
    w.sync = StageSync()  # no update waits for a pull
    w.result = StageResult(1, 0, 1, "V:0")
    w.ctx = stage_contexts(
        make_plan([[("V", 1.0, 2.0), ("R", 1.0, 2.0)]], 2, cluster=emulated()), 0, 2, 4
    )[1]
    monkeypatch.setattr(w, "_backward", lambda mb: ({}, [None]), raising=False)
    monkeypatch.setattr(w, "_judge", lambda mb, gw, gx: None, raising=False)
    monkeypatch.setattr(w, "_deadline", lambda t0, kind: 42.0, raising=False)
    monkeypatch.setattr(w, "_update", lambda *a: log.append(("update", 0.0)), raising=False)
    monkeypatch.setattr(w, "_post", lambda mb: log.append(("push", 0.0)), raising=False)
    monkeypatch.setattr(stage_worker.StageWorker, "_paced", True)
    monkeypatch.setattr(stage_worker, "pace_until", lambda deadline: 0.0)
    route = Route(queues(tmp_path, FakeClock()), LINK, OWN_LINK) if queued else None
    w._execute(Task(1, Kind.B, 3), None, _Grads(log, route), None)  # type: ignore[arg-type]
    if queued:  # its window begins when the emulated backward ends
        assert log == [("grads", 42.0), ("update", 0.0), ("push", 0.0)]
    else:  # receivers pace on arrival: the gradients leave when the backward ends, then the
        # push (test_push_time.py)
        assert log == [("update", 0.0), ("grads", -math.inf), ("push", 0.0)]
