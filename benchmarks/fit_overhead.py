"""Fit the runtime-overhead model (``planner.overhead``) from ``--profile-runtime`` runs.

Runs, alternating, ``--repeat`` times: the README main job (``examples/emulated_cluster.yaml``;
``--readme-nm 1 2 3 5``: at each Nm, which shows per-wave costs apart from per-task ones),
``bench_links.py``'s ED, HD and AllReduce plans, and ``bench_runtime.py``'s one emulated VW,
each with ``--profile-runtime``. Every stage of every run gives its measured overhead per task
(:meth:`runtime.results.breakdown.Breakdown.overhead_ms_per_task`) beside what the model's terms
depend on: the plan's processes, its Nm, the stage's tasks per wave and parameter bytes. The
script fits every model of :data:`MODELS` over the stages (non-negative least squares; each
term ``x max(1, processes / cores)``, :class:`planner.overhead.RuntimeOverhead`): the one
per-task constant and the per-wave terms added; prints a table of the stages with each model's
figure, each model's rms residual, a held-out check (fit on all but one plan family, the rms
on the one left out), the terms' relative sizes with each run given its own load scale (what a
loaded machine still shows), and each plan's measured / predicted without overhead, with the
one constant and with the full model; last the ``runtime_overhead:`` line for a cluster file.
Writes ``benchmarks/results/overhead_fit.json``.

    python benchmarks/fit_overhead.py --repeat 2          # ~6 minutes on a quiet machine
    python benchmarks/fit_overhead.py --repeat 1 --links-steps 20 --out /tmp/fit.json  # smoke
    python benchmarks/fit_overhead.py --rows benchmarks/results/overhead_fit.json  # refit

The machine is shared (2 cores): the load average is recorded next to every run; fit runs
made on a quiet machine (``--max-load``).
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
from functools import partial
from itertools import chain, combinations
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from planner.overhead import (  # noqa: E402
    MB,
    RuntimeOverhead,
    plan_overhead_ms,
    plan_processes,
    plan_wave_overhead_ms,
)
from planner.plan import Plan  # noqa: E402
from planner.plan_file import load_plan  # noqa: E402

RESULTS = REPO / "benchmarks" / "results" / "overhead_fit.json"
WAVES = 20  # simulated waves per VW when a row does not say how many waves its run had


def run_waves(row: dict[str, Any]) -> int:
    """The waves a row's run trained (its last stage's tasks over Nm; at least 2), so that
    measured and predicted throughput cover the same waves: a run of 64 minibatches at
    Nm 32 is 2 waves, whose warm-up and drain the 20-wave steady state does not have
    (:func:`planner.throughput.measured_throughput`). Rows without stages: :data:`WAVES`.

    >>> run_waves({"stages": [{"nm": 32, "last": False, "tasks": 128},
    ...                        {"nm": 32, "last": True, "tasks": 64}]})
    2
    """
    last = [s for s in row.get("stages") or () if s.get("last")]
    if not last:
        return WAVES
    return max(2, min(s["tasks"] for s in last) // max(1, last[0]["nm"]))


def _predict(plan: Plan, overhead_ms: float | None, waves: int = WAVES) -> float:
    """``plan``'s throughput over ``waves`` waves with ``overhead_ms`` per task (``None``: the
    terms its prediction records, :func:`charged`); an AllReduce plan's is its own
    prediction (the collective's model, which the pipeline simulator does not play, and no
    overhead: :func:`planner.overhead.plan_overhead_ms`)."""
    from planner.rules import layout
    from planner.sim.simulator import simulate

    if layout(plan.sync) == "ddp":
        return plan.predicted.throughput
    return simulate(plan, waves=waves, overhead_ms_per_task=overhead_ms).throughput


def _backfilled(row: dict[str, Any]) -> dict[str, Any]:
    """A row of an ``--out`` file written before the per-stage entries: its stages rebuilt
    from its plan and its stages' overheads (in VW, then stage order, as the runtime lists
    them)."""
    plan = Plan.from_dict(row["plan"])
    where = [{"vw": v, "stage": s, "tasks": {}, "ms": {}} for v, vw in enumerate(plan.virtual_workers)
             for s in range(len(vw.stages))]  # fmt: skip
    for w, over in zip(where, row["stage_overhead_ms"], strict=True):
        w["overhead_ms_per_task"] = over
    return {**row, "family": row["label"].split("-nm")[0], "stages": _stage_rows(plan, where)}


def charged(plan: Plan, model: RuntimeOverhead) -> Plan:
    """``plan`` on a cluster with ``model``, its prediction recording the terms the planner
    would assume (what the simulator then charges)."""
    plan = replace(plan, cluster=replace(plan.cluster, runtime_overhead=model))
    per_wave, per_mb = plan_wave_overhead_ms(plan)
    pred = replace(plan.predicted, overhead_ms_per_task=plan_overhead_ms(plan),
                   overhead_ms_per_wave=per_wave, overhead_ms_per_mb=per_mb)  # fmt: skip
    return replace(plan, predicted=pred)


def _stage_rows(plan: Plan, stages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each profiled stage with what the model terms depend on: its Nm, parameter bytes, tasks
    per wave (``2 Nm``; ``Nm`` on a last stage, whose tasks are fused ``FB``), whether it
    pushes to parameter servers, its measured overhead per task and categories per task."""
    from planner.rules import layout

    shards = layout(plan.sync) == "shards" and any(sh.param_bytes > 0 for sh in plan.shards)
    out = []
    for s in stages:
        vw = plan.virtual_workers[s["vw"]]
        last = s["stage"] == len(vw.stages) - 1
        n = max(1, sum(s["tasks"].values()))
        out.append({
            "vw": s["vw"], "stage": s["stage"], "nm": plan.nm, "last": last,
            "param_bytes": vw.stages[s["stage"]].param_bytes, "ps": shards,
            "tasks_per_wave": plan.nm * (1 if last else 2), "tasks": n,
            "overhead_ms_per_task": s["overhead_ms_per_task"],
            "ms_per_task": {c: ms / n for c, ms in s["ms"].items()},
        })  # fmt: skip
    return out


