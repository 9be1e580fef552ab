"""Soak: random kills under ``--on-failure restart|continue`` vs an undisturbed run of the same job.

Runs ``hetpipe run CLUSTER --steps N --checkpoint-every K --D 0`` twice through the CLI (separate
processes, emulated devices): once undisturbed, once with a killer that SIGKILLs a random rank
(a stage or a parameter-server shard) every ``--every`` seconds while the job trains, under
``--on-failure restart``. A killed stage's VW is restarted alone at the shards' cut (the
others wait there); a killed shard restarts the whole job from its last snapshot. Both runs
train the same samples: every VW's every wave is applied exactly once, with the data of that
wave (checked in the final snapshot's ledgers), so the accuracies compare like for like.
Reports the test accuracy of both and, per failure: its kind, the waves lost (never trained:
0 for both kinds), the work redone (a stage: its VW's wave in flight, ``pushes_discarded``
buffered pushes dropped once; a shard: ``waves_redone``, the newest clock any process had
started to snapshot at the kill minus the clock the job restarted from) and the time to
recover (a stage: kill to the last of the VW's new stages
logging ``rejoined at clock``, i.e. holding the global weights; a shard: kill to every rank of
the next attempt beating again).

``--mode continue``: the killer SIGKILLs a random *stage* (at most one fewer than the VWs);
its VW is evicted and the others go on. Reports the accuracy of both runs, each lost VW's
cut wave and waves never trained (``summary.json`` ``lost``), the time from the kill to
the eviction at the last shard (the shards' log lines). The ledger is not re-read here
(``tests/runtime/test_faults_continue.py`` checks it exactly).

Run: ``python benchmarks/bench_soak.py --steps 900 --checkpoint-every 5 --kills 4 --every 5``
(about 2-3 minutes; it prints the JSON it writes; the disturbed run's log goes to
``$TMPDIR/hetpipe-soak.log``). Writes
``benchmarks/results/soak.json`` (``soak_continue.json`` with ``--mode continue``).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results" / "soak.json"
TMP = Path(tempfile.gettempdir())


def _ranks(root: int) -> list[int]:
    """The launcher's rank processes: children of its forkserver."""
    parents: dict[int, int] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            text = stat.read_text()
        except OSError:
            continue
        parents[int(stat.parent.name)] = int(text[text.rindex(")") + 2 :].split()[1])
    servers = [p for p, pp in parents.items() if pp == root]
    return [p for p, pp in parents.items() if pp in servers]


def _clock_dirs(ckpt: Path) -> list[int]:
    return [int(d.name.split("-")[1]) for d in ckpt.glob("clock-*")] if ckpt.is_dir() else []


def _all_beating(pid: int, n: int) -> bool:
    return len(list(TMP.glob(f"hetpipe-rdzv-{pid}-*/beat-*"))) >= n


def run(args: argparse.Namespace, out: Path, kill: bool) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "hetpipe", "run", str(args.cluster), "--steps", str(args.steps),
           "--D", "0", "--checkpoint-every", str(args.checkpoint_every), "--out", str(out),
           "--no-progress", "--seed", str(args.seed)]  # fmt: skip
    if kill and args.mode == "restart":
        cmd += ["--on-failure", "restart", "--max-restarts", str(args.kills + 5)]
    elif kill:
        cmd += ["--on-failure", "continue"]
    t0 = time.time()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    kills: list[dict[str, Any]] = []
    if kill:
        threading.Thread(target=_killer, args=(proc, out, args, kills), daemon=True).start()
    _, stderr = proc.communicate()
    if proc.returncode != 0:
        raise SystemExit(f"run failed ({proc.returncode}): {stderr[-2000:]}")
    summary = json.loads((out / "summary.json").read_text())
    return {"wall_s": time.time() - t0, "summary": summary, "kills": kills, "stderr": stderr}


