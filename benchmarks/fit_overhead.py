"""Fit the runtime-overhead model (``planner.overhead``) from ``--profile-runtime`` runs.

Runs, alternating, ``--repeat`` times: the README main job (``examples/emulated_cluster.yaml``),
``bench_links.py``'s ED, HD and AllReduce plans, and ``bench_runtime.py``'s one emulated VW,
each with ``--profile-runtime``. Every run gives its stages' measured overhead per task
(:meth:`runtime.results.breakdown.Breakdown.overhead_ms_per_task`) and the plan's runtime
processes; the script fits the model's constant by least squares over the runs (the model:
``ms_per_task * max(1, processes / cores)``, :class:`planner.overhead.RuntimeOverhead`),
prints the residuals, and each plan's measured / predicted without and with the fitted
overhead. Writes ``benchmarks/results/overhead_fit.json``; the constant it prints is what
``runtime_overhead: {ms_per_task: ...}`` in an emulated cluster's file should say.

    python benchmarks/fit_overhead.py --repeat 2          # ~6 minutes on a quiet machine
    python benchmarks/fit_overhead.py --repeat 1 --links-steps 20 --out /tmp/fit.json  # smoke

The machine is shared (2 cores): the load average is recorded next to every run; compare runs
made on a quiet machine.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from planner.overhead import RuntimeOverhead, plan_overhead_ms, plan_processes  # noqa: E402
from planner.plan import Plan  # noqa: E402
from planner.plan_file import load_plan  # noqa: E402

RESULTS = REPO / "benchmarks" / "results" / "overhead_fit.json"
WAVES = 20  # simulated waves per VW for every prediction


def _predict(plan: Plan, overhead_ms: float) -> float:
    """``plan``'s throughput with ``overhead_ms`` per task; an AllReduce plan's is its own
    prediction (the collective's model, which the pipeline simulator does not play, and no
    overhead: :func:`planner.overhead.plan_overhead_ms`)."""
    from planner.rules import layout
    from planner.sim.simulator import simulate

    if layout(plan.sync) == "ddp":
        return plan.predicted.throughput
    return simulate(plan, waves=WAVES, overhead_ms_per_task=overhead_ms).throughput


def _row(label: str, plan: Plan, measured: float, stages: list[dict[str, Any]]) -> dict[str, Any]:
    """One run: its plan's processes, its stages' overhead per task, both predictions."""
    plan = replace(plan, predicted=replace(plan.predicted, overhead_ms_per_task=0.0))
    over = [s["overhead_ms_per_task"] for s in stages]
    tasks = [sum(s["tasks"].values()) for s in stages]
    mean = sum(o * n for o, n in zip(over, tasks, strict=True)) / max(1, sum(tasks))
    return {
        "label": label,
        "processes": plan_processes(plan),
        "cores": os.cpu_count() or 1,
        "overhead_ms_per_task": mean,
        "stage_overhead_ms": over,
        "real_ms_per_task": sum(s["ms"]["real_compute"] for s in stages) / max(1, sum(tasks)),
        "planned_ms_per_task": sum(s["planned_ms"] for s in stages) / max(1, sum(tasks)),
        "measured": measured,
        "predicted_without": _predict(plan, 0.0),
        "predicted_with_measured": _predict(plan, mean),
        "loadavg": os.getloadavg()[0],
        "plan": plan.to_dict(),
    }


def readme_job(tmp: Path, steps: int) -> dict[str, Any]:
    """The README main job (``hetpipe run examples/emulated_cluster.yaml``), profiled."""
    out = Path(tempfile.mkdtemp(dir=tmp)) / "readme"
    env = {**os.environ, "PYTHONPATH": str(REPO), "COLUMNS": "200"}
    extra = ["--steps", str(steps)] if steps else []
    cmd = [sys.executable, "-m", "hetpipe", "run", "examples/emulated_cluster.yaml", "--no-progress",
           "--profile-runtime", "--checkpoint-every", "0", "--out", str(out), *extra]  # fmt: skip
    subprocess.run(cmd, cwd=REPO, env=env, check=True, capture_output=True, timeout=600)
    summary = json.loads((out / "summary.json").read_text())
    plan = load_plan(out / "plan.json")
    if summary["nm"] != plan.nm:
        plan = replace(plan, nm=summary["nm"])
    return _row("readme", plan, summary["throughput"], summary["runtime_breakdown"])


def links_runs(tmp: Path, steps: int) -> list[Callable[[], dict[str, Any]]]:
    """``bench_links.py``'s three plans (scale 50, batch 32), each a profiled run."""
    from bench_links import MODEL, bench_cluster, plans

    from hetpipe.api import train
    from runtime.results.breakdown import breakdown_json

    def one(label: str, plan: Plan) -> Callable[[], dict[str, Any]]:
        def run() -> dict[str, Any]:
            res = train(MODEL, plan=plan, steps=steps, out=tempfile.mkdtemp(dir=tmp), profile_runtime=True,
                        return_state=False)  # fmt: skip
            return _row(label, plan, res.throughput, breakdown_json(res.stages))

        return run

    return [one(label, p) for label, p in plans(bench_cluster(50.0), 32)]