def _row(label: str, plan: Plan, measured: float, stages: list[dict[str, Any]]) -> dict[str, Any]:
    """One run: its plan's processes, its stages' overhead per task, both predictions."""
    plan = replace(plan, predicted=replace(plan.predicted, overhead_ms_per_task=0.0))
    over = [s["overhead_ms_per_task"] for s in stages]
    tasks = [sum(s["tasks"].values()) for s in stages]
    mean = sum(o * n for o, n in zip(over, tasks, strict=True)) / max(1, sum(tasks))
    waves = run_waves({"stages": _stage_rows(plan, stages)})
    return {
        "label": label,
        "family": label.split("-nm")[0],
        "processes": plan_processes(plan),
        "cores": os.cpu_count() or 1,
        "overhead_ms_per_task": mean,
        "stage_overhead_ms": over,
        "stages": _stage_rows(plan, stages),
        "real_ms_per_task": sum(s["ms"]["real_compute"] for s in stages) / max(1, sum(tasks)),
        "planned_ms_per_task": sum(s["planned_ms"] for s in stages) / max(1, sum(tasks)),
        "measured": measured,
        "waves": waves,
        "predicted_without": _predict(plan, 0.0, waves),
        "predicted_with_measured": _predict(plan, mean, waves),
        "loadavg": os.getloadavg()[0],
        "plan": plan.to_dict(),
    }


def readme_job(tmp: Path, steps: int, nm: int = 0) -> dict[str, Any]:
    """The README main job (``hetpipe run examples/emulated_cluster.yaml``), profiled, at
    ``--nm nm`` (0: the plan's own)."""
    out = Path(tempfile.mkdtemp(dir=tmp)) / "readme"
    env = {**os.environ, "PYTHONPATH": str(REPO), "COLUMNS": "200"}
    extra = ["--steps", str(steps)] if steps else []
    extra += ["--nm", str(nm)] if nm else []
    cmd = [sys.executable, "-m", "hetpipe", "run", "examples/emulated_cluster.yaml", "--no-progress",
           "--profile-runtime", "--checkpoint-every", "0", "--out", str(out), *extra]  # fmt: skip
    subprocess.run(cmd, cwd=REPO, env=env, check=True, capture_output=True, timeout=600)
    summary = json.loads((out / "summary.json").read_text())
    plan = load_plan(out / "plan.json")
    if summary["nm"] != plan.nm:
        plan = replace(plan, nm=summary["nm"])
    label = f"readme-nm{plan.nm}" if nm else "readme"
    return _row(label, plan, summary["throughput"], summary["runtime_breakdown"])


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


TERMS = ("ms_per_task", "ms_per_wave", "ms_per_mb", "ms_per_mb_step")
"""The candidate terms, in the order of :func:`features`: per task, per stage per wave
through parameter servers, per MB of the stage's parameters per such wave, and per MB per
minibatch (the optimizer step and gradient checks of every backward)."""

