"""Fault injection: every fault ends with the right exit code, names its culprit, leaves no
process or temp folder behind, and loses nothing a committed snapshot holds.

Faults come in through the job description (``RunSpec.faults``: ``write_fault``/``stage_fault``) or from
outside (signals to a launcher run as a subprocess). Runs are tiny (no pacing, a few waves).
"""

from __future__ import annotations

import contextlib
import csv
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import pytest
from typer.testing import CliRunner

from hetpipe.cli import app
from planner.manual import multi_vw_plan
from profiler.errors import ConfigError, HetPipeRuntimeError
from profiler.graph import ModelGraph
from runtime.config import ModelSource, OptimizerConfig, RunConfig
from runtime.faults import StageFault
from runtime.launch.launcher import launch
from runtime.launch.liveness import STALE_AFTER_S, _dead_forkserver_dir, rendezvous_dir
from runtime.persist.run_dir import RunDirectory
from runtime.persist.snapshot import WriteFault, committed_clocks, select
from runtime.stage.model import resolve_source
from tests.runtime._spec import spec

pytestmark = pytest.mark.timeout(300)

SOURCE = ModelSource(ref="mlp")
BATCH = 16


def _plan(D: int = 0, nm: int = 2):  # type: ignore[no-untyped-def]
    graph = ModelGraph.from_spec(resolve_source(SOURCE, BATCH, meta=True))
    return multi_vw_plan(graph, [(4,), (6,)], "mlp", BATCH, nm=nm, D=D, n_shards=2)


def _cli(*args: str) -> tuple[int, str]:
    res = CliRunner().invoke(
        app, ["run", *args, "--no-progress", "--no-emulate"], env={"COLUMNS": "300"}
    )
    return res.exit_code, res.output


def _children() -> list[int]:
    """This process's live descendants, except multiprocessing's long-lived forkserver and
    resource tracker (shared by every launch of the test session); the ranks forked by a
    forkserver are counted."""
    parents = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            text = stat.read_text()
        except OSError:
            continue
        fields = text[text.rindex(")") + 2 :].split()
        if fields[0] not in ("Z", "X"):
            parents[int(stat.parent.name)] = int(fields[1])
    out, todo = [], [os.getpid()]
    while todo:
        p = todo.pop()
        kids = [c for c, pp in parents.items() if pp == p]
        out += kids
        todo += kids
    return [c for c in out if _is_rank(c, parents.get(c, 0))]


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def _is_rank(pid: int, ppid: int) -> bool:
    cmd = _cmdline(pid)
    if b"resource_tracker" in cmd:
        return False
    return b"forkserver" not in cmd or b"forkserver" in _cmdline(ppid)


def _ledger_exactly_once(states) -> None:  # type: ignore[no-untyped-def]
    for state in states:
        tags = Counter((e.vw, e.stage, e.wave) for e in state.ledger)
        assert set(tags.values()) == {1}
        assert {t[2] for t in tags} == set(range(state.clock))


def test_run_directory_lock_and_ownership(tmp_path: Path) -> None:
    with RunDirectory(tmp_path, resume=False) as first:
        with pytest.raises(ConfigError, match=f"another run \\(pid {os.getpid()}\\)"):
            RunDirectory(tmp_path, resume=False).__enter__()
        (tmp_path / "checkpoints").mkdir()
    with pytest.raises(ConfigError, match=f"holds run {first.run_id} .*--overwrite"):
        RunDirectory(tmp_path, resume=False).__enter__()
    with RunDirectory(tmp_path, resume=False, overwrite=True) as second:
        assert second.run_id != first.run_id and not (tmp_path / "checkpoints").exists()
    with RunDirectory(tmp_path, resume=True) as third:
        assert third.run_id == second.run_id
    with pytest.raises(ConfigError, match="no such run directory"):
        RunDirectory(tmp_path / "typo", resume=True).__enter__()
    assert not (tmp_path / "typo").exists()
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(HetPipeRuntimeError, match="cannot use the run directory"):
        RunDirectory(blocker / "out", resume=False).__enter__()  # not writable