def _killer(proc: subprocess.Popen[str], out: Path, args: argparse.Namespace,
            kills: list[dict[str, Any]]) -> None:  # fmt: skip
    rng = random.Random(args.seed)
    n_ranks = 0
    while proc.poll() is None and len(kills) < args.kills:
        time.sleep(args.every)
        ranks = _ranks(proc.pid)
        n_ranks = max(n_ranks, len(ranks))
        if not ranks or not _all_beating(proc.pid, n_ranks):
            continue
        if args.mode == "continue":
            _kill_stage(proc, out, ranks, rng, kills)
            continue
        victim = rng.choice(ranks)
        started = max(_clock_dirs(out / "checkpoints"), default=0)
        n_shards = len(json.loads((out / "plan.json").read_text())["shards"])
        t_kill = time.time()
        try:
            os.kill(victim, signal.SIGKILL)
        except ProcessLookupError:
            continue
        if victim not in sorted(ranks)[:n_shards]:  # a stage: its VW restarts alone
            kills.append({"kind": "stage", "t_kill": t_kill})
            continue  # timed afterwards from the log (rejoin_times)
        # recovered: a new attempt (new rendezvous folder) with every rank beating
        old = {d.name for d in TMP.glob(f"hetpipe-rdzv-{proc.pid}-*")}
        while proc.poll() is None:
            new = [d for d in TMP.glob(f"hetpipe-rdzv-{proc.pid}-*") if d.name not in old]
            if new and len(list(new[0].glob("beat-*"))) >= n_ranks:
                break
            time.sleep(0.05)
        kills.append({"kind": "shard", "at_clock": started, "recover_s": time.time() - t_kill})


def _kill_stage(
    proc: subprocess.Popen[str], out: Path, ranks: list[int], rng: random.Random,
    kills: list[dict[str, Any]],
) -> None:  # fmt: skip
    """``--mode continue``: SIGKILL a random live stage (ranks start in rank order: the
    shards first); the recovery time is read from the shards' logs afterwards."""
    plan = json.loads((out / "plan.json").read_text())
    if len(kills) >= len(plan["virtual_workers"]) - 1:
        return  # one VW must survive
    stages = [r for r in sorted(ranks)[len(plan["shards"]) :] if _running(r)]
    if stages:
        os.kill(rng.choice(stages), signal.SIGKILL)
        kills.append({"t_kill": time.time()})


def _running(pid: int) -> bool:
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return text[text.rindex(")") + 2 :].split()[0] not in ("Z", "X")


def _rejoins(stderr: str) -> list[tuple[float, str]]:
    """(wall time, ``vw<k>-stage<s>``) of every restarted stage's ``rejoined at clock`` line."""
    out = []
    for line in stderr.splitlines():
        if (m := re.search(r"(vw\d+-stage\d+) rejoined at clock", line)) is not None:
            out.extend((t, m.group(1)) for t in _evicted_at(line, "rejoined at clock"))
    return sorted(out)


def _evicted_at(stderr: str, what: str = "evicted at wave") -> list[float]:
    """Wall times of the log lines holding ``what`` (local time, as logged; default: the
    shards' evictions)."""
    out = []
    for line in stderr.splitlines():
        if what in line and (m := re.match(r"(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d),(\d+)", line)):
            t = datetime.datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S").timestamp()
            out.append(t + int(m.group(2)) / 1000)
    return sorted(out)


