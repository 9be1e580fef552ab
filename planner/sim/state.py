"""The simulator's mutable state during one run: links, each GPU's stage, each VW.

Private to the event loop (:mod:`planner.sim.engine`); kept in ``__slots__`` objects so that
an event touches few cache lines (see docs/simulator.md, *Scale*).
"""

from __future__ import annotations

from array import array

from planner.cluster import NODE_CARD, sender_queue
from planner.schedule import Schedule, Task
from planner.sim.types import PipelineSpec

__all__ = ["NO_LINK", "Links", "StageState", "VWState"]

NO_LINK = -1  # a transfer that occupies no link (nothing to receive)


class Links:
    """When each link is free next (ms), by integer id: every GPU's own link and every node's
    network card (one list: an event indexes it instead of hashing node names)."""

    def __init__(self) -> None:
        self.free: list[float] = []
        self._cards: dict[str, int] = {}

    def new(self, n: int) -> list[int]:
        """Ids of ``n`` new links (a VW's GPU links)."""
        first = len(self.free)
        self.free.extend([0.0] * n)
        return list(range(first, first + n))

    def card(self, node: str) -> int:
        """Id of ``node``'s network card, shared by every VW using that node."""
        if node not in self._cards:
            self._cards[node] = len(self.free)
            self.free.append(0.0)
        return self._cards[node]


class StageState:
    """One GPU of a VW during a run: its task queue, what its tasks cost and its compute
    intervals, in one object so that an event touches few cache lines (see docs/simulator.md,
    *Scale*)."""

    __slots__ = (
        "b_bytes",
        "b_comp",
        "b_link",
        "b_recv",
        "ends",
        "f_bytes",
        "f_comp",
        "f_link",
        "f_recv",
        "folds",
        "forward_kind",
        "host",
        "max_in_flight",
        "own_link",
        "parked",
        "pulls",
        "push_card",
        "queue",
        "starts",
        "wave_comp",
    )

    def __init__(
        self,
        spec: PipelineSpec,
        v: int,
        s: int,
        links: Links,
        own: list[int],
        schedule: Schedule,
    ) -> None:
        n, nodes = spec.n_stages, spec.nodes

        def sender(src: int, recv: float) -> int:
            """The link a transfer from stage ``src`` to this stage occupies."""
            if not recv > 0.0:
                return NO_LINK
            if nodes and sender_queue(nodes[src], nodes[s]) == NODE_CARD:
                return links.card(nodes[src])
            return own[src]

        self.queue = schedule.queue(s, n)
        self.forward_kind = self.queue.forward_kind
        self.own_link = own[s]
        inter = spec.push_inter_ms
        self.push_card = (
            links.card(nodes[s] if nodes else f"{v}/{s}") if inter and inter[s] > 0.0 else NO_LINK
        )
        # forward (or the last stage's FB) and backward tasks: receive ms, the sender's link,
        # compute ms, cross-node bytes received
        fwd, bwd, xb = spec.fwd_ms, spec.bwd_ms, spec.cross_recv_bytes
        self.f_recv = spec.recv_fwd_ms[s]
        self.f_link = sender(s - 1, self.f_recv) if s > 0 else NO_LINK
        over = spec.overhead_ms_per_task  # the runtime's own cost of each task
        self.f_comp = fwd[s] + (bwd[s] if s == n - 1 else 0.0) + over
        self.f_bytes = xb[s] if s > 0 else 0
        last = s == n - 1  # the last stage has no backward task
        self.b_recv = 0.0 if last else spec.recv_bwd_ms[s]
        self.b_link = NO_LINK if last else sender(s + 1, self.b_recv)
        self.b_comp = 0.0 if last else bwd[s] + over
        self.b_bytes = 0 if last else xb[s + 1]
        # the runtime's cost of the wave's push and pull, on the task that ends the wave
        self.wave_comp = spec.wave_overhead_ms[s] if spec.wave_overhead_ms else 0.0
        # offloaded data per minibatch: host-link ms and the part exposed in bwd_ms (drawn only)
        self.host = (
            (spec.host_ms[s], spec.host_exposed_ms[s] if spec.host_exposed_ms else 0.0)
            if spec.host_ms and spec.host_ms[s] > 0.0
            else None
        )
        # compute intervals in time order (one task at a time): flat float arrays, not a tuple
        # of two float objects per task (10,000 GPUs x 400 tasks)
        self.starts = array("d")
        self.ends = array("d")
        self.max_in_flight = 0
        # this stage's own pulls, oldest first: (global clock pulled, when it arrived, ms)
        self.pulls: list[tuple[int, float]] = []
        # D = 0: whether the first update after a push waits for the pull that follows it
        # (:func:`planner.wsp.folds_at_update`), and the backward whose update waits for a
        # pull not started yet, with when it computed (ms; -1: it computes after the pull)
        self.folds = False
        self.parked: tuple[Task, float] | None = None


class VWState:
    """Mutable per-VW state of one simulation run (private to the event loop)."""

    __slots__ = (
        "admitted",
        "completions",
        "in_flight",
        "n",
        "need",
        "next_push_wave",
        "pulled",
        "pulling",
        "pushed",
        "spec",
        "stages",
        "v",
        "wait_start",
        "waits",
    )

    def __init__(self, spec: PipelineSpec, v: int, links: Links, schedule: Schedule) -> None:
        n = spec.n_stages
        self.v = v
        self.spec = spec
        self.n = n
        own = links.new(n)
        self.stages = [StageState(spec, v, s, links, own, schedule) for s in range(n)]
        self.admitted = 0
        self.in_flight = 0
        self.pulled = 0  # global clock held locally
        self.wait_start = -1.0  # >= 0 while admission is blocked by WSP
        self.need = 0  # global clock the blocked admission needs
        self.pulling = False
        self.pushed = [0]  # per wave: stages whose push arrived
        self.next_push_wave = 0
        self.completions: list[float] = []
        self.waits: list[tuple[float, float]] = []
