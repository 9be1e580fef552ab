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

Memory under churn: every second the resident memory (``VmRSS`` of ``/proc/<pid>/status``) of
every process of the disturbed run is sampled, keyed by role (``launcher``, ``forkserver``,
``hp shard0``, ``hp vw1 s2``: a rank names itself by role, so a restarted rank's new pid keeps
its series). The JSON gets the series and, per role, the RSS after the first minute, at the
end and their ratio; a role whose end exceeds 1.10x its first-minute level is flagged
(``rss_grew``); ``--rss-plot`` draws them. ``--duration S``: kill every ``--every`` to
``--every-max`` seconds until ``S`` seconds have passed, then stop the job (Ctrl-C; pass
``--steps`` large enough to last); ``--no-reference`` skips the undisturbed run.

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
GROWTH_LIMIT = 1.10  # end RSS over first-minute RSS above which a role is flagged


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
    t0 = args.t0 = time.time()
    args.t_end = t0 + (args.duration or 0)
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    kills: list[dict[str, Any]] = []
    rss: dict[str, list[tuple[float, float]]] = {}
    if kill:
        threading.Thread(target=_killer, args=(proc, out, args, kills), daemon=True).start()
        threading.Thread(target=_sample_rss, args=(proc, t0, rss), daemon=True).start()
    if kill and args.duration:
        threading.Thread(target=_stop_after, args=(proc, t0 + args.duration), daemon=True).start()
    _, stderr = proc.communicate()
    if args.duration and kill:
        summary = {}  # stopped at the deadline: no accuracy
    elif proc.returncode != 0:
        raise SystemExit(f"run failed ({proc.returncode}): {stderr[-2000:]}")
    else:
        summary = json.loads((out / "summary.json").read_text())
    return {"wall_s": time.time() - t0, "summary": summary, "kills": kills, "stderr": stderr,
            "rss": rss}  # fmt: skip


def _stop_after(proc: subprocess.Popen[str], deadline: float) -> None:
    """``--duration``: Ctrl-C the launcher (it stops every rank) once ``deadline`` has passed."""
    while proc.poll() is None and time.time() < deadline:
        time.sleep(0.5)
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)


def _role(pid: int, root: int) -> str | None:
    """The role of a process of the job: ``launcher``, ``forkserver``, a rank's own name
    (``hp shard0``, ``hp vw1 s2``) or ``None`` (a helper, or a rank not yet named)."""
    if pid == root:
        return "launcher"
    try:
        comm = Path(f"/proc/{pid}/comm").read_text().strip()
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return None
    if comm.startswith("hp "):
        return comm
    return "forkserver" if b"forkserver" in cmdline else None


def _rss_mb(pid: int) -> float | None:
    try:
        text = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return None
    m = re.search(r"^VmRSS:\s+(\d+) kB", text, re.M)
    return int(m.group(1)) / 1024 if m else None


def _descendants(root: int) -> list[int]:
    parents: dict[int, int] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            text = stat.read_text()
        except OSError:
            continue
        parents[int(stat.parent.name)] = int(text[text.rindex(")") + 2 :].split()[1])
    family, grew = {root}, True
    while grew:
        new = {p for p, pp in parents.items() if pp in family} - family
        family |= new
        grew = bool(new)
    return sorted(family)


def _sample_rss(proc: subprocess.Popen[str], t0: float,
                rss: dict[str, list[tuple[float, float]]]) -> None:  # fmt: skip
    """Once a second: (seconds since start, MB) per role; of two live processes with one role
    (an old incarnation dying), the newest (highest pid)."""
    while proc.poll() is None:
        t = time.time() - t0
        now: dict[str, tuple[int, float]] = {}
        for pid in _descendants(proc.pid):
            role, mb = _role(pid, proc.pid), _rss_mb(pid)
            if role is not None and mb is not None and pid >= now.get(role, (0, 0.0))[0]:
                now[role] = (pid, mb)
        for role, (_, mb) in now.items():
            rss.setdefault(role, []).append((round(t, 1), round(mb, 2)))
        time.sleep(max(0.0, 1.0 - (time.time() - t0 - t)))


def rss_figures(rss: dict[str, list[tuple[float, float]]], first_s: float = 60.0) -> dict[str, Any]:
    """Per role: MB at the first sample after ``first_s``, at the last sample, their ratio;
    ``rss_grew``: the roles whose ratio exceeds :data:`GROWTH_LIMIT`."""
    roles = {}
    for role, series in sorted(rss.items()):
        after = [mb for t, mb in series if t >= first_s]
        if len(after) < 2:
            continue
        roles[role] = {"first_minute_mb": after[0], "end_mb": after[-1],
                       "ratio": round(after[-1] / after[0], 3)}  # fmt: skip
    grew = [r for r, v in roles.items() if v["ratio"] > GROWTH_LIMIT]
    return {"rss_by_role": roles, "rss_grew": grew}