def one_vw(tmp: Path, steps: int) -> dict[str, Any]:
    """``bench_runtime.py``'s one VW (resnet, batch 8, Nm 4, V R G Q), profiled; predicted
    from the run's own calibration, as that benchmark does."""
    from bench_runtime import _bench_cluster, time_balanced_cuts

    from planner.manual import manual_plan
    from profiler.graph import ModelGraph
    from runtime.config import ModelSource, OptimizerConfig, RunConfig
    from runtime.launch.launcher import launch
    from runtime.results.breakdown import breakdown_json
    from runtime.spec import RunSpec
    from runtime.stage.emulation import Calibration
    from runtime.stage.model import resolve_source

    model, batch, nm, out = "resnet", 8, 4, Path(tempfile.mkdtemp(dir=tmp)) / "vw"
    source = ModelSource(ref=model)
    graph = ModelGraph.from_spec(resolve_source(source, batch, meta=True))
    cluster = _bench_cluster()
    speeds = [d.emulation.speed for d in cluster.devices if d.emulation]
    cuts = time_balanced_cuts(model, batch, speeds)
    plan = manual_plan(graph, cuts, model, batch, nm, cluster)
    config = RunConfig(steps=steps, out_dir=out, timeout_s=120, profile_runtime=True)
    result = launch(plan, source, RunSpec(config, OptimizerConfig(lr=0.01)))
    cal = Calibration.load(out / "calibration.json")
    fwd = [cal.fwd_s[s] / speeds[s] * 1e3 for s in range(len(speeds))]
    bwd = [cal.bwd_s[s] / speeds[s] * 1e3 for s in range(len(speeds))]
    timed = manual_plan(graph, cuts, model, batch, nm, cluster, fwd_ms=fwd, bwd_ms=bwd)
    return _row("one-vw", timed, result.throughput, breakdown_json(result.stages))


def fit(rows: list[dict[str, Any]], max_load: float) -> dict[str, Any]:
    """Least squares of ``overhead = c * max(1, processes / cores)`` over the pipelined runs
    made at a load average up to ``max_load`` (the model leaves the AllReduce baseline's one
    task per step out: it charges it 0), each run weighted alike; the fitted ``c`` and every
    fitted run's residual (ms).

    Raises:
        SystemExit: no run qualifies (raise ``--max-load``).
    """
    rows = [r for r in rows if r["label"] != "AllReduce" and r["loadavg"] <= max_load]
    if not rows:
        raise SystemExit(f"--max-load {max_load}: no pipelined run was that quiet; raise it")
    xs = [max(1.0, r["processes"] / r["cores"]) for r in rows]
    ys = [r["overhead_ms_per_task"] for r in rows]
    c = sum(x * y for x, y in zip(xs, ys, strict=True)) / sum(x * x for x in xs)
    res = [y - c * x for x, y in zip(xs, ys, strict=True)]
    return {
        "runs": len(rows),
        "ms_per_task": c,
        "residual_ms": res,
        "rms_ms": math.sqrt(statistics.mean(r * r for r in res)),
    }


