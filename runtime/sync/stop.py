"""A time limit that every virtual worker obeys at the same wave (runs with parameter servers).

Without parameter servers a stage 0 simply stops admitting minibatches when its time is up. With
several VWs under WSP that would strand the others: the global clock is the minimum over VWs, so
a VW that stops early leaves every other VW blocked in a pull for a wave that never comes. So the
first VW whose time is up proposes a final wave count (``planner.wsp.stop_wave``) through a
``torch.distributed`` store (first writer wins: ``compare_set``); every VW's stage 0 polls the
store and, once a value is there, runs exactly that many waves. The downstream stages learn the
end from stage 0's stop message as usual. The rules' stage hooks (``wave``, ``backup``,
``elastic``: ``agreed_total``) make the agreement, so it lives beside them, below the launcher.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import torch.distributed as dist
from torch._C._distributed_c10d import FileStore, Store

from planner.wsp import stop_wave

__all__ = ["LazyStop", "StopAgreement", "file_store", "stop_store"]

log = logging.getLogger(__name__)

KEY = "hetpipe/stop_wave"


def file_store(path: str) -> Store:
    """A store in the file ``path`` (every process of one host opens the same file)."""
    return FileStore(path, -1)


def stop_store(init_method: str) -> Store:
    """Where the VWs agree on the stop wave: a file beside a one-host run's rendezvous file,
    else (torchrun, ``env://``) the process group's own store, which every host reaches."""
    if init_method.startswith("file://"):
        return file_store(init_method.removeprefix("file://") + ".stop")
    return dist.distributed_c10d._get_default_store()


class StopAgreement:
    """Stage 0's view of the run-wide stop decision.

    Args:
        store: a store shared by every VW's stage 0 (e.g. a ``dist.FileStore``).
        nm: minibatches per wave.
        D: WSP threshold.
        poll_s: seconds between looks at the store while this VW's own time is not up.
        clock: monotonic clock (injected by tests).
        waves: the rule's stop: admitted minibatches -> waves every VW runs (default WSP's
            :func:`planner.wsp.stop_wave` with ``D``; EASGD's :func:`planner.easgd.stop_waves`).
    """

    def __init__(
        self,
        store: Store,
        nm: int,
        D: int,
        poll_s: float = 0.05,
        clock: Callable[[], float] = time.monotonic,
        waves: Callable[[int], int] | None = None,
    ) -> None:
        self.store, self.nm, self.D = store, nm, D
        self._waves = waves if waves is not None else lambda a: stop_wave(a, nm, D)
        self.poll_s, self.clock = poll_s, clock
        self._next_poll = 0.0
        self.waves: int | None = None  # the agreed number of waves, once known

    def total(self, admitted: int, time_up: bool) -> int | None:
        """Minibatches this VW must run in all, or ``None`` while no VW's time is up.

        Args:
            admitted: minibatches this VW's stage 0 has admitted so far.
            time_up: whether this VW's own time limit has passed.
        """
        if self.waves is None:
            if time_up:
                proposal = self._waves(admitted)
                agreed = self.store.compare_set(KEY, "", str(proposal))
                self.waves = int(agreed)
                log.info("time limit: proposed %d waves, agreed %d", proposal, self.waves)
            elif self.clock() >= self._next_poll:
                self._next_poll = self.clock() + self.poll_s
                if self.store.check([KEY]):
                    self.waves = int(self.store.get(KEY))
                    log.info("time limit of another VW: stopping after %d waves", self.waves)
        return None if self.waves is None else self.waves * self.nm


class LazyStop:
    """A :class:`StopAgreement` made on first use, beside the run's rendezvous: what a rule
    whose VWs must stop at one agreed wave answers in ``StageSync.agreed_total`` (only stage 0
    of a time-limited run asks, so no store is opened otherwise)."""

    def __init__(
        self, init_method: str, nm: int, D: int, waves: Callable[[int], int] | None = None
    ) -> None:
        self.init_method, self.nm, self.D, self.waves = init_method, nm, D, waves
        self._agreement: StopAgreement | None = None

    def total(self, admitted: int, time_up: bool) -> int | None:
        """:meth:`StopAgreement.total` of the agreement (made now if need be)."""
        if self._agreement is None:
            store = stop_store(self.init_method)
            self._agreement = StopAgreement(store, self.nm, self.D, waves=self.waves)
        return self._agreement.total(admitted, time_up)