def test_cli_reused_out_mismatched_resume_export_and_corrupt_snapshot(tmp_path: Path) -> None:
    plan = _plan().save(tmp_path / "plan.yaml")
    out = tmp_path / "run"
    code, text = _cli(str(plan), "--steps", "4", "--out", str(out), "--checkpoint-every", "1")
    assert code == 0, text
    ckpt = out / "checkpoints"
    assert committed_clocks(ckpt) == [1, 2]
    # a second run into the same --out is refused, nothing of the first is touched
    code, text = _cli(str(plan), "--steps", "4", "--out", str(out))
    assert code == 2 and "holds run" in text and "--overwrite" in text
    assert committed_clocks(ckpt) == [1, 2]
    # a resume that would change the result is refused, naming the setting
    for flags, field in ((["--nm", "1"], "nm is 1"), (["--seed", "1"], "seed is 1"),
                         (["--lr", "0.1"], "optimizer.lr is 0.1")):  # fmt: skip
        code, text = _cli(str(plan), "--resume", str(out), "--steps", "4", *flags)
        assert code == 2 and field in text, text
    # outputs lost after the last snapshot: a resume of the finished run writes them
    (out / "weights.pt").unlink()
    (out / "summary.json").unlink()
    code, text = _cli(str(plan), "--resume", str(out), "--steps", "4")
    assert code == 0 and (out / "weights.pt").exists(), text
    summary = json.loads((out / "summary.json").read_text())
    assert summary["exported_from"].endswith("clock-2") and summary["global_clock"] == 2
    # one flipped byte in the newest snapshot: named, and the previous one is used
    part = ckpt / "clock-2" / "shard-0.pt"
    data = bytearray(part.read_bytes())
    data[len(data) // 2] ^= 0x40
    part.write_bytes(bytes(data))
    code, text = _cli(str(plan), "--resume", f"{ckpt}", "--steps", "6")
    assert code == 0, text
    summary = json.loads((out / "summary.json").read_text())
    assert summary["global_clock"] == 3 and summary["exported_from"] == ""
    # (the default period is 5: the resumed run snapshots its final clock only)
    assert committed_clocks(ckpt) == [1, 3] and not list(ckpt.rglob("*.tmp"))


@pytest.mark.parametrize("kill", [False, True], ids=["disk-full", "killed-while-writing"])
def test_snapshot_write_fault_names_the_writer_and_resume_recovers(
    tmp_path: Path, kill: bool
) -> None:
    # D = 4, a snapshot every clock: a VW may run ahead of the others' snapshots
    plan = _plan(D=4, nm=1)
    opt = OptimizerConfig(lr=0.05, momentum=0.5)  # stage optimizer state must survive
    run = RunConfig(steps=6, timeout_s=15.0, emulate=False, out_dir=tmp_path / "run")
    fault = WriteFault(clock=3, part="vw1-stage0", kill=kill)
    with pytest.raises(HetPipeRuntimeError) as info:
        launch(plan, SOURCE, spec(opt, run, checkpoint_every=1, write_fault=fault))
    message = str(info.value)
    assert "(vw 1 | stage 0 |" in message and "\n" not in message, message
    assert ("SIGKILL" if kill else "No space left on device") in message, message
    assert "--resume" in message and not _children()  # every rank stopped
    ckpt = run.out_dir / "checkpoints"  # type: ignore[operator]
    # clock 3 can never commit (its vw1-stage0 part failed); clock 2 did unless the failure
    # stopped a slower rank before it wrote its clock-2 part: then clock 1 is the newest, or
    # none (D = 4 lets VW 1 reach clock 3 before a loaded machine's shards reach global clock 1)
    clocks = committed_clocks(ckpt)
    assert set(clocks) <= {1, 2} and not list(ckpt.rglob("*.tmp")), clocks
    if kill or not clocks:
        return
    last = max(clocks)
    resumed = launch(plan, SOURCE, spec(opt, run, checkpoint_every=1, resume=True))
    assert [vw.steps for vw in resumed.vws] == [6 - last, 6 - last]
    _ledger_exactly_once(resumed.states)
    assert select(ckpt)[0].clock == 6


def test_on_failure_restart_resumes_the_job_from_its_last_snapshot(tmp_path: Path) -> None:
    plan = _plan(D=0, nm=1)
    run = RunConfig(steps=8, timeout_s=15.0, emulate=False, out_dir=tmp_path / "run")
    kill = StageFault(stage=1, at_mb=6, vw=0)  # fires in the first attempt only
    cfg = dict(
        checkpoint_every=2,
        stage_fault=kill,
        on_failure="restart",
        max_restarts=1,
        whole_job_restarts=True,
    )  # the whole job, as under torchrun (not its VW alone)
    result = launch(plan, SOURCE, spec(None, run, **cfg))
    assert len(result.restarts) == 1 and "(vw 0 | stage 1 |" in result.restarts[0]
    assert "SIGKILL" in result.restarts[0] and "restarted from clock 4" in result.restarts[0]
    assert {s.clock for s in result.states} == {8} and not _children()
    _ledger_exactly_once(result.states)  # the lost waves 4-5 were recomputed, applied once
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["restarts"] == list(result.restarts)
    # metrics.csv keeps the first attempt's rows; the restart's are appended, numbered on
    with (tmp_path / "run" / "vw0" / "metrics.csv").open(newline="", encoding="utf-8") as f:
        rows = [(int(r["attempt"]), int(r["minibatch"])) for r in csv.DictReader(f)]
    first = [mb for a, mb in rows if a == 0]
    assert first == list(range(1, len(first) + 1)) and 0 < len(first) < 6
    assert [r for r in rows if r[0] != 0] == [(1, mb) for mb in range(5, 9)]
    assert summary["vws"][0]["metrics_attempts"] == 2


def test_frozen_stage_is_named_not_its_peers(tmp_path: Path) -> None:
    run = RunConfig(steps=400, timeout_s=8.0, emulate=False)
    freeze = StageFault(stage=1, at_mb=3, vw=1, signum=int(signal.SIGSTOP))
    with pytest.raises(HetPipeRuntimeError) as info:
        launch(_plan(), SOURCE, spec(None, run, stage_fault=freeze))
    message = str(info.value)
    assert "(vw 1 | stage 1 |" in message and "frozen: no heartbeat" in message, message
    assert not _children()


def _start_cli(
    tmp_path: Path, until_clock: bool, *extra: str, session: bool = False
) -> tuple[subprocess.Popen[str], Path]:
    """``hetpipe run`` in a subprocess, returned once every rank beats (and, with
    ``until_clock``, once snapshot 1 is committed); with ``session``, in a process group of
    its own (every process it starts shares the group, whoever becomes its parent)."""
    plan = _plan().save(tmp_path / "plan.yaml")
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "hetpipe", "run", str(plan), "--steps", "100000", "--out",
           str(out), "--checkpoint-every", "1", "--no-progress", "--no-emulate", *extra]  # fmt: skip
    # a shell's background job ignores SIGINT and so would the run: give it Python's default
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                start_new_session=session)  # fmt: skip
    finally:
        signal.signal(signal.SIGINT, previous)
    tmp = Path(tempfile.gettempdir())
    deadline = time.monotonic() + 150  # a loaded 2-core machine starts 7 processes slowly
    try:
        # any committed snapshot (clock 1 may already be rotated away on a quiet machine)
        while len(list(tmp.glob(f"hetpipe-rdzv-{proc.pid}-*/beat-*"))) < 6 or (
            until_clock and not _committed(out / "checkpoints")
        ):
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline, "the run did not start training"
            time.sleep(0.1)
    except BaseException:
        proc.kill()  # never leave a 100,000-step run behind a failed test
        proc.communicate()
        raise
    return proc, out


