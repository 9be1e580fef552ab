"""Time to a target test accuracy (or LM test loss): HetPipe (WSP) vs the DDP AllReduce baseline.

Paper Sec. 8.4: HetPipe reaches a target accuracy 35-49 % sooner than Horovod, because it also
uses the whimpy GPUs that cannot hold the model alone. Here both systems train end to end
through ``hetpipe run`` (one process per emulated device, paced to its speed, memory caps
enforced) on a cluster shaped like the paper's (``benchmarks/tta_cluster_*.yaml``: four GPU
types, two of each per node, a slower link between nodes), for two workloads:

- ``cnn``: a small ResNet (batch norm, SGD momentum 0.9) on scikit-learn's digits as 8 x 8
  images (``benchmarks/tta_tasks.py``); the whimpy devices cannot hold it; test accuracy;
- ``lm``: the tiny GPT-2 of ``examples/gpt2_lm.py`` on ``benchmarks/lm_task.py``'s Markov
  tokens (SGD momentum 0.9); test loss (nats per token, lower is better).

Method. **One run per system and seed**: it snapshots its weights every ``--snapshot-samples``
training samples (``--checkpoint-every`` clocks, ``--keep 0``) and trains for a fixed
training time (``--time-limit``); after it ends, every snapshot is evaluated here, offline,
on the run's test set (``benchmarks/tta_eval.py``), at its sample count and its **training
time, counted from the run's first finished minibatch** (start-up reported apart). HetPipe
trains the plan ``hetpipe plan`` makes (``--plan-args`` adds to that command, e.g.
``--objective time`` or ``--policy ed``); the baseline is ``--sync allreduce`` on the devices
that hold the model. Each system takes its own best learning rate from a grid (short runs,
seed 0; the best is the one reaching the target soonest, else the best final value); the
baseline's grid is HetPipe's times its world size (the linear-scaling rule: the same step per
sample), so it holds HetPipe's choice scaled. Then every seed trains each system at its chosen lr; the figure is the time
to target per seed and the ratio baseline / HetPipe (above 1: HetPipe is sooner), with mean,
min and max over the seeds.

Run: ``python benchmarks/bench_tta.py`` (the full mode prints its expected duration, about
45 min, and its progress; give it a quiet machine), or ``--quick`` (one seed, no grid, a few
seconds of training per run: a smoke check, not a figure). Writes
``benchmarks/results/tta.json`` and ``tta.png`` (``tta_quick.*`` with ``--quick``).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # run as a script: ``benchmarks.*`` from the repository root
    sys.path.insert(0, str(REPO))

from benchmarks.tta_eval import Point, evaluate_run, time_to_target  # noqa: E402

RESULTS = REPO / "benchmarks" / "results"


@dataclass(frozen=True)
class Workload:
    """One task both systems train.

    Attributes:
        name: ``cnn`` or ``lm``.
        title: for the plot.
        model: ``--model``; data: ``--data``; cluster: the cluster file.
        batch: samples per minibatch (per VW, per device).
        metric: ``accuracy`` (higher is better) or ``loss`` (lower is better).
        target: the value whose time is the figure.
        momentum: SGD momentum.
        lr_grid: HetPipe's learning rates to try (the baseline's: these x its world size).
        quick_lr: HetPipe's lr in ``--quick`` (no grid; the baseline at the linear rule).
        quick_target: the target in ``--quick``, one a few seconds reach (so the smoke check
            exercises the times to target and their ratio; not a figure).
        overhead_s: a run's seconds beyond its training time on a quiet machine (an
            estimate): CLI and process start-up, the run's own final test and outputs, the
            offline evaluation. Each run records its own (``process_s`` - ``wall_s``,
            ``eval_s``); under a load of 11-13 they reached 60 s (cnn) and 180-280 s (lm: every
            process captures GPT-2 with ``torch.export``).
    """

    name: str
    title: str
    model: str
    data: str
    cluster: Path
    batch: int
    metric: str
    target: float
    momentum: float
    lr_grid: tuple[float, ...]
    quick_lr: float
    quick_target: float
    overhead_s: float


WORKLOADS = {
    "cnn": Workload("cnn", "ResNet (batch norm) on digits images", "benchmarks.tta_tasks:digits_cnn",
                    "benchmarks.tta_tasks:digits_images", REPO / "benchmarks/tta_cluster_cnn.yaml",
                    32, "accuracy", 0.97, 0.9, (0.0025, 0.005, 0.01), 0.005, 0.5, 35.0),
    "lm": Workload("lm", "tiny GPT-2 on Markov tokens", "examples.gpt2_lm:tiny",
                   "benchmarks.tta_tasks:lm_data", REPO / "benchmarks/tta_cluster_lm.yaml",
                   16, "loss", 1.6, 0.9, (0.005, 0.01, 0.02), 0.01, 4.5, 60.0),
}  # fmt: skip


@dataclass(frozen=True)
class Budget:
    """How long each run trains and how often it snapshots.

    Attributes:
        train_s: ``--time-limit`` of a seed's run (training seconds).
        grid_s: ``--time-limit`` of a grid run (no grid: 0).
        seeds: seeds ``0 .. seeds-1``.
        snapshots: snapshots a seed's run should take (sets the snapshot period in samples
            from the plan's predicted throughput; a grid run keeps the same period).
    """

    train_s: float
    grid_s: float
    seeds: int
    snapshots: int


FULL = Budget(train_s=110.0, grid_s=20.0, seeds=3, snapshots=30)
QUICK = Budget(train_s=5.0, grid_s=0.0, seeds=1, snapshots=5)


@dataclass(frozen=True)
class Run:
    """One finished run, evaluated: its settings, curve and figures."""

    system: str  # "hetpipe" or "ddp"
    seed: int
    lr: float
    startup_s: float
    wall_s: float
    throughput: float
    points: tuple[Point, ...]
    time_to_target_s: float | None
    process_s: float = 0.0  # the whole ``hetpipe run`` command, start to exit
    eval_s: float = 0.0  # evaluating its snapshots here, afterwards
    skipped_updates: int = 0  # non-finite updates skipped (``--on-nonfinite skip``)
    samples_to_target: float | None = None  # training samples when it reached the target

    def final(self, metric: str) -> float:
        """The metric at the last snapshot (NaN: none)."""
        return getattr(self.points[-1], metric) if self.points else math.nan


@dataclass(frozen=True)
class Plans:
    """Both systems' plan files and what sets their snapshot periods."""

    hetpipe: Path
    ddp: Path
    samples_per_clock: dict[str, int]  # system -> training samples per global clock
    workers: dict[str, int]  # system -> VWs (the baseline: devices)
    predicted: dict[str, float]  # system -> predicted samples/s