def continue_figures(soak: dict[str, Any]) -> dict[str, Any]:
    """Waves lost and time to recover (kill -> eviction at the last shard) per failure."""
    lost = soak["summary"]["lost"]
    times = _evicted_at(soak["stderr"])
    recover = []
    for k in soak["kills"]:
        after = [t for t in times if t >= k["t_kill"] - 0.5]
        n_shards = max(1, len(times) // max(1, len(lost)))
        if len(after) >= n_shards:
            recover.append(after[n_shards - 1] - k["t_kill"])
    return {
        "failures_survived": len(lost),
        "lost": lost,
        "waves_lost_per_failure": [v["waves_lost"] for v in lost],
        "pushes_discarded": [v["discarded"] for v in lost],
        "recover_s": recover,
    }


def check_ledger(ckpt: Path) -> int:
    """Every shard of the newest snapshot holds every (vw, stage, wave) once; returns the clock."""
    sys.path.insert(0, str(REPO))
    from runtime.persist.checkpoint import shard_from_payload
    from runtime.persist.snapshot import load_part, select

    manifest, _ = select(ckpt)
    for name in manifest.parts:
        if name.startswith("shard-"):
            state = shard_from_payload(load_part(manifest, name), name)
            tags = Counter((e.vw, e.stage, e.wave) for e in state.ledger)
            assert set(tags.values()) == {1}, f"{name}: an update applied twice"
            assert {t[2] for t in tags} == set(range(state.clock)), f"{name}: a wave missing"
    return manifest.clock


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--cluster", type=Path, default=REPO / "examples" / "emulated_cluster.yaml")
    p.add_argument("--steps", type=int, default=900)
    p.add_argument("--checkpoint-every", type=int, default=5)
    p.add_argument("--every", type=float, default=5.0, help="seconds between kills")
    p.add_argument("--kills", type=int, default=4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--mode", choices=("restart", "continue"), default="restart")
    args = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="hetpipe-soak-") as tmp:
        calm = run(args, Path(tmp) / "calm", kill=False)
        soak = run(args, Path(tmp) / "soak", kill=True)
        if args.mode == "continue":
            figures = {**continue_figures(soak), "final_clock": soak["summary"]["global_clock"]}
        else:
            figures = restart_figures(soak, check_ledger(Path(tmp) / "soak" / "checkpoints"))
    result = {
        "command": " ".join(sys.argv),
        "load_average": os.getloadavg(),
        "steps": args.steps,
        "accuracy_undisturbed": calm["summary"]["test_accuracy"],
        "accuracy_soak": soak["summary"]["test_accuracy"],
        **figures,
        "wall_s": {"undisturbed": calm["wall_s"], "soak": soak["wall_s"]},
    }
    path = RESULTS if args.mode == "restart" else RESULTS.with_name("soak_continue.json")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2))
    (TMP / "hetpipe-soak.log").write_text(soak["stderr"])  # the disturbed run's log
    print(json.dumps({k: v for k, v in result.items() if k != "restarts"}, indent=2))


def restart_figures(soak: dict[str, Any], clock: int) -> dict[str, Any]:
    """Per failure: its kind, waves lost, pushes discarded, seconds to recover; the final
    clock (its ledger checked exact)."""
    restarts = soak["summary"]["restarts"]
    froms = [int(m.group(1)) for r in restarts if (m := re.search(r"from clock (\d+)", r))]
    alone = [r for r in restarts if "restarted alone" in r]
    rejoined = _rejoins(soak["stderr"])
    failures = []
    for k in soak["kills"]:
        if k["kind"] == "shard":
            f = froms.pop(0) if froms else k["at_clock"]
            failures.append({"kind": "shard", "waves_lost": 0, "waves_redone": k["at_clock"] - f,
                             "recover_s": k["recover_s"]})  # fmt: skip
            continue
        note = alone.pop(0) if alone else ""
        m = re.search(r"vw (\d+) restarted alone at wave (\d+|\?)(?:; (\d+) buffered)?", note)
        vw = f"vw{m.group(1)}-" if m else "?"
        firsts: dict[str, float] = {}  # the VW's stages: their first rejoin after the kill
        for t, where in rejoined:
            if t >= k["t_kill"] - 0.5 and where.startswith(vw):
                firsts.setdefault(where, t)
        failures.append({
            "kind": "stage", "waves_lost": 0, "vw": int(m.group(1)) if m else None,
            "rejoined_at_wave": int(m.group(2)) if m and m.group(2) != "?" else None,
            "pushes_discarded": int(m.group(3)) if m and m.group(3) else None,  # lost with a failed attempt
            "recover_s": max(firsts.values()) - k["t_kill"] if firsts else None,
        })  # fmt: skip
        rejoined = [(t, w) for t, w in rejoined if not (w in firsts and t <= firsts[w])]
    return {
        "failures_survived": len(restarts),
        "failures": failures,
        "waves_lost_per_failure": [f["waves_lost"] for f in failures],
        "recover_s": [f["recover_s"] for f in failures],
        "final_clock": clock,
        "ledger_exactly_once": True,
        "restarts": restarts,
    }


if __name__ == "__main__":
    main()