def _committed(ckpt: Path) -> bool:
    try:
        return bool(committed_clocks(ckpt))
    except OSError:  # the folder is being created or rotated
        return False


def _alive(pid: int) -> bool:
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return text[text.rindex(")") + 2] not in "ZX"


def _wait_gone(pids: list[int], timeout_s: float) -> list[int]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        pids = [p for p in pids if _alive(p)]
        if not pids:
            break
        time.sleep(0.1)
    return pids


def test_sigkilled_unreaped_launcher_leaves_no_orphans_and_no_temp(tmp_path: Path) -> None:
    proc, out = _start_cli(tmp_path, until_clock=True)
    try:
        ranks = [p for p in _children() if p != proc.pid]
        assert len(ranks) >= 6  # 2 shards + 4 stages (+ the forkserver)
        os.kill(proc.pid, signal.SIGKILL)  # not reaped yet: a zombie launcher
        assert _wait_gone(ranks, 15.0) == [], "children outlived their launcher"
    finally:
        proc.kill()
        proc.communicate()
    tmp = Path(tempfile.gettempdir())
    then = time.time() - STALE_AFTER_S - 1  # a folder this young is kept (another namespace)
    for left in tmp.glob(f"hetpipe-rdzv-{proc.pid}-*"):
        os.utime(left, (then, then))
    with rendezvous_dir():  # the next launch sweeps what the killed one left
        assert not list(tmp.glob(f"hetpipe-rdzv-{proc.pid}-*"))
        assert not [d for d in tmp.glob("pymp-*") if _dead_forkserver_dir(d)]
    assert committed_clocks(out / "checkpoints")  # what was committed stays usable
    select(out / "checkpoints")