def hetpipe_cmd(*args: str) -> list[str]:
    """``python -m hetpipe ARGS`` (this interpreter, this checkout)."""
    return [sys.executable, "-m", "hetpipe", *args]


def _check(cmd: list[str], timeout_s: float) -> None:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, check=False,
                          cwd=REPO, env=env)  # fmt: skip
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")


def make_plans(w: Workload, plan_args: Sequence[str], folder: Path) -> Plans:
    """HetPipe's plan (``hetpipe plan`` with ``plan_args``) and the baseline's (``--sync
    allreduce``: every device that holds the model), written to ``folder``."""
    from planner.plan_file import load_plan

    common = [str(w.cluster), "--model", w.model, "--batch-size", str(w.batch)]
    common += ["--optimizer", "momentum" if w.momentum else "sgd"]
    het, ddp = folder / f"{w.name}_hetpipe.json", folder / f"{w.name}_ddp.json"
    _check(hetpipe_cmd("plan", *common, *plan_args, "-o", str(het)), 900)
    _check(hetpipe_cmd("plan", *common, "--sync", "allreduce", "-o", str(ddp)), 900)
    per_clock, workers, predicted = {}, {}, {}
    for system, path in (("hetpipe", het), ("ddp", ddp)):
        plan = load_plan(path)
        workers[system] = len(plan.virtual_workers)
        nm = 1 if system == "ddp" else plan.nm
        per_clock[system] = nm * plan.batch_size * workers[system]
        predicted[system] = plan.predicted.throughput
    return Plans(het, ddp, per_clock, workers, predicted)


