"""The launcher's side of restarting one VW, without processes: the watch contract, the
evictor's choice, the restart budget and what it tells the shards, the restarted job."""

from __future__ import annotations

import queue
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from profiler.errors import HetPipeRuntimeError
from runtime.config import ModelSource, OptimizerConfig, RunConfig
from runtime.faults import StageFault
from runtime.launch.evict import VWEvictor
from runtime.launch.failures import watch
from runtime.launch.launcher import _restarting
from runtime.launch.restart_vw import AttemptFailed, VWRestarter, rejoined_job
from runtime.launch.startup import StartUpLoss
from runtime.ps.rejoin import RELEASE, RESTART, Rejoin
from runtime.spec import FailurePolicy, OnFailure, RunSpec
from runtime.stage.job import StageContext, StageJob
from runtime.sync.rule import SyncSpec


@dataclass
class _Proc:
    """A stand-in for a ``multiprocessing.Process`` that died with SIGKILL."""

    exitcode: int | None = -9
    killed: list[bool] = field(default_factory=list)

    def is_alive(self) -> bool:
        return self.exitcode is None

    def kill(self) -> None:
        self.killed.append(True)

    def join(self, timeout: float | None = None) -> None:
        """Already dead."""


def _job(vw: int, stage: int, rank: int, first_wave: int = 0) -> StageJob:
    ctx = StageContext(
        rank=rank, vw=vw, stage=stage, n_stages=2, nm=2, cuts=(2,), batch_size=8,
        device="cpu", speed=0.0, cap_bytes=0, optimizer_state_factor=0.0, prev_rank=None,
        next_rank=None, total_steps=12,
    )  # fmt: skip
    return StageJob(ctx, ModelSource(ref="mlp"), OptimizerConfig(), RunConfig(),
                    SyncSpec(rule="wsp", first_wave=first_wave),
                    fault=StageFault(stage=stage, at_mb=3))  # fmt: skip


def test_an_absorbed_failure_with_nothing_gone_goes_on() -> None:
    events: queue.Queue[tuple[object, ...]] = queue.Queue()
    for msg in (("error", 4, "boom"), ("result", 0, b"a"), ("result", 4, b"b")):
        events.put(msg)
    out = watch({}, events, 2, lambda _: None, lambda e, d: HetPipeRuntimeError("x"),
                stall_s=5.0, absorb=lambda errors: set())  # fmt: skip
    assert out == {0: b"a", 4: b"b"}  # restarted rank 4 delivered its result after all
    events.put(("error", 4, "boom"))
    try:
        watch({}, events, 1, lambda _: None, lambda e, d: HetPipeRuntimeError("failed"),
              stall_s=5.0, absorb=lambda errors: None)  # fmt: skip
    except HetPipeRuntimeError as exc:
        assert str(exc) == "failed"
    else:
        raise AssertionError("None from absorb must fail the run")


def test_the_budget_restarts_then_releases_and_tells_the_shards(tmp_path: Path) -> None:
    jobs = {1: (_job(1, 0, 4), _job(1, 1, 5))}
    procs = {0: _Proc(None), 4: _Proc(), 5: _Proc()}
    spawned: list[tuple[int, int]] = []

    def spawn(job: StageJob, inc: int) -> _Proc:
        spawned.append((job.ctx.rank, inc))
        return _Proc(None)

    rejoin = Rejoin(str(tmp_path / "store"), 6, 5.0)
    restarter = VWRestarter(jobs, rejoin, 1, spawn, procs, tmp_path)
    labels = {r: f"rank {r}" for r in range(6)}
    evictor = VWEvictor({0: (2, 3), 1: (4, 5)}, procs, labels, restart=restarter, grace_s=0.0)
    assert evictor({5: "died"}) == set()  # restarted: nothing gone, the run goes on
    assert spawned == [(4, 1), (5, 1)] and procs[4].is_alive() and not evictor.lost
    store = rejoin.store()
    assert store.get(Rejoin.decision_key(1, 1)).decode() == RESTART
    procs[5] = _Proc()  # the new incarnation dies too: the one restart is spent
    assert evictor({5: "died"}) == {4, 5} and "rank 5" in evictor.lost[1]
    assert store.get(Rejoin.decision_key(1, 2)).decode() == RELEASE
    assert [r.vw for r in restarter.restarted] == [1] and len(spawned) == 2
    assert evictor({0: "died"}) is None  # a shard: the run stops