def measure(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Every run ``args.repeat`` times, alternating, one line each as it ends (the rows so far
    written to ``args.out`` after each)."""
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp_s:
        tmp = Path(tmp_s)
        runs: list[tuple[str, Callable[[], dict[str, Any]]]] = [
            ("readme", lambda: readme_job(tmp, args.readme_steps)),
            *zip(("ED", "HD", "AllReduce"), links_runs(tmp, args.links_steps), strict=True),
            ("one-vw", lambda: one_vw(tmp, args.vw_steps)),
        ]
        for rnd in range(args.repeat):
            for label, run in runs:
                if args.only and label not in args.only:
                    continue
                row = {**run(), "round": rnd}
                rows.append(row)
                print(f"{label:9s} round {rnd}: P={row['processes']} overhead "
                      f"{row['overhead_ms_per_task']:.3f} ms/task, measured {row['measured']:.0f}, "
                      f"predicted {row['predicted_without']:.0f} "
                      f"({row['measured'] / row['predicted_without']:.2f}), with measured "
                      f"overhead {row['predicted_with_measured']:.0f} "
                      f"({row['measured'] / row['predicted_with_measured']:.2f}), "
                      f"load {row['loadavg']:.1f}", flush=True)  # fmt: skip
                args.out.parent.mkdir(parents=True, exist_ok=True)
                args.out.write_text(json.dumps({"rows": rows}, indent=1))
    return rows


def report(rows: list[dict[str, Any]], model: dict[str, Any]) -> None:
    """Each run predicted again with the fitted model: its overhead, measured / predicted."""
    fitted = RuntimeOverhead(ms_per_task=model["ms_per_task"], cores=model["cores"])
    for r in rows:
        plan = Plan.from_dict(r["plan"])
        r["predicted_without"] = _predict(plan, 0.0)  # again: rows of older --out files too
        plan = replace(plan, cluster=replace(plan.cluster, runtime_overhead=fitted))
        over = plan_overhead_ms(plan)
        r["model_overhead_ms"] = over
        r["predicted_with_model"] = _predict(plan, over)
        print(f"  {r['label']:9s} round {r['round']}: model {over:.3f} ms/task (measured "
              f"{r['overhead_ms_per_task']:.3f}), load {r['loadavg']:.1f}; measured/predicted "
              f"{r['measured'] / r['predicted_without']:.2f} without, "
              f"{r['measured'] / r['predicted_with_model']:.2f} with the model")  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=2, help="rounds of every run, alternating")
    ap.add_argument("--readme-steps", type=int, default=0, help="0: the README's own")
    ap.add_argument("--links-steps", type=int, default=60)
    ap.add_argument("--vw-steps", type=int, default=24)
    ap.add_argument("--max-load", type=float, default=4.0, help="fit runs up to this load")
    ap.add_argument("--only", nargs="*", default=[], help="labels to run (default: all)")
    ap.add_argument("--rows", nargs="*", type=Path, default=[],
                    help="fit the runs of earlier --out files instead of running")  # fmt: skip
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args()
    if args.rows:
        rows = [r for f in args.rows for r in json.loads(f.read_text())["rows"]]
    else:
        rows = measure(args)
    cores = rows[0]["cores"] if rows else os.cpu_count() or 1
    model = {**fit(rows, args.max_load), "max_load": args.max_load, "cores": cores}
    print(f"fit: ms_per_task {model['ms_per_task']:.3f} (x max(1, processes / {cores} cores)), "
          f"rms residual {model['rms_ms']:.3f} ms over {model['runs']} runs at load <= "
          f"{args.max_load}; cluster.yaml: runtime_overhead: {{ms_per_task: "
          f"{model['ms_per_task']:.2f}, cores: {cores}}}")  # fmt: skip
    report(rows, model)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"fit": model, "rows": rows}, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