def run_one(
    w: Workload, plans: Plans, system: str, seed: int, lr: float, train_s: float, every: int
) -> Run:
    """Train ``system`` for ``train_s`` seconds, snapshotting every ``every`` samples, then
    evaluate its snapshots (in this process)."""
    per_clock = plans.samples_per_clock[system]
    clocks = max(1, round(every / per_clock))
    cap = math.ceil(4 * plans.predicted[system] * train_s / per_clock) + clocks  # time ends it
    plan = plans.hetpipe if system == "hetpipe" else plans.ddp
    with tempfile.TemporaryDirectory(prefix=f"tta-{w.name}-{system}-") as tmp:
        out = Path(tmp)
        steps = cap * (1 if system == "ddp" else per_clock // (w.batch * plans.workers[system]))
        cmd = hetpipe_cmd("run", str(plan), "--data", w.data, "--seed", str(seed),
                          "--lr", f"{lr:g}", "--momentum", f"{w.momentum:g}",
                          "--steps", str(steps), "--time-limit", f"{train_s:g}",
                          "--checkpoint-every", str(clocks), "--keep", "0",
                          "--on-nonfinite", "skip",  # a grid lr that diverges loses, not stops
                          "--out", str(out), "--overwrite", "--no-progress")  # fmt: skip
        if system == "ddp":
            cmd += ["--sync", "allreduce"]
        t0 = time.perf_counter()
        _check(cmd, 600 + 3 * train_s)
        t1 = time.perf_counter()
        summary = json.loads((out / "summary.json").read_text())
        points, startup_s = evaluate_run(out, w.data, seed)
        t2 = time.perf_counter()
    return Run(system, seed, lr, startup_s, summary["wall_s"], summary["throughput"],
               tuple(points), time_to_target(points, w.target, w.metric), t1 - t0, t2 - t1,
               int(summary.get("skipped_updates") or 0),
               time_to_target(points, w.target, w.metric, "samples"))  # fmt: skip


def choose_lr(runs: Sequence[Run], metric: str) -> Run:
    """The grid run to keep: the soonest to reach the target; if none did, the best final
    value (accuracy: highest; loss: lowest; a NaN loss: never).

    >>> p = lambda v: (Point(1, 1, 1.0, v, 1 - v),)
    >>> a, b, c = (Run("x", 0, lr, 0, 0, 0, p(v), t) for lr, v, t in
    ...            ((0.1, 0.9, None), (0.2, 0.95, 30.0), (0.4, 0.97, 20.0)))
    >>> choose_lr([a, b, c], "accuracy").lr, choose_lr([a], "accuracy").lr
    (0.4, 0.1)
    """
    reached = [r for r in runs if r.time_to_target_s is not None]
    if reached:
        return min(reached, key=lambda r: r.time_to_target_s or 0.0)
    sign = 1.0 if metric == "accuracy" else -1.0
    return max(
        runs, key=lambda r: -math.inf if math.isnan(r.final(metric)) else sign * r.final(metric)
    )


def spread(values: Sequence[float | None]) -> dict[str, float | int | None]:
    """Mean, min and max of the values that exist, and how many do.

    >>> spread([1.0, None, 3.0])
    {'n': 2, 'mean': 2.0, 'min': 1.0, 'max': 3.0}
    """
    got = [v for v in values if v is not None and not math.isnan(v)]
    if not got:
        return {"n": 0, "mean": None, "min": None, "max": None}
    return {"n": len(got), "mean": sum(got) / len(got), "min": min(got), "max": max(got)}


def ratios(het: Sequence[Run], ddp: Sequence[Run]) -> list[float | None]:
    """Per seed: the baseline's time to target over HetPipe's (``None``: one never reached it)."""
    out: list[float | None] = []
    for h, d in zip(het, ddp, strict=True):
        th, td = h.time_to_target_s, d.time_to_target_s
        out.append(None if th is None or td is None or th <= 0 else td / th)
    return out


class Progress:
    """Prints each run as it starts with the elapsed and expected time of the whole benchmark."""

    def __init__(self, runs: int, expected_s: float) -> None:
        self.runs, self.expected_s, self.done = runs, expected_s, 0
        self.t0 = time.perf_counter()

    def step(self, what: str) -> None:
        """Say that run ``what`` starts."""
        self.done += 1
        elapsed = time.perf_counter() - self.t0
        print(f"[{self.done}/{self.runs}] {what} (elapsed {elapsed / 60:.1f} of "
              f"~{self.expected_s / 60:.0f} min)", flush=True)  # fmt: skip


def expected(budget: Budget, workloads: Sequence[Workload]) -> tuple[int, float]:
    """Runs and seconds the benchmark takes: the grid (each lr, both systems) and every seed of
    both systems, each run its training time plus the workload's ``overhead_s``."""
    runs = secs = 0.0
    for w in workloads:
        grid = 2 * len(w.lr_grid) if budget.grid_s > 0 else 0
        runs += grid + 2 * budget.seeds
        secs += grid * (budget.grid_s + w.overhead_s)
        secs += 2 * budget.seeds * (budget.train_s + w.overhead_s)
    return int(runs), secs


def tune(
    w: Workload, plans: Plans, budget: Budget, every: int, progress: Progress
) -> tuple[float, float, dict[str, list[dict[str, Any]]]]:
    """Each system's lr: the best of a grid of short seed-0 runs, HetPipe's over ``lr_grid``,
    the baseline's over ``lr_grid`` x its world size (the linear-scaling rule: the same step
    per sample as a HetPipe VW at that lr, so HetPipe's choice x world is always tried); in
    ``--quick``, HetPipe's ``quick_lr`` and its linear-scaling lr. Returns both lrs and the
    grid's runs."""
    world = plans.workers["ddp"]
    if budget.grid_s <= 0:
        return w.quick_lr, w.quick_lr * world, {}
    grid: dict[str, list[Run]] = {"hetpipe": [], "ddp": []}
    for system, scale in (("hetpipe", 1), ("ddp", world)):
        for lr in w.lr_grid:
            progress.step(f"{w.name} grid: {system} lr {lr * scale:g}")
            grid[system].append(run_one(w, plans, system, 0, lr * scale, budget.grid_s, every))
    het_lr = choose_lr(grid["hetpipe"], w.metric).lr
    ddp_lr = choose_lr(grid["ddp"], w.metric).lr
    print(
        f"{w.name}: chosen lr HetPipe {het_lr:g}, DDP {ddp_lr:g} (linear scaling {het_lr * world:g})"
    )
    return het_lr, ddp_lr, {k: [_record(r) for r in v] for k, v in grid.items()}


def _record(r: Run) -> dict[str, Any]:
    return {**asdict(r), "points": [asdict(p) for p in r.points]}


def bench_workload(
    w: Workload, budget: Budget, plan_args: Sequence[str], progress: Progress, folder: Path
) -> dict[str, Any]:
    """Plan, tune, train every seed of both systems and compare their times to target."""
    plans = make_plans(w, plan_args, folder)
    every = max(w.batch, round(plans.predicted["hetpipe"] * budget.train_s / budget.snapshots))
    het_lr, ddp_lr, grid = tune(w, plans, budget, every, progress)
    runs: dict[str, list[Run]] = {"hetpipe": [], "ddp": []}
    for seed in range(budget.seeds):
        for system, lr in (("hetpipe", het_lr), ("ddp", ddp_lr)):
            progress.step(f"{w.name} seed {seed}: {system} lr {lr:g}")
            r = run_one(w, plans, system, seed, lr, budget.train_s, every)
            runs[system].append(r)
            print(f"  {system}: start-up {r.startup_s:.1f} s, {r.throughput:.0f} samples/s, "
                  f"{w.metric} {r.final(w.metric):.4f} at the end, target {w.target:g} after "
                  f"{_secs(r.time_to_target_s)}", flush=True)  # fmt: skip
    per_seed = ratios(runs["hetpipe"], runs["ddp"])
    out = {
        "workload": {**asdict(w), "cluster": str(w.cluster.relative_to(REPO))},
        "plan_args": list(plan_args),
        "workers": plans.workers,
        "predicted_throughput": plans.predicted,
        "snapshot_every_samples": every,
        "lr": {
            "hetpipe": het_lr,
            "ddp": ddp_lr,
            "ddp_linear_scaling": het_lr * plans.workers["ddp"],
        },
        "grid": grid,
        "runs": {k: [_record(r) for r in v] for k, v in runs.items()},
        "time_to_target_s": {k: spread([r.time_to_target_s for r in v]) for k, v in runs.items()},
        "samples_to_target": {k: spread([r.samples_to_target for r in v]) for k, v in runs.items()},
        "throughput": {k: spread([r.throughput for r in v]) for k, v in runs.items()},
        "startup_s": {k: spread([r.startup_s for r in v]) for k, v in runs.items()},
        "final": {k: spread([r.final(w.metric) for r in v]) for k, v in runs.items()},
        "ratio_ddp_over_hetpipe": {"per_seed": per_seed, **spread(per_seed)},
    }
    _say(w, out)
    return out


def _secs(t: float | None) -> str:
    return "never" if t is None else f"{t:.1f} s"


def _say(w: Workload, out: dict[str, Any]) -> None:
    r = out["ratio_ddp_over_hetpipe"]
    shown = "n/a (a system missed the target)" if r["mean"] is None else (
        f"mean {r['mean']:.2f} (min {r['min']:.2f}, max {r['max']:.2f}, {r['n']} seeds)")  # fmt: skip
    print(f"{w.name}: time to {w.metric} {w.target:g}, DDP / HetPipe: {shown}", flush=True)


def plot(results: dict[str, dict[str, Any]], path: Path) -> None:
    """Per workload, the metric against training time and against samples: every seed of both
    systems (the target dashed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(results), 2, figsize=(11, 4 * len(results)), squeeze=False)
    colours = {"hetpipe": "tab:blue", "ddp": "tab:orange"}
    names = {"hetpipe": "HetPipe (WSP)", "ddp": "DDP AllReduce"}
    for row, (name, res) in zip(axes, results.items(), strict=True):
        w = res["workload"]
        for ax, x, xlabel in ((row[0], "train_s", "training time (s)"),
                              (row[1], "samples", "training samples")):  # fmt: skip
            for system, runs in res["runs"].items():
                for k, r in enumerate(runs):
                    ax.plot([p[x] for p in r["points"]], [p[w["metric"]] for p in r["points"]],
                            color=colours[system], alpha=0.8, lw=1.2, marker=".",
                            label=f"{names[system]} (lr {r['lr']:g})" if k == 0 else None)  # fmt: skip
            ax.axhline(w["target"], color="grey", lw=0.8, ls="--")
            ax.set_xlabel(xlabel)
            ax.set_ylabel(f"test {w['metric']}")
            ax.set_title(f"{name}: {w['title']}", fontsize=10)
            ax.grid(alpha=0.3)
            ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: Sequence[str] | None = None) -> None:
    """Run the benchmark, print the times to target and their ratios, write JSON and plot."""
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="one seed, no grid, seconds per run")
    ap.add_argument("--workloads", nargs="+", choices=sorted(WORKLOADS), default=sorted(WORKLOADS))
    ap.add_argument(
        "--plan-args", default="", help="added to 'hetpipe plan', e.g. '--objective time'"
    )
    ap.add_argument("--seeds", type=int, default=0, help="seeds (0 = the mode's: 3, --quick 1)")
    ap.add_argument("--train-s", type=float, default=0.0, help="training seconds per seed's run")
    ap.add_argument("--out", type=Path, default=None, help="JSON to write (and .png beside it)")
    args = ap.parse_args(argv)
    budget = QUICK if args.quick else FULL
    budget = replace(
        budget, seeds=args.seeds or budget.seeds, train_s=args.train_s or budget.train_s
    )
    workloads = [WORKLOADS[n] for n in args.workloads]
    if args.quick:
        workloads = [replace(w, target=w.quick_target) for w in workloads]
    runs, secs = expected(budget, workloads)
    print(f"{runs} runs, expected about {secs / 60:.0f} min "
          f"({'quick' if args.quick else 'full'} mode; more on a loaded machine)", flush=True)  # fmt: skip
    progress = Progress(runs, secs)
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="tta-plans-") as tmp:
        results = {w.name: bench_workload(w, budget, args.plan_args.split(), progress, Path(tmp))
                   for w in workloads}  # fmt: skip
    out_path = args.out or RESULTS / ("tta_quick.json" if args.quick else "tta.json")
    doc = {"mode": "quick" if args.quick else "full", "budget": asdict(budget), "results": results,
           "seconds": time.perf_counter() - t0, "loadavg": os.getloadavg()}  # fmt: skip
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text(json.dumps(doc, indent=1) + "\n")
    plot(results, out_path.with_suffix(".png"))
    print(f"wrote {out_path} and {out_path.with_suffix('.png')}")


if __name__ == "__main__":
    main()
