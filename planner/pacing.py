"""Whether emulated devices can be paced on a machine: the rule ``hetpipe run`` refuses by and
``hetpipe plan`` warns by.

An emulated device of relative speed ``s`` runs each task's real, single-threaded computation
(its solo time ``t``), then waits until ``t / s`` has passed (``runtime/stage/emulation.py``):
it keeps one core busy a fraction ``s`` of the time. So devices running at once need
``sum(s)`` cores, and one device faster than a core (``s > 1``) can never be paced: its real
computation alone overruns its target. Within the limit, pacing is accurate to 1-2 % only while
``sum(s)`` stays well under the core count (the stages' messages, the parameter-server shards
and Python need CPU too): the limit is what cannot work, not what works well.
"""

from __future__ import annotations

from collections.abc import Sequence

from profiler.errors import ConfigError

__all__ = ["pacing_problem"]


def pacing_problem(devices: Sequence[tuple[str, float]], cores: int) -> str | None:
    """What makes these emulated devices, running at once, impossible to pace on ``cores``
    cores (``None``: nothing).

    Args:
        devices: ``(label, speed)`` of every emulated device that runs at once (speed > 0).
        cores: the machine's cores (``os.cpu_count()``).

    >>> pacing_problem([("V:0", 0.5), ("R:0", 0.6)], 2) is None
    True
    >>> print(pacing_problem([("V:0", 0.9), ("R:0", 0.9), ("G:0", 0.9)], 2))
    the emulated devices that run at once need 2.7 cores (the sum of their speeds) but this machine has 2
    >>> print(pacing_problem([("V:0", 1.5)], 4))
    device V:0 has speed 1.5: faster than one core, its computation alone overruns its target
    """
    if cores < 1:
        raise ConfigError(f"cannot pace emulated devices on {cores} cores")
    for label, speed in devices:
        if speed > 1:
            return (
                f"device {label} has speed {speed:g}: faster than one core, its computation "
                "alone overruns its target"
            )
    demand = sum(speed for _, speed in devices)
    if demand > cores:
        return (
            f"the emulated devices that run at once need {demand:.3g} cores (the sum of their "
            f"speeds) but this machine has {cores}"
        )
    return None
