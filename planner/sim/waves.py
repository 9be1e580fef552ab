"""Wave-level prediction of the synchronisation rules under the straggler model.

The pipeline simulator (:mod:`planner.sim.engine`) predicts each VW's steady wave time
``T_v`` (its ``Nm`` minibatches through its pipeline). This module plays the rules on whole
waves, each VW's wave ``c`` taking ``T_v x slowdown(v, c)`` (:class:`planner.straggle.Straggle`,
the same draws the emulated devices make), and returns when every VW pushed every wave (the
seed 003's Fig. 4: the time to collect the k-th push of each wave), which pushes were dropped,
and the throughput of the samples that reached the weights:

- ``wsp`` (threshold ``D``, :mod:`planner.wsp`): the first ``Nm - 1`` minibatches of wave ``c``
  need the global clock ``c - D - 1`` and its last one ``c - D``
  (:func:`planner.wsp.required_global_clock`), so a wave starts once wave ``c - D - 2`` is
  global and ends no sooner than one minibatch (``T_v x slowdown / Nm``) after wave ``c - D - 1``;
- ``backup`` (``b`` backups, :mod:`planner.backup`): the same gates with ``D = 0`` on the
  *closing* times, a wave closing with its ``N``-th push; a late VW's push is dropped, and
  when its pull is answered (once the wave it pushed closed) it continues at the current clock
  (:func:`planner.backup.continue_at`), its next data wave numbered by that clock. A VW's
  straggler draw is keyed by its *data* wave, as the emulated devices draw it, and the run
  ends when the global clock reaches ``waves``;
- ``easgd`` (every ``tau`` waves, :mod:`planner.easgd`): VWs run free between exchanges; at
  exchange ``k`` a VW waits until every VW made exchange ``k - 1`` (the centre it pulls holds
  them), i.e. a WSP clock over exchanges with ``D = 0``.

It ignores the push/pull transfer times (the pipeline simulator has them) and the pipeline
fill: a model of what the rule costs when devices straggle, not of the pipeline.

>>> from planner.straggle import Straggle
>>> slow = Straggle(p=0.2, factor=3.0, seed=1)
>>> wsp0 = play_waves("wsp", [10.0, 10.0, 10.0], 20, 4, slow)
>>> bk1 = play_waves("backup", [10.0, 10.0, 10.0], 20, 4, slow, backups=1)
>>> bk1.makespan_ms < wsp0.makespan_ms and bk1.dropped > 0 == wsp0.dropped
True
>>> play_waves("backup", [10.0] * 3, 5, 4).arrivals_ms == play_waves("wsp", [10.0] * 3, 5, 4).arrivals_ms
True
"""

from __future__ import annotations

import dataclasses
import heapq
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from planner.backup import Arrival, QuorumClock, continue_at
from planner.easgd import exchanges_after
from planner.straggle import NO_STRAGGLE, Straggle
from planner.wsp import required_global_clock
from profiler.errors import ConfigError

if TYPE_CHECKING:  # the rule registry imports this module's players: no planner.plan here
    from planner.plan import Plan
    from profiler.table import Profile

__all__ = [
    "Player",
    "WavePlay",
    "Waves",
    "plan_slowdown",
    "play_backup",
    "play_easgd",
    "play_waves",
    "play_wsp",
    "predict_rule",
    "vw_wave_ms",
]

Slowdown = Callable[[int, int], float]  # (vw, wave) -> time multiplier


@dataclass(frozen=True)
class WavePlay:
    """The waves of one rule, played.

    Attributes:
        rule: the rule played (:func:`play_waves` names it).
        arrivals_ms: per wave, the push times of the VWs that pushed it, sorted (k-th = the
            time to collect k pushes); dropped pushes included.
        closed_ms: per wave, when it reached the weights (the global clock passed it).
        counted: per wave, the VWs whose pushes reached the weights (VW id order).
        dropped: pushes dropped (backup only).
        applied: pushes that reached the weights.
        numbers: per VW, the wave number of each of its data waves it pushed (backup: a VW
            that jumped skips numbers; otherwise ``0, 1, 2, ...``).
        makespan_ms: when the last wave closed.
        nm: minibatches per wave.
    """

    rule: str
    arrivals_ms: tuple[tuple[float, ...], ...]
    closed_ms: tuple[float, ...]
    counted: tuple[tuple[int, ...], ...]
    dropped: int
    applied: int
    makespan_ms: float
    nm: int
    numbers: tuple[tuple[int, ...], ...] = ()

    def throughput(self, batch_size: int) -> float:
        """Samples/s that reached the weights (dropped pushes' samples are lost work)."""
        return self.applied * self.nm * batch_size / (self.makespan_ms / 1e3)


