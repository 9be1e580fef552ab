"""Test hooks that make a process fail on purpose, passed in its frozen job (never a string
in a production signature): a stage that crashes, freezes, raises, straggles or diverges, a
shard that dies. The snapshot writer's hook is :class:`runtime.persist.snapshot.WriteFault`.

Test support, not a launcher part: the run's options (:mod:`runtime.config`), the stage's job
(:mod:`runtime.stage.job`) and the shard's job carry these, and the launcher only hands them
on, so they sit below all three (``tests/test_layers.py``: no lower layer imports the
launcher)."""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

__all__ = ["ShardFault", "StageFault"]


@dataclass(frozen=True)
class StageFault:
    """Test hook, passed in the job description: stage ``stage`` of VW ``vw`` (every VW when
    ``vw`` is -1) sends itself ``signum`` before minibatch ``at_mb`` (SIGKILL: a crash;
    SIGSTOP: a frozen process; 0: it raises ``RuntimeError``, a failure in Python; ``at_mb``
    0: never). A VW restarted alone (``--on-failure restart``) keeps the fault only with
    ``repeat``. ``delays`` are injected stragglers: ``(vw, minibatch, seconds)``, stage
    ``stage`` of that VW sleeps that long before the minibatch's first task.
    ``rejoin_delay_s``: every process of a restarted VW sleeps that long before it rejoins (a
    restart on a loaded host, slower than the timeout). ``nonfinite``: no signal, the stage's
    loss (the last stage) or its weight gradients (another stage) become NaN at ``at_mb``
    instead (:meth:`nan_at`), a run that diverges there. ``after_s`` (> 0): a loss at
    start-up instead of at a minibatch: the stage sends itself ``signum`` that many seconds
    after its process started, and waits for it before joining the process group (the others
    wait in the rendezvous), or with ``joined`` at its first minibatch (the group formed, no
    wave pushed), so the fault lands in that phase whatever the load."""

    stage: int
    at_mb: int
    vw: int = -1
    signum: int = int(signal.SIGKILL)
    delays: tuple[tuple[int, int, float], ...] = ()
    repeat: bool = False
    rejoin_delay_s: float = 0.0
    nonfinite: bool = False
    after_s: float = 0.0
    joined: bool = False

    def nan_at(self, vw: int, stage: int) -> int:
        """The minibatch whose loss or gradients ``(vw, stage)`` makes NaN (0: none)."""
        hit = self.nonfinite and stage == self.stage and self.vw in (-1, vw)
        return self.at_mb if hit else 0

    def start_up(self, vw: int, stage: int) -> Callable[[], None] | None:
        """Start the start-up fault's timer in stage ``stage`` of VW ``vw``'s process; the
        hold to run before it joins the group (``None``: none, or another stage)."""
        if self.after_s <= 0 or stage != self.stage or self.vw not in (-1, vw):
            return None
        timer = threading.Timer(self.after_s, os.kill, (os.getpid(), self.signum))
        timer.daemon = True
        timer.start()
        return None if self.joined else _held

    def hook(self, vw: int, stage: int) -> Callable[[int], None] | None:
        """The stage worker's per-minibatch fault hook for ``(vw, stage)``, or ``None``."""
        if stage != self.stage:
            return None
        sleeps = {mb: s for v, mb, s in self.delays if v == vw}
        if self.vw not in (-1, vw) and not sleeps:
            return None

        def fire(mb: int) -> None:
            if mb in sleeps:
                time.sleep(sleeps.pop(mb))  # once: a stage runs F and B of a minibatch
            if self.vw not in (-1, vw) or self.nonfinite:
                return
            if self.after_s > 0 and self.joined and mb == 1:
                _held()
            if mb == self.at_mb and self.signum == 0:
                raise RuntimeError(f"injected fault at minibatch {mb}")
            if mb == self.at_mb:
                os.kill(os.getpid(), self.signum)

        return fire


def _held() -> None:
    """Wait for the start-up fault's signal (it never returns)."""
    threading.Event().wait()


@dataclass(frozen=True)
class ShardFault:
    """Test hook, passed in the shard's job: shard ``shard`` SIGKILLs itself ``after_s``
    seconds after it starts (0: never), and waits ``lag_s`` before it applies each wave
    another shard decided (backup workers: it lags behind its peers, so pulls find the
    shards at different clocks)."""

    shard: int
    after_s: float = 0.0
    lag_s: float = 0.0

    def lag(self, shard_id: int) -> float:
        """Shard ``shard_id``'s lag before each decided wave (s)."""
        return self.lag_s if shard_id == self.shard else 0.0

    def arm(self, shard_id: int) -> None:
        """Start the timer in shard ``shard_id``'s process (nothing for another shard)."""
        if shard_id == self.shard and self.after_s > 0:
            timer = threading.Timer(self.after_s, os.kill, (os.getpid(), signal.SIGKILL))
            timer.daemon = True
            timer.start()