MODELS = {
    "task": ("ms_per_task",),
    "task+wave": ("ms_per_task", "ms_per_wave"),
    "task+mb": ("ms_per_task", "ms_per_mb"),
    "task+wave+mb": ("ms_per_task", "ms_per_wave", "ms_per_mb"),
    "task+step": ("ms_per_task", "ms_per_mb_step"),
    "task+wave+step": ("ms_per_task", "ms_per_wave", "ms_per_mb_step"),
}
"""The models compared: the one constant (session 8's) and the candidate terms added."""


def features(row: dict[str, Any], st: dict[str, Any]) -> list[float]:
    """What each term contributes to ``st``'s overhead per task, per ms of the term: the
    stretch per task; the stretch over the stage's tasks per wave (through parameter servers
    only), and that times the stage's parameter MB; the stretch times the MB over the stage's
    tasks per minibatch (2; 1 on a last stage)."""
    stretch = max(1.0, row["processes"] / row["cores"])
    wave = stretch / st["tasks_per_wave"] if st["ps"] else 0.0
    mb = st["param_bytes"] / MB
    return [stretch, wave, wave * mb, stretch * mb / (1 if st["last"] else 2)]


def nnls(xs: list[list[float]], ys: list[float]) -> list[float]:
    """Non-negative least squares of ``ys ~ xs @ c`` by trying every subset of the columns
    (a few at most) and keeping the best whose coefficients are all >= 0."""
    import torch

    best: tuple[float, list[float]] = (math.inf, [0.0] * len(xs[0]))
    y = torch.tensor(ys, dtype=torch.float64).unsqueeze(1)
    for cols in chain.from_iterable(
        combinations(range(len(xs[0])), k) for k in range(1, len(xs[0]) + 1)
    ):
        a = torch.tensor([[x[j] for j in cols] for x in xs], dtype=torch.float64)
        sol = torch.linalg.lstsq(a, y, driver="gelsd").solution.squeeze(1).tolist()
        if min(sol) < 0:
            continue
        coef = [0.0] * len(xs[0])
        for j, c in zip(cols, sol, strict=True):
            coef[j] = c
        rss = float(((a @ torch.tensor(sol, dtype=torch.float64).unsqueeze(1) - y) ** 2).sum())
        if rss < best[0] - 1e-12:
            best = (rss, coef)
    return best[1]


def _stages(rows: list[dict[str, Any]]) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    return [(r, st) for r in rows for st in r["stages"]]


def fit_model(rows: list[dict[str, Any]], terms: tuple[str, ...]) -> dict[str, float]:
    """The non-negative least-squares fit of ``terms`` over every stage of ``rows`` (each
    stage weighted alike); the terms left out are 0."""
    pairs = _stages(rows)
    keep = [TERMS.index(t) for t in terms]
    xs = [[features(r, st)[j] for j in keep] for r, st in pairs]
    coef = nnls(xs, [st["overhead_ms_per_task"] for _, st in pairs])
    return {t: coef[keep.index(TERMS.index(t))] if t in terms else 0.0 for t in TERMS}


def residuals(rows: list[dict[str, Any]], model: dict[str, float]) -> list[float]:
    """Measured minus modelled overhead per task of every stage of ``rows`` (ms)."""
    coef = [model[t] for t in TERMS]
    return [
        st["overhead_ms_per_task"] - sum(c * x for c, x in zip(coef, features(r, st), strict=True))
        for r, st in _stages(rows)
    ]


def fit_shape(
    rows: list[dict[str, Any]], terms: tuple[str, ...], rounds: int = 500
) -> dict[str, float]:
    """The terms' relative sizes, free of the load: each run gets its own scale (how much the
    machine's load stretched it), the terms are shared (alternating non-negative least squares
    until the ratios settle; normalised to ``ms_per_task`` = 1 when it is fitted)."""
    model = fit_model(rows, terms)
    keep = [TERMS.index(t) for t in terms]
    shape: dict[str, float] = {}
    for _ in range(rounds):
        pairs = [(r, st, _scale(r, model)) for r in rows for st in r["stages"]]
        xs = [[a * features(r, st)[j] for j in keep] for r, st, a in pairs]
        coef = nnls(xs, [st["overhead_ms_per_task"] for _, st, _ in pairs])
        model = {t: coef[keep.index(TERMS.index(t))] if t in terms else 0.0 for t in TERMS}
        norm = model["ms_per_task"] or max(model.values()) or 1.0
        before, shape = shape, {t: v / norm for t, v in model.items()}
        if before and max(abs(shape[t] - before[t]) for t in TERMS) < 1e-12:
            break
    return shape


