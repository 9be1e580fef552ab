"""A shard's side of restarting a lost VW (``--on-failure restart``).

:class:`runtime.ps.core.ShardCore` (built with ``rejoin``) reopens a lost VW at the agreed
cut and counts its incarnations; :class:`Readmission` follows that in the shard process:

1. when the core reopens VW ``k`` as incarnation ``n``, it publishes the wave ``n`` starts at
   (``vw<k>/inc<n>/wave``, :mod:`runtime.ps.rejoin`), resets the VW's clients (not done, no
   pull waiting) and waits, in a thread, for the launcher's decision;
2. ``restart``: it builds incarnation ``n``'s group and starts the clients' readers on it,
   so the new processes' pushes and pulls arrive like the old ones' (their events carry
   ``n``; an older incarnation's late events are dropped by the server);
3. ``release`` (no restart budget left): the core leaves the VW out from that cut
   (:meth:`runtime.ps.core.ShardCore.release`) and the shard stops waiting for it.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

from runtime.ps.core import ShardCore
from runtime.ps.rejoin import RESTART, Rejoin

__all__ = ["Readmission"]

log = logging.getLogger(__name__)

_DECISION_WAIT_S = 7 * 24 * 3600.0  # the launcher decides at once; if it dies, so does the shard


class Readmission:
    """Follows a shard core's incarnations (the server calls :meth:`follow` after each event).

    Args:
        core: the shard's core (built with ``rejoin``).
        rejoin: the rendezvous of restarted VWs.
        reset: ``(client index)``: forget a client's state (not done, no pull waiting).
        start: ``(client index, group, incarnation)``: start the client's readers.
        released: ``(vw)``: called from a thread when the launcher will not restart it (the
            server queues it as an event for its own thread).
    """

    def __init__(
        self,
        core: ShardCore,
        rejoin: Rejoin,
        reset: Callable[[int], None],
        start: Callable[[int, Any, int], None],
        released: Callable[[int], None],
    ) -> None:
        self.core, self.rejoin = core, rejoin
        self._reset, self._start, self._released = reset, start, released
        self._store = rejoin.store()
        self._known = dict.fromkeys(core.spec.vws, 0)
        self.groups: dict[tuple[int, int], Any] = {}  # (vw, stage) -> its incarnation's group

    def follow(self) -> None:
        """Act on every VW the core reopened since the last call."""
        for vw, known in self._known.items():
            inc = self.core.incarnation(vw)
            if inc == known:
                continue
            self._known[vw] = inc
            wave = self.core.rejoin_wave(vw)
            self._store.set(Rejoin.wave_key(vw, inc), str(wave))
            log.warning("shard %d: vw %d reopened at wave %d (incarnation %d)",
                        self.core.spec.id, vw, wave, inc)  # fmt: skip
            for i, c in enumerate(self.core.spec.clients):
                if c.vw == vw:
                    self.groups.pop((c.vw, c.stage), None)
                    self._reset(i)
            name = f"readmit-vw{vw}-inc{inc}"
            threading.Thread(target=self._await, args=(vw, inc), daemon=True, name=name).start()

    def _await(self, vw: int, inc: int) -> None:
        """The launcher's decision on incarnation ``inc`` of ``vw``, then act on it."""
        store = self.rejoin.store()  # this thread's own handle
        try:
            decision = self.rejoin.wait(store, Rejoin.decision_key(vw, inc), _DECISION_WAIT_S)
        except RuntimeError as exc:  # the store's folder is gone: the run is over
            log.debug("no decision on vw %d incarnation %d: %s", vw, inc, exc)
            return
        if decision != RESTART:
            self._released(vw)
            return
        group = self.rejoin.group(store, vw, inc, self.core.spec.rank)
        for i, c in enumerate(self.core.spec.clients):
            if c.vw == vw:
                self.groups[(c.vw, c.stage)] = group
                self._start(i, group, inc)