def _group(pgid: int) -> list[int]:
    """The live processes of process group ``pgid`` (zombies are gone already)."""
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            text = stat.read_text()
        except OSError:
            continue
        fields = text[text.rindex(")") + 2 :].split()
        if fields[0] not in ("Z", "X") and int(fields[2]) == pgid:
            out.append(int(stat.parent.name))
    return out


def test_a_killed_launcher_takes_every_process_with_it_quietly(tmp_path: Path) -> None:
    # the forkserver (it outlived the launcher by up to 5.5 s) and the resource tracker too,
    # and no rank prints a traceback on its way out (BrokenPipeError on its report pipe)
    proc, _ = _start_cli(tmp_path, True, session=True)  # after the first wave
    try:
        assert len(_group(proc.pid)) >= 8  # launcher, forkserver, 2 shards, 4 stages
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()  # reaped: only its descendants are left in its group
        deadline = time.monotonic() + 5.0
        while _group(proc.pid) and time.monotonic() < deadline:
            time.sleep(0.05)  # polls the process group until the deadline
        assert _group(proc.pid) == [], "processes outlived their launcher"
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)  # never leave a 100,000-step run behind
        _, err = proc.communicate()
    assert "Traceback" not in err and "BrokenPipeError" not in err, err[-3000:]


def test_ctrl_c_stops_cleanly_with_one_line_and_the_resume_command(tmp_path: Path) -> None:
    proc, out = _start_cli(tmp_path, False, "--on-failure", "restart")  # Ctrl-C never restarts
    ranks = [p for p in _children() if p != proc.pid]
    proc.send_signal(signal.SIGINT)
    try:
        _, err = proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:  # never leave a 100,000-step run to the next tests
        proc.kill()
        _, err = proc.communicate()
        pytest.fail(f"Ctrl-C did not stop the run within 60 s: {err[-2000:]}")
    assert proc.returncode == 2, err
    lines = [ln for ln in err.splitlines() if ln.startswith("error:")]
    assert len(lines) == 1 and "interrupted (Ctrl-C)" in lines[0], err
    assert f"--resume {out}" in err.replace("\n", "")
    assert _wait_gone(ranks, 10.0) == []
    assert not list(Path(tempfile.gettempdir()).glob(f"hetpipe-rdzv-{proc.pid}-*"))


def test_one_vw_run_claims_its_directory(tmp_path: Path) -> None:
    from runtime.launch.launcher import launch

    run = RunConfig(steps=2, timeout_s=15.0, emulate=False, out_dir=tmp_path / "one")
    launch(_plan(), SOURCE, spec(None, run, vw=1))
    assert (tmp_path / "one" / "RUN.json").is_file() and (tmp_path / "one" / "weights.pt").is_file()
    with pytest.raises(ConfigError, match="--overwrite"):
        launch(_plan(), SOURCE, spec(None, run, vw=1))  # a second run is refused, never mixed
    launch(_plan(), SOURCE, spec(None, run, overwrite=True, vw=1))
    assert not _children()