def _gate(closed: Sequence[float], wave: int) -> float | None:
    """Time wave ``wave`` was closed (0 for a negative one); ``None`` while still open."""
    if wave < 0:
        return 0.0
    return closed[wave] if wave < len(closed) else None


def _wave_number(last: int, clock: int, backups: int) -> int | None:
    """The wave a VW that pushed wave ``last`` (-1: none) trains next; ``None`` with backup
    workers until the pull after that push is answered (the quorum ``clock`` passed it)."""
    if backups and last >= 0:
        if clock <= last:  # numbered when its pull is answered (the VW runs on)
            return None
        return continue_at(last, clock)
    return last + 1


def _gates(closed: Sequence[float], c: int, nm: int, D: int) -> tuple[float, float] | None:
    """When wave ``c``'s first ``Nm-1`` minibatches may start (``G(c-D-1)`` waves closed) and
    when its last one may (``G(c-D)``); ``None``: a gate is not closed yet."""
    start = _gate(closed, required_global_clock(c * nm + 1, nm, D) - 1)
    end = _gate(closed, required_global_clock((c + 1) * nm, nm, D) - 1)
    if start is None or end is None:
        return None
    return start, end


def _play_clocked(
    wave_ms: Sequence[float], waves: int, nm: int, slowdown: Slowdown, D: int, backups: int
) -> WavePlay:
    """WSP (``backups = 0``) or backup workers (``D = 0``) as events in time order."""
    n = len(wave_ms)
    quorum = QuorumClock(n, backups)
    closed: list[float] = []
    arrivals: list[list[float]] = [[] for _ in range(waves)]
    # per VW: (data waves done, wave pushed last or -1, time it is free); the next wave's
    # number is known once the pull after that push is answered (continue_at)
    state = [(0, -1, 0.0)] * n
    numbers: list[list[int]] = [[] for _ in range(n)]
    heap: list[tuple[float, int, int]] = []
    blocked: set[int] = set()
    pushed = [0] * waves

    def schedule(v: int) -> None:
        d, last, free = state[v]
        c = _wave_number(last, quorum.clock, backups)
        if c is not None and c >= waves:
            return
        gates = None if c is None else _gates(closed, c, nm, D)
        if c is None or gates is None:  # rescheduled at a close (it still starts at ``free``)
            blocked.add(v)
            return
        t = wave_ms[v] * slowdown(v, d)
        heapq.heappush(heap, (max(max(free, gates[0]) + t, gates[1] + t / nm), v, c))

    for v in range(n):
        schedule(v)
    dropped = 0
    while heap and len(closed) < waves:
        t, v, c = heapq.heappop(heap)
        arrivals[c].append(t)
        numbers[v].append(c)
        before = quorum.clock
        if quorum.arrive(v, c) is Arrival.DROPPED:
            dropped += 1
        else:
            pushed[c] += 1
        closed += [t] * (quorum.clock - before)
        state[v] = (state[v][0] + 1, c, t)
        if quorum.clock > before:
            for u in sorted(blocked | {v}):
                blocked.discard(u)
                schedule(u)
        else:
            schedule(v)
    return WavePlay(
        "",  # named by play_waves
        tuple(tuple(sorted(a)) for a in arrivals),
        tuple(closed),
        tuple(quorum.counted(c) for c in range(len(closed))),
        dropped,
        sum(pushed),
        closed[-1] if closed else 0.0,
        nm,
        tuple(tuple(x) for x in numbers),
    )


def _play_easgd(
    wave_ms: Sequence[float], waves: int, nm: int, slowdown: Slowdown, tau: int
) -> WavePlay:
    """Free-running VWs; exchange ``k`` (after wave ``(k+1) tau - 1``) waits for every VW's
    exchange ``k - 1``. ``closed_ms[c]``: when every VW finished wave ``c``."""
    n = len(wave_ms)
    free = [0.0] * n
    arrivals, closed = [], []
    made: list[float] = []  # when every VW had made exchange k
    for c in range(waves):
        ends = [free[v] + wave_ms[v] * slowdown(v, c) for v in range(n)]
        arrivals.append(tuple(sorted(ends)))
        closed.append(max(ends))
        if exchanges_after(c, tau):
            k = (c + 1) // tau - 1
            gate = made[k - 1] if k > 0 else 0.0
            ends = [max(e, gate) for e in ends]  # pull the centre c_k, then push d_i
            made.append(max(ends))
        free = ends
    everyone = tuple(range(n))
    return WavePlay(
        "", tuple(arrivals), tuple(closed), (everyone,) * waves, 0, n * waves, max(free), nm
    )


@dataclass(frozen=True)
class Waves:
    """What a rule is played on.

    Attributes:
        wave_ms: each VW's wave time without stragglers (ms).
        waves: waves to close.
        nm: minibatches per wave.
        slowdown: ``(vw, wave) -> multiplier`` of a VW's wave time.
        D: the plan's WSP threshold (a rule that keeps ``D``).
    """

    wave_ms: tuple[float, ...]
    waves: int
    nm: int
    slowdown: Slowdown
    D: int = 0


