"""WSP parameter-server shards (paper Sec. 5 and 8.1): the shard process and the wire protocol.

A shard holds the global weights of its layers as one flat tensor. Every stage of every
virtual worker (VW) that owns some of those layers is a *client* of the shard. At the end
of wave ``c`` (``Nm`` minibatches) each client pushes its aggregated update for wave ``c``
as one flat message (its slice of the shard, in shard order). The shard

- keeps an exactly-once *ledger* keyed ``(vw, stage, wave)``: a duplicate tag is rejected,
  a push of a later wave while an earlier one is missing is buffered, and a push further
  ahead than WSP allows (``wave > global_clock + D``) is rejected as a protocol violation;
- applies wave ``c`` once every client of every VW has pushed wave ``c``: the updates are
  added to the global weights in ``(vw, stage)`` order (so the floating-point result does not
  depend on arrival order), or their sum goes through server-side momentum, and the global
  clock becomes ``c + 1``;
- answers a pull ``(min_clock)`` once its global clock is ``>= min_clock`` with the client's
  slice of the global weights, which then hold exactly the updates of waves ``0..clock-1``.

The global clock is per shard (GeePS's per-shard clocks): a VW's clock at a shard is the
number of consecutive waves all of its clients there have pushed, the shard's global clock
is the minimum over VWs (:class:`planner.wsp.GlobalClock` semantics). With clients that admit
minibatch ``p`` only when :func:`planner.wsp.required_global_clock` holds, a push of wave ``c``
happens at global clock ``>= c - D``, so the clock distance (fastest VW clock minus global
clock) never exceeds ``D + 1``; every accepted push is recorded in :attr:`ShardCore.trace` so
tests can check that bound.

:class:`ShardCore` (in :mod:`runtime.ps.core`) is pure and unit-tested on its own;
:class:`ShardServer` runs it in a shard process over torch.distributed point-to-point
messages (gloo), with reader threads per client (:mod:`runtime.ps.inbox`). The wire protocol,
shared with :mod:`runtime.ps.client`, is :mod:`runtime.ps.wire`.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from profiler.errors import HetPipeRuntimeError
from runtime.persist.checkpoint import ShardState, shard_payload
from runtime.persist.snapshot import SnapshotSpec, leave_out, write_part
from runtime.ps.core import ShardCore
from runtime.ps.inbox import Event, peer_link, push_reader, quorum_link, request_reader, wait
from runtime.ps.layout import ClientSpec
from runtime.ps.outcome import Status
from runtime.ps.peers import IntLink
from runtime.ps.readmit import Readmission
from runtime.ps.rejoin import Rejoin
from runtime.ps.wire import (
    HEADER_BYTES,
    NO_PULL,
    NO_PUSH,
    TAG_ACK,
    TAG_PULL_DATA,
    TAG_PULL_HEADER,
    isend,
    one_message_pull,
    pull_message,
)

__all__ = ["ShardServer"]

log = logging.getLogger(__name__)


@dataclass
class _Pulls:
    """One client's pull requests not answered yet: ``seq -> min clock``, the next seq, and
    ``seq -> status`` of the push each pull rode on (acknowledged in the pull's reply)."""

    waiting: dict[int, int] = field(default_factory=dict)
    next: int = 0
    rode: dict[int, int] = field(default_factory=dict)


class ShardServer:
    """Runs a :class:`ShardCore` in the shard's process, serving its clients over gloo p2p.

    Two daemon threads per client block on that client's next push message and next
    standalone request (pull, bye) and queue them; the calling thread owns the core, applies pushes, acknowledges
    each push and answers pulls, per client in request order, once the clock allows.

    Args:
        core: the shard state machine.
        group: process group holding the shard and its clients (``None``: the default group).
        timeout_s: longest wait for one message to complete once started (a payload after its
            header, a reply send).
        idle_timeout_s: longest time without any request from any client; then the shard
            names the stuck stages (those of the slowest VWs with no pull waiting) and raises.
            It must exceed the slowest wave time (default 10x ``timeout_s``). A client that
            dies is detected at once anyway (its connection closes).
        snapshots: where and how often the shard writes its part of each snapshot (every
            ``snapshots.every`` clocks and at the end; ``None``: never).
        peer_ranks: eviction mode (``--on-failure continue``; the core built with the same
            peers): shard id -> rank of every other shard. A lost client then evicts its VW
            (:meth:`ShardCore.lose`) instead of ending the shard; ``None``: it ends the shard.
        rejoin: restart mode (``--on-failure restart``; with ``peer_ranks``, the core built
            with ``rejoin``): a lost VW's restarted processes are served again
            (:class:`runtime.ps.readmit.Readmission`).
        quorum_ranks: backup workers: shard id -> rank of the other shards the wave
            decisions go to (this shard decides) or come from.
        lag_s: test hook: apply each wave another shard decided this much later (the
            decisions arrive late; pulls are still answered meanwhile).
    """

    def __init__(
        self,
        core: ShardCore,
        group: dist.ProcessGroup | None = None,
        timeout_s: float = 60.0,
        snapshots: SnapshotSpec | None = None,
        idle_timeout_s: float | None = None,
        peer_ranks: Mapping[int, int] | None = None,
        rejoin: Rejoin | None = None,
        quorum_ranks: Mapping[int, int] | None = None,
        lag_s: float = 0.0,
    ) -> None:
        self.core, self.group, self.timeout_s = core, group, timeout_s
        self.lag_s = lag_s  # test hook (runtime.faults.ShardFault): a lagging shard
        self.rejoin = rejoin
        self._events: queue.Queue[Event] = queue.Queue()
        self._pulls = [_Pulls() for _ in core.spec.clients]
        self._done: set[int] = set()  # clients that said BYE (or are gone)
        self._rejoins = (
            Readmission(core, rejoin, self._reset_client, self._start_incarnation, self._release)
            if rejoin is not None
            else None
        )
        self.peer_ranks = peer_ranks
        self.quorum_ranks = quorum_ranks
        self._gone: set[tuple[int, int]] = set()  # eviction mode: clients lost
        self.idle_timeout_s = 10 * timeout_s if idle_timeout_s is None else idle_timeout_s
        self.snapshots = snapshots
        self._written = core.clock  # the clock of the last part written (or resumed from)
        self._marked: set[int] = set()  # VWs left out, recorded beside the snapshots
        self._sends: list[tuple[dist.Work, torch.Tensor, ClientSpec, int]] = []
        # receive buffers, recycled once their wave is applied: fresh multi-MB tensors cost
        # page faults that are slower than the copy itself
        self._free: list[queue.SimpleQueue[torch.Tensor]] = [
            queue.SimpleQueue() for _ in core.spec.clients
        ]
        self._held: dict[tuple[int, int], torch.Tensor] = {}  # (client index, wave) -> buffer
        self._prefix = f"[shard {core.spec.id} | rank {core.spec.rank}]"

    def start_readers(self, idx: int, events: queue.Queue[Event], group: Any, inc: int) -> None:
        """Start client ``idx``'s two reader threads on ``group`` (its incarnation ``inc``)."""
        c = self.core.spec.clients[idx]
        numel = self.core.spec.client_numel(c)
        readers: tuple[tuple[str, Callable[..., None], tuple[Any, ...]], ...] = (
            ("req", request_reader, (idx, c, events, group, inc)),
            ("push", push_reader, (idx, c, numel, self._free[idx], events, group, inc)),
        )
        for kind, target, args in readers:
            name = f"ps{self.core.spec.id}-vw{c.vw}s{c.stage}-{kind}{inc or ''}"
            threading.Thread(target=target, args=args, daemon=True, name=name).start()

    def _send(self, tensor: torch.Tensor, client: ClientSpec, tag: int) -> None:
        key = (client.vw, client.stage)
        if self._vw_lost(client.vw):
            return  # a lost VW's other stages are being stopped: nothing to answer
        inc = self.core.incarnation(client.vw) if self.rejoin is not None else 0
        try:
            group = self._rejoins.groups.get(key, self.group) if self._rejoins else self.group
            work = isend(tensor, dst=client.rank, group=group, tag=tag)
        except RuntimeError as exc:
            self._failed(client, str(exc), inc)
            return
        self._sends.append((work, tensor, client, inc))

    def _failed(self, c: ClientSpec, why: str, inc: int = 0) -> None:
        """A client's connection failed: evict its VW in eviction mode, else raise (a
        failure of an earlier incarnation of a restarted VW is old news: ignored)."""
        if self.peer_ranks is None:
            raise self._lost(c, why)
        if self.rejoin is not None and inc != self.core.incarnation(c.vw):
            return
        if (c.vw, c.stage) not in self._gone:
            log.warning("%s vw %d stage %d lost (%s): evicting vw %d", self._prefix, c.vw,
                        c.stage, why.splitlines()[0][:200], c.vw)  # fmt: skip
        self._gone.add((c.vw, c.stage))
        self.core.lose(c.vw)

    def _vw_lost(self, vw: int) -> bool:
        """Eviction mode: a client of ``vw`` is lost (its other stages are being stopped)."""
        return any(v == vw for v, _ in self._gone)

    def _drain_sends(self, block: bool) -> None:
        still = []
        for work, t, client, inc in self._sends:
            try:
                stale = self.rejoin is not None and inc != self.core.incarnation(client.vw)
                if block and (self._vw_lost(client.vw) or stale):
                    still.append((work, t, client, inc))  # never block on a lost VW's peer:
                    continue  # its death may not show on this pair before the timeout
                if block:
                    wait(work, self.timeout_s)
                elif not work.is_completed():
                    still.append((work, t, client, inc))
            except RuntimeError as exc:
                self._failed(client, str(exc), inc)
        self._sends = still

    def _lost(self, c: ClientSpec, why: str) -> HetPipeRuntimeError:
        return HetPipeRuntimeError(
            f"{self._prefix} lost client vw {c.vw} stage {c.stage} (rank {c.rank}): {why.splitlines()[0][:200]}; "
            "that stage process died or hung: stop the run and resume from the last checkpoint"
        )

    def serve(self) -> ShardState:
        """Serve until every client said BYE; return the final state.

        Raises:
            HetPipeRuntimeError: a client died or went silent, naming it (the caller exits
                non-zero so the launcher stops the run).
        """
        spec, core = self.core.spec, self.core
        events, pulls, done = self._events, self._pulls, self._done
        for i in range(len(spec.clients)):
            self.start_readers(i, events, self.group, 0)
        link = peer_link(self.peer_ranks, core, self.group, events)
        decided: Any = _Delayed(events, self.lag_s) if self.lag_s > 0 else events
        qlink = quorum_link(self.quorum_ranks, core, self.group, decided)
        log.info(
            "%s serving %d clients, %d elements, clock %d",
            self._prefix,
            len(spec.clients),
            spec.numel,
            core.clock,
        )
        while len(done) < len(spec.clients) or any(q.waiting for q in pulls) or self._unsettled():
            try:
                ev = events.get(timeout=self.idle_timeout_s)
            except queue.Empty:
                raise self._stuck(pulls) from None
            applied = self._handle(ev, pulls, done)
            if qlink is not None:
                self._tell_decisions(qlink)
            if self._rejoins is not None:
                self._rejoins.follow()
            if link is not None:
                for i, c in enumerate(spec.clients):
                    if (c.vw, c.stage) in self._gone:
                        done.add(i)
                        pulls[i].waiting.clear()
                link.tell(core.report())
            if applied:
                self._answer_pulls(pulls)
                self._maybe_checkpoint(applied)
            self._drain_sends(block=False)
        self._drain_sends(block=True)
        if self.snapshots is not None and self.snapshots.every > 0 and core.clock > self._written:
            self._write_part()  # the final clock, whatever the period
        for lk in (link, qlink):
            if lk is not None:
                lk.drain(self.timeout_s)
        log.info(
            "%s done at clock %d: %d updates applied, %d rejected",
            self._prefix,
            core.clock,
            len(core.ledger),
            len(core.rejected),
        )
        return core.state()

    def _handle(self, ev: Event, pulls: list[_Pulls], done: set[int]) -> int:
        """One event; returns the waves it applied that are not checkpointed yet."""
        core = self.core
        if ev.kind == "peer":
            return core.peer_report(ev.arg, *ev.report)
        if ev.kind == "decision":
            return core.decide(ev.arg, ev.report[0])
        if ev.kind == "release":
            self._gone.update((c.vw, c.stage) for c in core.spec.clients if c.vw == ev.arg)
            return core.release(ev.arg)
        c = core.spec.clients[ev.client]
        if self.rejoin is not None and ev.inc != core.incarnation(c.vw):
            return 0  # an earlier incarnation's, read before its end was noticed
        if ev.kind == "error":
            self._failed(c, ev.error, ev.inc)
            return core.end_pushes(c.vw, c.stage) if ev.arg == 1 else 0
        if ev.kind == "last":
            return core.end_pushes(c.vw, c.stage) if self.peer_ranks is not None else 0
        if ev.kind == "push" and ev.message is not None:
            self._drain_sends(block=True)  # pull replies may be views of the weights
            payload = ev.message[HEADER_BYTES:].view(torch.float32)
            res = core.push(c.vw, c.stage, ev.arg, payload, copy=False)
            self._recycle(ev.client, ev.arg, ev.message, res.status == Status.OK)
            if ev.pull != NO_PULL:  # acknowledged by the pull's reply: no message of its own
                pulls[ev.client].waiting[ev.seq] = ev.pull
                pulls[ev.client].rode[ev.seq] = int(res.status)
            self._answer_pulls(pulls)  # replies first: a client may be blocked on one
            if ev.pull == NO_PULL:
                ack = torch.tensor([int(res.status), ev.arg, core.clock, 0], dtype=torch.int64)
                self._send(ack, c, TAG_ACK)
            if res.applied:
                self._maybe_checkpoint(res.applied)
        elif ev.kind == "pull":
            pulls[ev.client].waiting[ev.seq] = ev.arg
            self._answer_pulls(pulls)
        elif ev.kind == "bye":
            done.add(ev.client)
        return 0

    def _reset_client(self, idx: int) -> None:
        """Restart mode: client ``idx``'s VW was reopened; its next incarnation starts afresh."""
        c = self.core.spec.clients[idx]
        self._gone.discard((c.vw, c.stage))
        self._done.discard(idx)
        self._pulls[idx] = _Pulls()

    def _start_incarnation(self, idx: int, group: Any, inc: int) -> None:
        self.start_readers(idx, self._events, group, inc)

    def _release(self, vw: int) -> None:
        self._events.put(Event("release", -1, vw))

    def _tell_decisions(self, link: IntLink) -> None:
        vws = self.core.spec.vws
        for wave, counted in self.core.decisions():
            link.tell((wave, *(int(v in counted) for v in vws)))

    def _unsettled(self) -> bool:
        """Eviction mode: a lost VW not evicted yet, or buffered waves that wait for the
        other shards' reports (the shard keeps serving until they are applied)."""
        return self.peer_ranks is not None and self.core.unsettled

    def _stuck(self, pulls: list[_Pulls]) -> HetPipeRuntimeError:
        """The error when no client spoke for ``idle_timeout_s``: name the stages the global
        clock waits for (stages of the slowest VWs that are not waiting on a pull)."""
        core, spec = self.core, self.core.spec
        local = dict(zip(spec.vws, core.local_clocks(), strict=True))
        stuck = [
            f"vw {c.vw} stage {c.stage} (rank {c.rank})"
            for i, c in enumerate(spec.clients)
            if local[c.vw] == core.clock and not pulls[i].waiting
        ]
        return HetPipeRuntimeError(
            f"{self._prefix} no request from any client for {self.idle_timeout_s:.0f} s; global clock "
            f"{core.clock} waits for wave {core.clock} from {', '.join(stuck) or 'no one (all are pulling)'}, "
            "which hung or is slower than the idle timeout: stop the run and resume from the last checkpoint"
        )

    def _recycle(self, idx: int, wave: int, buf: torch.Tensor, kept: bool) -> None:
        """Return receive buffers the core no longer holds (rejected, or their wave applied)."""
        if kept:
            self._held[(idx, wave)] = buf
        else:
            self._free[idx].put(buf)
        for key in [k for k in self._held if k[1] < self.core.clock]:
            self._free[key[0]].put(self._held.pop(key))

    def _answer_pulls(self, pulls: list[_Pulls]) -> None:
        """Answer each client's waiting pulls in its pull order while the clock allows.

        A pull request travels on its own or inside a push message (two readers), so requests
        may arrive out of order; the client numbers them and replies go out strictly in that
        order, matching the receives the client posted. A pull riding on a rejected push is
        answered at once (the clock it waits for may never come): the client raises."""
        for i, q in enumerate(pulls):
            c = self.core.spec.clients[i]
            while q.next in q.waiting and (
                self.core.can_pull(q.waiting[q.next])
                or q.rode.get(q.next, Status.OK) not in (Status.OK, Status.DROPPED)
            ):
                del q.waiting[q.next]
                push = q.rode.pop(q.next, NO_PUSH)
                head = (int(Status.OK), self.core.clock, push, q.next)
                weights = self.core.read(c.vw, c.stage, copy=False)
                if one_message_pull(weights.numel()):
                    msg, hdr, payload = pull_message(weights.numel())
                    hdr.copy_(torch.tensor(head, dtype=torch.int64))
                    payload.copy_(weights)
                    self._send(msg, c, TAG_PULL_HEADER)
                else:
                    self._send(torch.tensor(head, dtype=torch.int64), c, TAG_PULL_HEADER)
                    self._send(weights, c, TAG_PULL_DATA)
                q.next += 1

    def _maybe_checkpoint(self, applied: int) -> None:
        snaps = self.snapshots
        if snaps is None or snaps.every <= 0:
            return
        clock = self.core.clock
        # a VW's clock moves by at most one per push (a client pushes its waves in order), so
        # ``applied`` is 0 or 1 and the state written is exactly the one of that clock
        if any((clock - k) % snaps.every == 0 for k in range(applied)):
            self._write_part()

    def _write_part(self) -> None:
        if self.core.waiting_on_eviction:
            return  # not settled yet (the clock waits for the cut anyway)
        if self.snapshots is not None:
            for vw, wave in self.core.left_out.items():  # before any part after its cut
                if vw not in self._marked:
                    leave_out(self.snapshots, vw, wave)
                    self._marked.add(vw)
            state = self.core.state()
            write_part(self.snapshots, state.clock, f"shard-{state.shard_id}", shard_payload(state))
            self._written = state.clock


class _Delayed:
    """Test hook (:class:`runtime.faults.ShardFault` ``lag_s``): hands every event
    ``put`` here to ``events`` ``lag_s`` later, in order (a shard that learns the decided
    waves late, while it goes on answering pulls)."""

    def __init__(self, events: queue.Queue[Event], lag_s: float) -> None:
        self._events, self._lag_s = events, lag_s
        self._held: queue.SimpleQueue[tuple[float, Event]] = queue.SimpleQueue()
        threading.Thread(target=self._forward, daemon=True, name="ps-delayed").start()

    def put(self, ev: Event) -> None:
        self._held.put((time.monotonic() + self._lag_s, ev))

    def _forward(self) -> None:
        while True:
            due, ev = self._held.get()
            time.sleep(max(0.0, due - time.monotonic()))
            self._events.put(ev)