def _scale(row: dict[str, Any], model: dict[str, float]) -> float:
    """The factor that fits ``model`` best to ``row``'s stages (least squares)."""
    fx = [sum(model[t] * x for t, x in zip(TERMS, features(row, st), strict=True))
          for st in row["stages"]]  # fmt: skip
    fy = sum(f * st["overhead_ms_per_task"] for f, st in zip(fx, row["stages"], strict=True))
    return fy / sum(f * f for f in fx) if any(fx) else 0.0


def shape_residuals(rows: list[dict[str, Any]], model: dict[str, float]) -> list[float]:
    """Each stage's residual under ``model`` scaled to its run, over its run's mean overhead."""
    out = []
    for r in rows:
        a = _scale(r, model)
        mean = statistics.mean(st["overhead_ms_per_task"] for st in r["stages"]) or 1.0
        out += [res / mean for res in residuals([r], {t: a * v for t, v in model.items()})]
    return out


def _rms(xs: list[float]) -> float:
    return math.sqrt(statistics.mean(x * x for x in xs)) if xs else math.nan


def fit(rows: list[dict[str, Any]], max_load: float) -> dict[str, Any]:
    """Every model of :data:`MODELS` fitted over the stages of the pipelined runs made at a
    load average up to ``max_load`` (the model charges the AllReduce baseline's one task per
    step 0: it is left out), with its rms residual, and a held-out check per plan family (fit
    on the other families, the rms on the one left out).

    Raises:
        SystemExit: no run qualifies (raise ``--max-load``).
    """
    rows = [r for r in rows if r["label"] != "AllReduce" and r["loadavg"] <= max_load]
    if not rows:
        raise SystemExit(f"--max-load {max_load}: no pipelined run was that quiet; raise it")
    families = sorted({r["family"] for r in rows})
    out: dict[str, Any] = {"runs": len(rows), "stages": len(_stages(rows)), "models": {}}

    def held_out(
        fit: Callable[..., Any], resid: Callable[..., list[float]], terms: Any
    ) -> dict[str, float]:
        """rms on each family left out of a fit on the others (one family: none)."""
        held = {}
        for fam in families if len(families) > 1 else []:
            train = [r for r in rows if r["family"] != fam]
            test = [r for r in rows if r["family"] == fam]
            held[fam] = _rms(resid(test, fit(train, terms)))
        return held

    for name, terms in MODELS.items():
        model = fit_model(rows, terms)
        held = held_out(fit_model, residuals, terms)
        res = residuals(rows, model)
        shape = fit_shape(rows, terms)
        held_shape = held_out(fit_shape, shape_residuals, terms)
        out["models"][name] = {**model, "rms_ms": _rms(res), "residual_ms": res, "held_out_rms_ms": held,
                               "shape": shape, "shape_rms": _rms(shape_residuals(rows, shape)),
                               "held_out_shape_rms": held_shape}  # fmt: skip
    return out


def stage_table(rows: list[dict[str, Any]], fitted: dict[str, Any]) -> None:
    """One line per stage: its Nm, parameter MB, tasks per wave, load, measured overhead per
    task and every model's."""
    names = list(MODELS)
    print(
        f"{'run':12s} rnd load vw/s   Nm    MB tpw  measured "
        + " ".join(f"{n:>12s}" for n in names)
    )
    for r, st in _stages(rows):
        model = [sum(fitted["models"][n][t] * x for t, x in zip(TERMS, features(r, st), strict=True))
                 for n in names]  # fmt: skip
        print(f"{r['label']:12s} {r['round']:3d} {r['loadavg']:4.1f} {st['vw']}/{st['stage']}  "
              f"{st['nm']:3d} {st['param_bytes'] / MB:5.2f} {st['tasks_per_wave']:3d} "
              f"{st['overhead_ms_per_task']:9.3f} " + " ".join(f"{m:12.3f}" for m in model))  # fmt: skip


