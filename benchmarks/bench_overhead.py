"""The runtime's own cost on the README main job: measured/predicted before and after (issue 22).

Runs the README's first command (``hetpipe run examples/emulated_cluster.yaml``: 2 VWs of 2
emulated devices, batch 32, tasks of 1-5 ms, WSP D = 0) from two source trees in turn
(``--trees OLD NEW``, alternating ``--pairs`` times, so both see the same load), and records
each run's throughput, its ratio to the plan's prediction and the load average. Then one run of
the last tree with ``--profile-runtime`` gives the per-stage breakdown and the runtime's overhead
per task, and the simulator predicts the plan again with that overhead added
(``hetpipe simulate --overhead-ms-per-task``) next to the measured throughput.

Run: ``python benchmarks/bench_overhead.py --trees /path/to/main . --pairs 3``. Writes
``benchmarks/results/overhead.json``. The machine is shared (2 cores): the figures are as
loaded as the load averages next to them say.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
CLUSTER = "examples/emulated_cluster.yaml"
_TITLE = re.compile(r"([\d.]+) samples/s \(predicted ([\d.]+), ratio ([\d.]+)\)")


def _cpu_s() -> float:
    """CPU seconds (user + system) of every finished child process so far that was waited
    for: the ``hetpipe run`` launcher, not its stage and shard processes (started from a
    forkserver, they are never this process's waited-for descendants)."""
    used = resource.getrusage(resource.RUSAGE_CHILDREN)
    return used.ru_utime + used.ru_stime


def _hetpipe(tree: Path, *args: str) -> str:
    """``python -m hetpipe ARGS`` with ``tree`` on the path, in ``tree``; its output."""
    env = {**os.environ, "PYTHONPATH": str(tree), "COLUMNS": "200"}
    cmd = [sys.executable, "-m", "hetpipe", *args]
    done = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} in {tree} failed:\n{done.stdout}{done.stderr}")
    return done.stdout


def _run(tree: Path, *extra: str) -> dict[str, Any]:
    """One README main job from ``tree``: throughput, prediction, ratio, load before/after and
    the launcher's CPU seconds (:func:`_cpu_s`: start-up, planning and data, not the stages'
    per-task work; measured 7 s against 24-31 s for every process of the job)."""
    load0, cpu0 = os.getloadavg()[0], _cpu_s()
    out = _hetpipe(tree, "run", CLUSTER, "--no-progress", *extra)
    cpu_s = _cpu_s() - cpu0
    found = _TITLE.search(out)
    if found is None:
        raise SystemExit(f"no throughput line in the output of {tree}:\n{out}")
    thr, pred, ratio = (float(x) for x in found.groups())
    return {"tree": str(tree), "throughput": thr, "predicted": pred, "ratio": ratio,
            "cpu_s": cpu_s, "load_before": load0, "load_after": os.getloadavg()[0]}  # fmt: skip


def _profiled(tree: Path, work: Path, steps: tuple[str, ...]) -> dict[str, Any]:
    """One profiled run: its breakdown, the mean overhead per task over the stages, and the
    simulator's prediction of the same plan with that overhead."""
    out = work / "profiled"
    row = _run(tree, "--profile-runtime", "--out", str(out), "--checkpoint-every", "0", *steps)
    stages = json.loads((out / "summary.json").read_text())["runtime_breakdown"]
    overhead = statistics.mean(s["overhead_ms_per_task"] for s in stages)
    sim = _hetpipe(tree, "simulate", str(out / "plan.json"), "--overhead-ms-per-task",
                   f"{overhead:.4f}")  # fmt: skip
    found = re.search(r"throughput: ([\d.]+) samples/s", sim)
    with_overhead = float(found.group(1)) if found else float("nan")
    return {**row, "breakdown": stages, "overhead_ms_per_task": overhead,
            "predicted_with_overhead": with_overhead,
            "ratio_with_overhead": row["throughput"] / with_overhead}  # fmt: skip


def main() -> None:
    """Alternate the trees, profile the last one, write the JSON."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--trees", nargs=2, type=Path, default=[REPO, REPO], metavar=("OLD", "NEW"))
    p.add_argument("--pairs", type=int, default=3)
    p.add_argument("--steps", type=int, default=0, help="minibatches per VW (0: the README's)")
    p.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "overhead.json")
    a = p.parse_args()
    trees = [t.resolve() for t in a.trees]
    steps = ("--steps", str(a.steps)) if a.steps else ()
    runs = []
    for k in range(a.pairs):
        for tree in trees if k % 2 == 0 else trees[::-1]:  # who goes first alternates too
            runs.append(_run(tree, *steps))
            r = runs[-1]
            print(f"{tree}: ratio {r['ratio']:.2f}, {r['cpu_s']:.1f} CPU s "
                  f"(load {r['load_before']:.1f})")  # fmt: skip
    with tempfile.TemporaryDirectory() as work:
        profiled = _profiled(trees[1], Path(work), steps)
    medians = {
        str(t): {
            key: statistics.median(r[key] for r in runs if r["tree"] == str(t))
            for key in ("ratio", "cpu_s")
        }
        for t in trees
    }
    print("medians (ratio measured/predicted, CPU s):", medians)
    print(f"overhead {profiled['overhead_ms_per_task']:.3f} ms/task; predicted with it "
          f"{profiled['predicted_with_overhead']:.0f} samples/s, measured "
          f"{profiled['throughput']:.0f} (ratio {profiled['ratio_with_overhead']:.2f})")  # fmt: skip
    result = {"runs": runs, "medians": medians, "steps": a.steps, "profiled": profiled,
              "cpu_count": os.cpu_count()}  # fmt: skip
    a.out.write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