def plot_rss(rss: dict[str, list[tuple[float, float]]], kills: list[dict[str, Any]], t0: float,
             path: Path) -> None:  # fmt: skip
    """RSS (MB) over time per role, the kills as vertical lines."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 5))
    for role, series in sorted(rss.items()):
        ax.plot([t for t, _ in series], [mb for _, mb in series], label=role, lw=1)
    for k in kills:
        ax.axvline(
            k["t_kill"] - t0, color="red" if k["kind"] == "shard" else "grey", lw=0.5, ls=":"
        )
    ax.set_xlabel("seconds since start (dotted: kills, red = a shard)")
    ax.set_ylabel("resident memory (MB)")
    ax.set_title("bench_soak: RSS per role under --on-failure restart")
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def _killer(proc: subprocess.Popen[str], out: Path, args: argparse.Namespace,
            kills: list[dict[str, Any]]) -> None:  # fmt: skip
    rng = random.Random(args.seed)
    n_ranks = 0
    while proc.poll() is None and len(kills) < args.kills:
        time.sleep(rng.uniform(args.every, max(args.every, args.every_max or args.every)))
        if args.duration and proc.poll() is None and time.time() > args.t_end - args.every:
            return  # --duration: no kill whose recovery would outlast the deadline
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
        kills.append({"kind": "shard", "at_clock": started, "recover_s": time.time() - t_kill,
                      "t_kill": t_kill})  # fmt: skip


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
    args = _parse()
    signal.signal(signal.SIGINT, signal.default_int_handler)  # not inherited as ignored (a `&` job)
    with tempfile.TemporaryDirectory(prefix="hetpipe-soak-") as tmp:
        calm = None if args.no_reference else run(args, Path(tmp) / "calm", kill=False)
        soak = run(args, Path(tmp) / "soak", kill=True)
        if args.duration:
            figures = {"kills": [k["kind"] for k in soak["kills"]],
                       "restarts_logged": soak["stderr"].count("restarted alone")}  # fmt: skip
        elif args.mode == "continue":
            figures = {**continue_figures(soak), "final_clock": soak["summary"]["global_clock"]}
        else:
            figures = restart_figures(soak, check_ledger(Path(tmp) / "soak" / "checkpoints"))
    result = {
        "command": " ".join(sys.argv),
        "load_average": os.getloadavg(),
        "steps": args.steps,
        "accuracy_undisturbed": calm["summary"]["test_accuracy"] if calm else None,
        "accuracy_soak": soak["summary"].get("test_accuracy"),
        **figures,
        **rss_figures(soak["rss"]),
        "wall_s": {"undisturbed": calm["wall_s"] if calm else None, "soak": soak["wall_s"]},
        "rss_series_mb": soak["rss"],
    }
    path = args.out or (
        RESULTS if args.mode == "restart" else RESULTS.with_name("soak_continue.json")
    )
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2))
    if args.rss_plot:
        plot_rss(soak["rss"], soak["kills"], args.t0, args.rss_plot)
    (TMP / "hetpipe-soak.log").write_text(soak["stderr"])  # the disturbed run's log
    hidden = ("restarts", "rss_series_mb")
    print(json.dumps({k: v for k, v in result.items() if k not in hidden}, indent=2))


def _parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--cluster", type=Path, default=REPO / "examples" / "emulated_cluster.yaml")
    p.add_argument("--steps", type=int, default=900)
    p.add_argument("--checkpoint-every", type=int, default=5)
    p.add_argument("--every", type=float, default=5.0, help="seconds between kills (at least)")
    p.add_argument("--every-max", type=float, default=None, help="at most (uniform draw)")
    p.add_argument("--kills", type=int, default=4, help="at most (ignored with --duration)")
    p.add_argument("--duration", type=float, default=None, help="seconds, then stop the job")
    p.add_argument("--no-reference", action="store_true", help="skip the undisturbed run")
    p.add_argument("--out", type=Path, default=None, help="results JSON (default soak.json)")
    p.add_argument("--rss-plot", type=Path, default=None, help="PNG of RSS per role")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--mode", choices=("restart", "continue"), default="restart")
    args = p.parse_args()
    if args.duration:
        args.kills = 10**6
    return args


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