def measure(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Every run ``args.repeat`` times, alternating, one line each as it ends (the rows so far
    written to ``args.out`` after each)."""
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp_s:
        tmp = Path(tmp_s)
        runs: list[tuple[str, Callable[[], dict[str, Any]]]] = [
            *(("readme", partial(readme_job, tmp, args.readme_steps, nm)) for nm in args.readme_nm),
            *zip(("ED", "HD", "AllReduce"), links_runs(tmp, args.links_steps), strict=True),
            ("one-vw", lambda: one_vw(tmp, args.vw_steps)),
        ]
        for rnd in range(args.repeat):
            for label, run in runs:
                if args.only and label not in args.only:
                    continue
                row = {**run(), "round": rnd}
                rows.append(row)
                print(f"{row['label']:9s} round {rnd}: P={row['processes']} overhead "
                      f"{row['overhead_ms_per_task']:.3f} ms/task, measured {row['measured']:.0f}, "
                      f"predicted {row['predicted_without']:.0f} "
                      f"({row['measured'] / row['predicted_without']:.2f}), with measured "
                      f"overhead {row['predicted_with_measured']:.0f} "
                      f"({row['measured'] / row['predicted_with_measured']:.2f}), "
                      f"load {row['loadavg']:.1f}", flush=True)  # fmt: skip
                args.out.parent.mkdir(parents=True, exist_ok=True)
                args.out.write_text(json.dumps({"rows": rows}, indent=1))
    return rows


def report(rows: list[dict[str, Any]], fitted: dict[str, Any]) -> None:
    """Each run predicted again with the one-term and the full fitted model: measured /
    predicted without overhead and with each."""
    cores = fitted["cores"]
    models = {n: RuntimeOverhead(m["ms_per_task"], cores, m["ms_per_wave"], m["ms_per_mb"])
              for n, m in fitted["models"].items() if n in ("task", "task+wave+mb")}  # fmt: skip
    for r in rows:
        plan = Plan.from_dict(r["plan"])
        waves = r["waves"] = run_waves(r)  # the run's own waves (older rows: none recorded)
        r["predicted_without"] = _predict(plan, 0.0, waves)  # again: older --out files too
        ratios = []
        for name, model in models.items():
            r[f"predicted_{name}"] = _predict(charged(plan, model), None, waves)
            ratios.append(f"{r['measured'] / r[f'predicted_{name}']:.2f} ({name})")
        print(f"  {r['label']:12s} round {r['round']}: {waves} waves, load {r['loadavg']:.1f}; measured/predicted "
              f"{r['measured'] / r['predicted_without']:.2f} without, " + ", ".join(ratios))  # fmt: skip


def yaml_block(model: dict[str, float], cores: int) -> str:
    """The ``runtime_overhead:`` block of a cluster file for a fitted model."""
    terms = ", ".join(f"{t}: {model[t]:.3g}" for t in TERMS if model[t] > 0 or t == "ms_per_task")
    return f"runtime_overhead: {{{terms}, cores: {cores}}}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=2, help="rounds of every run, alternating")
    ap.add_argument("--readme-steps", type=int, default=0, help="0: the README's own")
    ap.add_argument("--readme-nm", type=int, nargs="+", default=[0],
                    help="the README job at each --nm (0: the plan's own; e.g. 1 2 3 5: "
                    "per-wave costs show against Nm)")  # fmt: skip
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
        rows = [r if "stages" in r else _backfilled(r) for r in rows]
    else:
        rows = measure(args)
    cores = rows[0]["cores"] if rows else os.cpu_count() or 1
    fitted = {**fit(rows, args.max_load), "max_load": args.max_load, "cores": cores}
    used = [r for r in rows if r["label"] != "AllReduce" and r["loadavg"] <= args.max_load]
    stage_table(used, fitted)
    print(f"fits over {fitted['stages']} stages of {fitted['runs']} runs at load <= "
          f"{args.max_load} (x max(1, processes / {cores} cores)); held out: rms on each plan "
          "family when fitted on the others")  # fmt: skip
    for name, m in fitted["models"].items():
        held = ", ".join(f"{f} {v:.3f}" for f, v in m["held_out_rms_ms"].items())
        print(f"  {name:14s} " + " ".join(f"{t} {m[t]:.3f}" for t in TERMS)
              + f"; rms {m['rms_ms']:.3f} ms; held out: {held}")  # fmt: skip
    print("shapes (each run its own load scale; terms relative to ms_per_task; rms relative "
          "to each run's mean overhead):")  # fmt: skip
    for name, m in fitted["models"].items():
        held = ", ".join(f"{f} {v:.3f}" for f, v in m["held_out_shape_rms"].items())
        print(f"  {name:14s} " + " ".join(f"{t} {m['shape'][t]:.3f}" for t in TERMS)
              + f"; rms {m['shape_rms']:.3f}; held out: {held}")  # fmt: skip
    report(rows, fitted)
    print("cluster.yaml (the full model): " + yaml_block(fitted["models"]["task+wave+mb"], cores))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"fit": fitted, "rows": rows}, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
