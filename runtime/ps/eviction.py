"""Eviction of a lost VW at a parameter-server shard (``--on-failure continue``).

Eviction (``--on-failure continue``, GaDei Sec. 4.3): with ``peers`` (the other shards' ids),
a wave is applied only once every member VW's push of it is complete at *every* shard (each
shard reports its VW clocks to the others, :meth:`PeerEviction.peer_report`), so no shard ever
folds a wave that another shard may lack. A VW whose client died is :meth:`PeerEviction.lose`-t;
once no more of its pushes can arrive here (:meth:`PeerEviction.end_pushes`) and every shard has
said so, every shard computes the same cut ``min over shards of its VW clock``: its waves
below the cut are in everywhere, the buffered ones at or above it are discarded once, and the
global clock stops waiting for it (:class:`Eviction`).

Restart of the lost VW (``--on-failure restart``, the core built with ``rejoin``): the cut and
the discarded pushes are the same, but the VW stays a member: its clock goes back to the cut
at every shard and a new *incarnation* (the restarted processes) pushes the waves from the cut
on, so the global clock waits for it there (:meth:`PeerEviction.incarnation`). Reports carry
each VW's incarnation; a shard ignores a peer's entries of an older one. When no restart comes
(the budget is spent), :meth:`PeerEviction.release` evicts it at that cut, as ``continue`` does.

:class:`PeerEviction` is the eviction half of :class:`runtime.ps.core.ShardCore` (its base):
it reads and updates the core's state, declared below, and asks the core to apply what became
ready (``_advance``).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch

from planner.wsp import GlobalClock
from profiler.errors import ConfigError
from runtime.ps.layout import ShardSpec
from runtime.ps.outcome import Eviction

__all__ = ["PeerEviction"]

log = logging.getLogger(__name__)


class PeerEviction:
    """The eviction half of :class:`runtime.ps.core.ShardCore` (whose constructor sets this state)."""

    spec: ShardSpec
    _gclock: GlobalClock
    _pending: dict[int, dict[tuple[int, int], tuple[torch.Tensor, int]]]
    _vw_index: dict[int, int]
    _vw_keys: list[list[tuple[int, int]]]
    _peer_clocks: dict[int, list[int]]  # what the other shards reported, VW index order
    _peer_final: dict[int, list[bool]]
    _lost: set[int]  # VW indices with a dead client
    _ended: set[tuple[int, int]]  # clients whose pushes can no longer arrive
    _cut: dict[int, int]  # evicted VW index -> first wave left out
    evictions: list[Eviction]
    _rejoin: bool  # restart mode: a lost VW waits at its cut for its next incarnation
    _inc: list[int]  # each VW's incarnation (VW index order)
    _reopened: dict[int, int]  # VW index -> the wave its current incarnation starts at

    def local_clocks(self) -> tuple[int, ...]:
        """Each VW's clock at this shard (:meth:`runtime.ps.core.ShardCore.local_clocks`)."""
        raise NotImplementedError

    def _advance(self) -> int:
        """Apply what became ready (:meth:`runtime.ps.core.ShardCore._advance`)."""
        raise NotImplementedError

    def _committed(self, vi: int) -> int:
        """Waves of VW index ``vi`` complete at every shard (here and as the peers reported)."""
        return min([self._gclock.local(vi), *(c[vi] for c in self._peer_clocks.values())])

    def lose(self, vw: int) -> int:
        """VW ``vw`` lost a client (a process died): evict it once no more of its pushes can
        arrive anywhere (:meth:`end_pushes`, :meth:`peer_report`). Returns waves applied."""
        if vw in self._vw_index:
            self._lost.add(self._vw_index[vw])
        return self._settle()

    def end_pushes(self, vw: int, stage: int) -> int:
        """Client ``(vw, stage)`` sends no more pushes (its stream ended). Returns waves applied."""
        self._ended.add((vw, stage))
        return self._settle()

    def report(self) -> tuple[tuple[int, ...], tuple[bool, ...], tuple[int, ...]]:
        """What this shard tells its peers: each VW's clock here, whether it is final (the
        VW is lost and none of its pushes can arrive here any more) and its incarnation, VW
        id order."""
        final = tuple(
            vi in self._lost and all(k in self._ended for k in self._vw_keys[vi])
            for vi in range(len(self.spec.vws))
        )
        return self.local_clocks(), final, tuple(self._inc)

    def peer_report(
        self,
        shard: int,
        clocks: Sequence[int],
        final: Sequence[bool],
        incs: Sequence[int] | None = None,
    ) -> int:
        """Shard ``shard``'s :meth:`report` arrived. Returns waves applied. A VW's entries of
        an older incarnation than this shard's are ignored (``incs`` ``None``: the same); a
        newer one means the peer reopened it, which it does only once the VW was final at
        every shard: it counts as the peer's final flag (the one it may not have sent, as it
        became final and reopened at once).

        Raises:
            ConfigError: not a peer, or a report of another VW count (a wiring bug).
        """
        n = len(self.spec.vws)
        incs = self._inc if incs is None else incs
        if shard not in self._peer_clocks or not len(clocks) == len(final) == len(incs) == n:
            raise ConfigError(
                f"shard {self.spec.id}: report of shard {shard} with {len(clocks)} VW clocks; "
                f"expected a peer in {sorted(self._peer_clocks)} with {n}"
            )
        for vi in range(n):
            if int(incs[vi]) > self._inc[vi]:  # it reopened the VW: it had every shard's final
                self._peer_final[shard][vi] = True  # flag, its own too (sent or not)
                continue
            if int(incs[vi]) < self._inc[vi]:
                continue  # an older incarnation's: stale
            self._peer_clocks[shard][vi] = max(self._peer_clocks[shard][vi], int(clocks[vi]))
            self._peer_final[shard][vi] = self._peer_final[shard][vi] or bool(final[vi])
        return self._settle()

    def incarnation(self, vw: int) -> int:
        """VW ``vw``'s incarnation: 0, +1 at every restart (``rejoin``)."""
        return self._inc[self._vw_index[vw]]

    def rejoin_wave(self, vw: int) -> int | None:
        """The wave VW ``vw``'s current incarnation starts at (``None``: never restarted)."""
        return self._reopened.get(self._vw_index[vw])

    def release(self, vw: int) -> int:
        """No restart of VW ``vw`` will come (the budget is spent): evict it at the wave its
        waiting incarnation was to start at, the same at every shard (that incarnation never
        pushed). Returns waves applied."""
        vi = self._vw_index[vw]
        if vi in self._reopened and vi not in self._cut:
            self._cut[vi] = self._reopened[vi]
            log.warning("shard %d: vw %d not restarted: evicted at wave %d",
                        self.spec.id, vw, self._cut[vi])  # fmt: skip
        return self._advance()

    def _settle(self) -> int:
        """Evict every lost VW that is final at every shard (the same cut everywhere), then
        apply what became ready."""
        final_here = self.report()[1]
        for vi in sorted(self._lost - self._cut.keys()):
            if final_here[vi] and all(f[vi] for f in self._peer_final.values()):
                cut, dropped = self._committed(vi), 0
                for w in [w for w in self._pending if w >= cut]:
                    for k in self._vw_keys[vi]:
                        dropped += self._pending[w].pop(k, None) is not None
                self.evictions.append(Eviction(self.spec.vws[vi], cut, dropped))
                log.warning("shard %d: vw %d evicted at wave %d (%d buffered pushes discarded)",
                            self.spec.id, self.spec.vws[vi], cut, dropped)  # fmt: skip
                if self._rejoin:
                    self._reopen(vi, cut)
                else:
                    self._cut[vi] = cut
        return self._advance()

    def _reopen(self, vi: int, cut: int) -> None:
        """Restart mode: VW index ``vi`` stays a member; its next incarnation starts at
        ``cut`` (its clock goes back there here and in what the peers reported)."""
        self._inc[vi] += 1
        self._lost.discard(vi)
        self._ended.difference_update(self._vw_keys[vi])
        self._gclock.rewind(vi, cut)
        for p in self._peer_clocks:
            self._peer_clocks[p][vi], self._peer_final[p][vi] = cut, False
        self._reopened[vi] = cut

    @property
    def waiting_on_eviction(self) -> bool:
        """A VW is lost but not evicted yet (the shard must keep serving until it is)."""
        return bool(self._lost - self._cut.keys())

    @property
    def left_out(self) -> dict[int, int]:
        """VWs evicted for good (``continue``, or a restart that did not come): VW -> its cut."""
        return {self.spec.vws[vi]: cut for vi, cut in self._cut.items()}

    @property
    def unsettled(self) -> bool:
        """A lost VW is not evicted yet, or pushes wait for a wave to be applied."""
        return self.waiting_on_eviction or any(self._pending.values())