Player = Callable[[Waves, Mapping[str, float]], WavePlay]
"""A rule's wave player: ``(waves, the rule's parameters) -> WavePlay``
(:attr:`planner.rules.SyncRule.play`)."""


def play_wsp(w: Waves, params: Mapping[str, float]) -> WavePlay:
    """WSP with threshold ``w.D``."""
    return _play_clocked(w.wave_ms, w.waves, w.nm, w.slowdown, w.D, 0)


def play_backup(w: Waves, params: Mapping[str, float]) -> WavePlay:
    """Backup workers (``params["backups"]``) at ``D = 0``."""
    return _play_clocked(w.wave_ms, w.waves, w.nm, w.slowdown, 0, int(params.get("backups", 0)))


def play_easgd(w: Waves, params: Mapping[str, float]) -> WavePlay:
    """Elastic averaging, an exchange every ``params["tau"]`` waves.

    Raises:
        ValueError: ``tau < 1``.
    """
    tau = int(params.get("tau", 1))
    if tau < 1:
        raise ValueError(f"tau must be >= 1, got {tau}")
    return _play_easgd(w.wave_ms, w.waves, w.nm, w.slowdown, tau)


def play_waves(
    rule: str,
    wave_ms: Sequence[float],
    waves: int,
    nm: int,
    straggle: Straggle | Slowdown = NO_STRAGGLE,
    D: int = 0,
    **params: float,
) -> WavePlay:
    """Play ``waves`` waves of every VW under ``rule`` (its :attr:`planner.rules.SyncRule.play`).

    Args:
        rule: a rule of :func:`planner.rules.rules` with a player (``wsp``, ``backup``, ...).
        wave_ms: each VW's wave time without stragglers (ms).
        waves: waves to close.
        nm: minibatches per wave.
        straggle: the slowdown draws (keyed by VW id and wave), or a function
            ``(vw, wave) -> multiplier`` (:func:`plan_slowdown`).
        D: WSP threshold (a rule that keeps ``D``).
        params: the rule's parameters (``backups=1``, ``tau=4``; a player reads a missing one
            as its neutral value: no backups, an exchange every wave).

    Raises:
        ValueError: unknown rule, a rule with no player, or bad parameters.
    """
    from planner.rules import rules  # the registry imports this module's players

    if not wave_ms or waves < 1 or nm < 1 or min(wave_ms) <= 0:
        raise ValueError(f"need VWs with positive wave times, waves >= 1 and Nm >= 1 (got "
                         f"{list(wave_ms)}, {waves}, {nm})")  # fmt: skip
    known = rules()
    player = known[rule].play if rule in known else None
    if player is None:
        played = ", ".join(name for name, r in known.items() if r.play is not None)
        raise ValueError(f"unknown synchronisation rule {rule!r}; use one of {played}")
    slow = straggle.slowdown if isinstance(straggle, Straggle) else straggle
    return dataclasses.replace(player(Waves(tuple(wave_ms), waves, nm, slow, D), params), rule=rule)


def plan_slowdown(plan: Plan) -> Slowdown:
    """The emulated cluster's straggler model per VW: a VW's wave is as slow as its slowest
    device's draw (every stage of the VW draws the same number, :func:`planner.straggle.uniform`)."""
    per_vw: list[list[Straggle]] = []
    for vw in plan.virtual_workers:
        models = []
        for node in sorted({g.node for g in vw.gpus}):
            try:
                emu = plan.cluster.node(node).emulation
            except ConfigError:
                emu = None
            if emu is not None and emu.straggle.active:
                models.append(emu.straggle)
        per_vw.append(models)

    def slowdown(v: int, c: int) -> float:
        return max((s.slowdown(v, c) for s in per_vw[v]), default=1.0)

    return slowdown


def vw_wave_ms(plan: Plan, profile: Profile | None = None, waves: int = 6) -> list[float]:
    """Each VW's wave time (ms) alone: the pipeline simulator with a threshold no VW reaches."""
    from planner.sim.simulator import simulate

    free = simulate(dataclasses.replace(plan, D=waves + 1), waves, profile)
    return [plan.nm * plan.batch_size / r * 1e3 for r in free.per_vw_throughput]


def predict_rule(
    plan: Plan,
    rule: str,
    waves: int = 100,
    D: int = 0,
    profile: Profile | None = None,
    **params: float,
) -> WavePlay:
    """Play ``rule`` with ``params`` on ``plan``'s VWs (pipeline-simulated wave times, the
    cluster's stragglers)."""
    return play_waves(
        rule, vw_wave_ms(plan, profile), waves, plan.nm, plan_slowdown(plan), D, **params
    )
