"""A reproducible straggler model for emulated devices, shared by the simulator and the runtime.

``emulate: {speed: 0.2, memory: 8MiB, straggle: {p: 0.05, factor: 3}}`` in cluster.yaml makes
each (virtual worker, wave) of that node's devices a straggler with probability ``p``: every task
of that VW's wave on those devices takes ``factor`` times its paced time. The draw is a pure
function of ``(seed, vw, wave)`` (:func:`uniform`), so

- the emulated device (``runtime.stage.emulation`` pacing ``factor x t_solo``) and the
  simulator's prediction (:mod:`planner.sim.waves`) slow down exactly the same waves;
- every stage of a VW draws the same number: with the same ``p`` on every node the whole VW
  runs slower in that wave (the seed's "a VW runs 3x slower"), as a contended or preempted
  machine would, instead of one stage at random;
- a run is reproducible: same seed, same stragglers, whatever the timing.

Example (10 % stragglers, 3x slower):

>>> s = Straggle(p=0.1, factor=3.0, seed=0)
>>> [s.slowdown(0, c) for c in range(12)]
[1.0, 3.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0]
>>> round(sum(s.slowdown(v, c) > 1 for v in range(4) for c in range(1000)) / 4000, 2)
0.1
>>> NO_STRAGGLE.slowdown(3, 7)
1.0
"""

from __future__ import annotations

import hashlib
import struct
from dataclasses import dataclass

__all__ = ["NO_STRAGGLE", "Straggle", "uniform"]


def uniform(seed: int, vw: int, wave: int) -> float:
    """A number in ``[0, 1)`` that depends only on ``(seed, vw, wave)`` (stable across
    processes, Python versions and ``PYTHONHASHSEED``: the first 8 bytes of a BLAKE2b digest).

    >>> uniform(0, 1, 2) == uniform(0, 1, 2) != uniform(0, 2, 1)
    True
    """
    digest = hashlib.blake2b(f"{seed}:{vw}:{wave}".encode(), digest_size=8).digest()
    return (struct.unpack("<Q", digest)[0] >> 11) / float(1 << 53)


@dataclass(frozen=True)
class Straggle:
    """Per-(VW, wave) slowdown distribution of an emulated node.

    Attributes:
        p: probability that a VW's wave straggles (0 = never).
        factor: how many times slower a straggling wave's tasks run (>= 1).
        seed: seed of the draws (the run's seed by default in the runtime).
    """

    p: float = 0.0
    factor: float = 1.0
    seed: int = 0

    def __post_init__(self) -> None:
        if not 0.0 <= self.p <= 1.0:
            raise ValueError(f"straggle p must be in [0, 1], got {self.p}")
        if not self.factor >= 1.0:
            raise ValueError(f"straggle factor must be >= 1, got {self.factor}")

    @property
    def active(self) -> bool:
        """Whether any wave can straggle."""
        return self.p > 0 and self.factor > 1

    def straggles(self, vw: int, wave: int) -> bool:
        """Whether ``vw``'s wave ``wave`` (0-based) is a straggler."""
        return self.active and uniform(self.seed, vw, wave) < self.p

    def slowdown(self, vw: int, wave: int) -> float:
        """Time multiplier of ``vw``'s tasks in ``wave``: ``factor`` or 1."""
        return self.factor if self.straggles(vw, wave) else 1.0

    def with_seed(self, seed: int) -> Straggle:
        """The same distribution drawn with another seed."""
        return Straggle(self.p, self.factor, seed)


NO_STRAGGLE = Straggle()