def test_a_restarted_job_starts_at_the_cut_and_ends_with_the_others() -> None:
    job = rejoined_job(_job(1, 0, 4, first_wave=1), 3)
    assert job.sync.first_wave == 3 and job.sync.rejoined and job.first_mb == 6
    assert job.ctx.total_steps == 2 * (1 + 6 - 3)  # waves 3..6: the same last wave (7)
    assert job.fault is None  # a test fault fires in the first incarnation only


@dataclass(frozen=True)
class _Result:
    restarts: tuple[str, ...] = ()


def test_vw_restarts_of_a_failed_attempt_are_listed_and_spend_the_budget() -> None:
    budgets: list[int] = []

    def attempt(spec: RunSpec, absent: dict[int, str]) -> _Result:
        budgets.append(spec.failure.budget)
        if len(budgets) == 1:  # restarted VW 1 alone, then a shard died
            raise AttemptFailed("rank 0 (shard 0) failed: boom", ["vw 1 note"])
        return _Result(("vw 0 note",))

    spec = RunSpec(failure=FailurePolicy(OnFailure.RESTART, 3))
    result = _restarting(attempt, spec, 2)  # type: ignore[arg-type]
    assert result.restarts == ("vw 1 note", "rank 0 (shard 0) failed: boom (restarted from "
                               "clock 0)", "vw 0 note")  # fmt: skip
    assert budgets == [3, 1]  # the second attempt may restart one VW more


def _lost_at_start(policy: FailurePolicy, losses: int, n_vws: int = 2) -> list[dict[int, str]]:
    """The VWs left out of each attempt of ``_restarting`` when the first ``losses`` attempts
    each lose a stage of VW 1, then VW 0, before the group formed."""
    seen: list[dict[int, str]] = []

    def attempt(spec: RunSpec, absent: dict[int, str]) -> _Result:
        seen.append(dict(absent))
        if len(seen) <= losses:
            vw = 1 if len(seen) == 1 else 0
            cause = f"rank {2 + 2 * vw} (vw {vw} | stage 0) failed: killed by signal SIGKILL"
            raise StartUpLoss(f"{cause} (before every rank joined)", vw, cause)
        return _Result(())

    _restarting(attempt, RunSpec(failure=policy), n_vws)  # type: ignore[arg-type]
    return seen


def test_a_vw_lost_at_start_up_is_left_out_under_continue() -> None:
    cause = "rank 4 (vw 1 | stage 0) failed: killed by signal SIGKILL"
    assert _lost_at_start(FailurePolicy(OnFailure.CONTINUE), 1) == [{}, {1: cause}]
    with pytest.raises(StartUpLoss, match="rank 2"):  # no VW would be left
        _lost_at_start(FailurePolicy(OnFailure.CONTINUE), 2)
    with pytest.raises(StartUpLoss):  # --on-failure stop: the run stops, naming the rank
        _lost_at_start(FailurePolicy(), 1)


def test_a_vw_lost_at_start_up_restarts_the_job_while_the_budget_lasts() -> None:
    cfg = FailurePolicy(OnFailure.RESTART, max_restarts=1)
    assert _lost_at_start(cfg, 1, n_vws=3) == [{}, {}]  # restarted whole, not left out
    cause = "rank 2 (vw 0 | stage 0) failed: killed by signal SIGKILL"
    assert _lost_at_start(cfg, 2, n_vws=3) == [{}, {}, {0: cause}]  # then evicted


def test_stages_that_only_lost_their_shard_are_not_restarted(tmp_path: Path) -> None:
    spawned: list[int] = []
    procs = {0: _Proc(None), 4: _Proc(1), 5: _Proc(None)}  # stage 4 exited after an error
    restarter = VWRestarter({1: (_job(1, 0, 4), _job(1, 1, 5))}, Rejoin(str(tmp_path / "s"), 6, 5.0),
                            3, lambda job, inc: spawned.append(job.ctx.rank), procs)  # fmt: skip
    evictor = VWEvictor({1: (4, 5)}, procs, {}, restart=restarter, grace_s=0.3)
    procs[0] = _Proc(-9)  # shard 0 was killed: the stage's lost connection is its consequence
    assert evictor({4: "RuntimeError: Connection closed by peer"}) is None and spawned == []
