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
that hold the model; ``--time-objective`` adds a third system, ``hetpipe-time``: the plan
``hetpipe plan --objective time`` picks (``benchmarks/tta_plans.py``), side by side, to show
the planner's "never slower" rule (when it picks the AllReduce plan, its runs are DDP's).
Each system takes its own best learning rate from a grid (short runs at seeds ``0 ..
grid_seeds - 1``, 2 by default; the best is the lr reaching the target on every grid seed
soonest on average, else the best mean final value: one lucky seed does not pick an unstable
lr); an AllReduce plan's grid is
HetPipe's times its world size (the linear-scaling rule: the same step per sample), so it holds
HetPipe's choice scaled. While a system's best lr is the lowest or the highest of its grid, the
grid is extended one step (x0.5 or x2), at most ``MAX_EXTENSIONS`` times (``grid_extended`` in
the JSON). Then every seed trains each system at its chosen lr; the figure is the time to
target per seed and the ratio baseline / HetPipe (above 1: HetPipe is sooner), with mean, min
and max over the seeds.

Run: ``python benchmarks/bench_tta.py`` (the full mode prints its expected duration, about
an hour, and its progress; give it a quiet machine), or ``--quick`` (one seed, no grid, a few
seconds of training per run: a smoke check, not a figure). Writes
``benchmarks/results/tta.json`` and ``tta.png`` (``tta_quick.*`` with ``--quick``).
"""

from __future__ import annotations

import argparse
import json
import math
import os
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
from benchmarks.tta_plans import (  # noqa: E402
    SYSTEMS,
    TITLES,
    SystemPlan,
    check,
    hetpipe_cmd,
    make_plans,
)
from benchmarks.tta_plot import plot  # noqa: E402

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
            ``lm``'s lies 2-8x below DDP's best per VW (0.04 / 4): at 4 VWs x ``Nm = 3``
            HetPipe collapses to the unigram loss from lr 0.005 up (docs/convergence.md, "Why HetPipe stayed
            at the unigram loss").
        quick_lr: HetPipe's lr in ``--quick`` (no grid; the baseline at the linear rule).
        quick_target: the target in ``--quick``, one a few seconds reach (so the smoke check
            exercises the times to target and their ratio; not a figure).
        overhead_s: a run's seconds beyond its training time on a quiet machine (an
            estimate): CLI and process start-up, the run's own final test and outputs, the
            offline evaluation. Each run records its own (``process_s`` - ``wall_s``,
            ``eval_s``); under a load of 11-13 they reached 60 s (cnn) and 180-280 s (lm: every
            process captures GPT-2 with ``torch.export``).
        calibrate: ``hetpipe-time`` calibrates the efficiency model on ``data``
            (``--calibrate-efficiency``, each setting at its best step size; ``False``: the
            model's defaults).
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
    calibrate: bool = True


WORKLOADS = {
    "cnn": Workload("cnn", "ResNet (batch norm) on digits images", "benchmarks.tta_tasks:digits_cnn",
                    "benchmarks.tta_tasks:digits_images", REPO / "benchmarks/tta_cluster_cnn.yaml",
                    32, "accuracy", 0.97, 0.9, (0.0025, 0.005, 0.01), 0.005, 0.5, 35.0),
    "lm": Workload("lm", "tiny GPT-2 on Markov tokens", "examples.gpt2_lm:tiny",
                   "benchmarks.tta_tasks:lm_data", REPO / "benchmarks/tta_cluster_lm.yaml",
                   16, "loss", 1.6, 0.9, (0.00125, 0.0025, 0.005), 0.01, 4.5, 60.0),
}  # fmt: skip


@dataclass(frozen=True)
class Budget:
    """How long each run trains and how often it snapshots.

    Attributes:
        train_s: ``--time-limit`` of a seed's run (training seconds).
        grid_s: ``--time-limit`` of a grid run (no grid: 0).
        seeds: seeds ``0 .. seeds-1``.
        grid_seeds: seeds ``0 .. grid_seeds-1`` each lr of a grid runs at (its choice is
            judged on their mean: :func:`choose_lr`).
        snapshots: snapshots a seed's run should take (sets the snapshot period in samples
            from the plan's predicted throughput; a grid run keeps the same period).
    """

    train_s: float
    grid_s: float
    seeds: int
    snapshots: int
    grid_seeds: int = 2


FULL = Budget(train_s=110.0, grid_s=20.0, seeds=3, snapshots=30)
QUICK = Budget(train_s=5.0, grid_s=0.0, seeds=1, snapshots=5, grid_seeds=1)
MAX_EXTENSIONS = 2  # lrs a grid may add beyond its edge, one step (x0.5 or x2) each


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


def run_one(
    w: Workload, system: str, plan: SystemPlan, seed: int, lr: float, train_s: float, every: int
) -> Run:
    """Train ``system`` (its ``plan``) for ``train_s`` seconds, snapshotting every ``every``
    samples, then evaluate its snapshots (in this process)."""
    clocks = max(1, round(every / plan.per_clock))
    cap = math.ceil(4 * plan.predicted * train_s / plan.per_clock) + clocks  # time ends it
    with tempfile.TemporaryDirectory(prefix=f"tta-{w.name}-{system}-") as tmp:
        out = Path(tmp)
        cmd = hetpipe_cmd("run", str(plan.path), "--data", w.data, "--seed", str(seed),
                          "--lr", f"{lr:g}", "--momentum", f"{w.momentum:g}",
                          "--remedy", plan.remedy,  # the plan's rule and remedy
                          "--steps", str(cap * plan.nm), "--time-limit", f"{train_s:g}",
                          "--checkpoint-every", str(clocks), "--keep", "0",
                          "--on-nonfinite", "skip",  # a grid lr that diverges loses, not stops
                          "--out", str(out), "--overwrite", "--no-progress")  # fmt: skip
        t0 = time.perf_counter()
        check(cmd, 600 + 3 * train_s)
        t1 = time.perf_counter()
        summary = json.loads((out / "summary.json").read_text())
        points, startup_s = evaluate_run(out, w.data, seed)
        t2 = time.perf_counter()
    return Run(system, seed, lr, startup_s, summary["wall_s"], summary["throughput"],
               tuple(points), time_to_target(points, w.target, w.metric), t1 - t0, t2 - t1,
               int(summary.get("skipped_updates") or 0),
               time_to_target(points, w.target, w.metric, "samples"))  # fmt: skip


def choose_lr(runs: Sequence[Run], metric: str) -> float:
    """The grid's lr: among the lrs whose every run (one per grid seed) reached the target, the
    soonest on average; if none did, the best mean final value (accuracy: highest; loss:
    lowest; a NaN final makes the lr's mean NaN: never chosen while another is finite).

    >>> p = lambda v: (Point(1, 1, 1.0, v, 1 - v),)
    >>> r = lambda lr, v, t, seed=0: Run("x", seed, lr, 0, 0, 0, p(v), t)
    >>> choose_lr([r(0.1, 0.9, None), r(0.2, 0.95, 30.0), r(0.4, 0.97, 20.0)], "accuracy")
    0.4
    >>> choose_lr([r(0.1, 0.9, None)], "accuracy")
    0.1
    >>> # 0.4 is soonest on seed 0 but misses on seed 1: 0.2 reached on both
    >>> choose_lr([r(0.2, 0.97, 30.0), r(0.4, 0.97, 10.0), r(0.2, 0.97, 30.0, 1),
    ...            r(0.4, 0.9, None, 1)], "accuracy")
    0.2
    """
    by_lr: dict[float, list[Run]] = {}
    for run in runs:
        by_lr.setdefault(run.lr, []).append(run)
    reached = {
        lr: sum(r.time_to_target_s or 0.0 for r in rs) / len(rs)
        for lr, rs in by_lr.items()
        if all(r.time_to_target_s is not None for r in rs)
    }
    if reached:
        return min(reached, key=lambda lr: reached[lr])
    sign = 1.0 if metric == "accuracy" else -1.0

    def mean_final(lr: float) -> float:
        value = sum(r.final(metric) for r in by_lr[lr]) / len(by_lr[lr])
        return -math.inf if math.isnan(value) else sign * value

    return max(by_lr, key=mean_final)


def spread(values: Sequence[float | None]) -> dict[str, float | int | None]:
    """Mean, min and max of the values that exist, and how many do.

    >>> spread([1.0, None, 3.0])
    {'n': 2, 'mean': 2.0, 'min': 1.0, 'max': 3.0}
    """
    got = [v for v in values if v is not None and not math.isnan(v)]
    if not got:
        return {"n": 0, "mean": None, "min": None, "max": None}
    return {"n": len(got), "mean": sum(got) / len(got), "min": min(got), "max": max(got)}


def edge_lr(tried: Sequence[float], best: float) -> float | None:
    """The next lr to try when ``best`` is at the edge of the grid ``tried``: half the lowest,
    twice the highest; ``None`` when it is inside (or the grid has one lr).

    >>> edge_lr([0.01, 0.02, 0.04], 0.01), edge_lr([0.01, 0.02, 0.04], 0.04)
    (0.005, 0.08)
    >>> edge_lr([0.01, 0.02, 0.04], 0.02) is None, edge_lr([0.01], 0.01) is None
    (True, True)
    """
    if len(set(tried)) < 2:
        return None
    if best == min(tried):
        return min(tried) * 0.5
    if best == max(tried):
        return max(tried) * 2.0
    return None


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

    def add(self, runs: int, secs: float) -> None:
        """Count ``runs`` more runs of ``secs`` seconds in all (a grid extended at its edge)."""
        self.runs += runs
        self.expected_s += secs


def expected(budget: Budget, workloads: Sequence[Workload], systems: int = 2) -> tuple[int, float]:
    """Runs and seconds the benchmark takes: the grid (each lr, each of ``systems``) and every
    seed of every system, each run its training time plus the workload's ``overhead_s``
    (without the grid extensions, counted when they happen, up to ``MAX_EXTENSIONS`` per
    system)."""
    runs = secs = 0.0
    for w in workloads:
        grid = systems * len(w.lr_grid) * budget.grid_seeds if budget.grid_s > 0 else 0
        runs += grid + systems * budget.seeds
        secs += grid * (budget.grid_s + w.overhead_s)
        secs += systems * budget.seeds * (budget.train_s + w.overhead_s)
    return int(runs), secs


def lr_scale(plan: SystemPlan) -> int:
    """A system's lr over HetPipe's (per VW): the linear-scaling rule for an AllReduce plan
    (its world size: the same step per sample), else 1."""
    return plan.workers if plan.allreduce else 1


@dataclass(frozen=True)
class Tuning:
    """One system's lr grid, each lr run at every grid seed.

    Attributes:
        lr: the chosen lr (``choose_lr``).
        runs: every grid run, the extensions last.
        extended: the lrs added because the best was at the grid's edge, in order.
    """

    lr: float
    runs: tuple[Run, ...]
    extended: tuple[float, ...]


def tune_system(
    w: Workload, system: str, plan: SystemPlan, budget: Budget, every: int, progress: Progress
) -> Tuning:
    """``system``'s lr: the best of ``lr_grid`` x ``lr_scale`` (:func:`choose_lr` over short
    runs at each grid seed), the grid extended one step (x0.5 below, x2 above) while the best
    is at its edge, at most ``MAX_EXTENSIONS`` times."""
    runs: list[Run] = []
    lrs = [lr * lr_scale(plan) for lr in w.lr_grid]
    extended: list[float] = []
    while lrs:
        lr = lrs.pop(0)
        for seed in range(budget.grid_seeds):
            progress.step(f"{w.name} grid: {system} lr {lr:g} seed {seed}")
            runs.append(run_one(w, system, plan, seed, lr, budget.grid_s, every))
        if lrs or len(extended) == MAX_EXTENSIONS:
            continue
        more = edge_lr([r.lr for r in runs], choose_lr(runs, w.metric))
        if more is not None:
            print(f"  {system}: best lr at the grid's edge: also lr {more:g}", flush=True)
            progress.add(budget.grid_seeds, budget.grid_seeds * (budget.grid_s + w.overhead_s))
            extended.append(more)
            lrs.append(more)
    return Tuning(choose_lr(runs, w.metric), tuple(runs), tuple(extended))


def _record(r: Run) -> dict[str, Any]:
    return {**asdict(r), "points": [asdict(p) for p in r.points]}


def same_plans(plans: dict[str, SystemPlan]) -> dict[str, str]:
    """System -> the earlier system whose plan trains the same (``SystemPlan.key``): its runs
    are that system's, not trained twice (``--objective time`` may pick the AllReduce plan)."""
    out: dict[str, str] = {}
    seen: dict[str, str] = {}
    for system, plan in plans.items():
        if plan.key in seen:
            out[system] = seen[plan.key]
        else:
            seen[plan.key] = system
    return out


def tune_all(
    w: Workload, plans: dict[str, SystemPlan], budget: Budget, every: int, progress: Progress
) -> dict[str, Tuning]:
    """Each system's lr (:func:`tune_system`; in ``--quick``, ``quick_lr`` x ``lr_scale``)."""
    same = same_plans(plans)
    tunings: dict[str, Tuning] = {}
    for system, plan in plans.items():
        if system in same:
            tunings[system] = tunings[same[system]]
        elif budget.grid_s <= 0:
            tunings[system] = Tuning(w.quick_lr * lr_scale(plan), (), ())
        else:
            tunings[system] = tune_system(w, system, plan, budget, every, progress)
    chosen = ", ".join(f"{s} {t.lr:g}" for s, t in tunings.items())
    het_lr = tunings["hetpipe"].lr
    print(f"{w.name}: chosen lr {chosen} (DDP at HetPipe's linear scaling: "
          f"{het_lr * lr_scale(plans['ddp']):g})", flush=True)  # fmt: skip
    return tunings


def train_seeds(
    w: Workload,
    plans: dict[str, SystemPlan],
    tunings: dict[str, Tuning],
    budget: Budget,
    every: int,
    progress: Progress,
) -> dict[str, list[Run]]:
    """Every seed of every system at its chosen lr (a system whose plan is another's reuses
    that one's runs)."""
    same = same_plans(plans)
    runs: dict[str, list[Run]] = {s: [] for s in plans}
    for seed in range(budget.seeds):
        for system, plan in plans.items():
            if system in same:
                runs[system].append(replace(runs[same[system]][seed], system=system))
                continue
            lr = tunings[system].lr
            progress.step(f"{w.name} seed {seed}: {system} lr {lr:g}")
            r = run_one(w, system, plan, seed, lr, budget.train_s, every)
            runs[system].append(r)
            print(f"  {system}: start-up {r.startup_s:.1f} s, {r.throughput:.0f} samples/s, "
                  f"{w.metric} {r.final(w.metric):.4f} at the end, target {w.target:g} after "
                  f"{_secs(r.time_to_target_s)}", flush=True)  # fmt: skip
    return runs


def bench_workload(
    w: Workload,
    budget: Budget,
    plan_args: Sequence[str],
    systems: Sequence[str],
    progress: Progress,
    folder: Path,
) -> dict[str, Any]:
    """Plan, tune, train every seed of every system and compare their times to target."""
    common = [str(w.cluster), "--model", w.model, "--batch-size", str(w.batch)]
    common += ["--optimizer", "momentum" if w.momentum else "sgd"]
    data = w.data if w.calibrate else ""
    plans = make_plans(common, plan_args, systems, folder, w.name, data, w.momentum)
    every = max(w.batch, round(plans["hetpipe"].predicted * budget.train_s / budget.snapshots))
    tunings = tune_all(w, plans, budget, every, progress)
    runs = train_seeds(w, plans, tunings, budget, every, progress)
    out = {
        "workload": {**asdict(w), "cluster": str(w.cluster.relative_to(REPO))},
        "plan_args": list(plan_args),
        "systems": list(plans),
        "same_plan_as": same_plans(plans),
        "plans": {k: {**asdict(p), "path": p.path.name} for k, p in plans.items()},
        "workers": {k: p.workers for k, p in plans.items()},
        "predicted_throughput": {k: p.predicted for k, p in plans.items()},
        "snapshot_every_samples": every,
        "lr": {k: t.lr for k, t in tunings.items()}
        | {"ddp_linear_scaling": tunings["hetpipe"].lr * lr_scale(plans["ddp"])},
        "grid": {k: [_record(r) for r in t.runs] for k, t in tunings.items() if t.runs},
        "grid_extended": {k: list(t.extended) for k, t in tunings.items()},
        "runs": {k: [_record(r) for r in v] for k, v in runs.items()},
        "time_to_target_s": {k: spread([r.time_to_target_s for r in v]) for k, v in runs.items()},
        "samples_to_target": {k: spread([r.samples_to_target for r in v]) for k, v in runs.items()},
        "throughput": {k: spread([r.throughput for r in v]) for k, v in runs.items()},
        "startup_s": {k: spread([r.startup_s for r in v]) for k, v in runs.items()},
        "final": {k: spread([r.final(w.metric) for r in v]) for k, v in runs.items()},
    }
    for system in plans:  # ratio_ddp_over_hetpipe, ratio_ddp_over_hetpipe_time
        if system != "ddp":
            per_seed = ratios(runs[system], runs["ddp"])
            out[_ratio_key(system)] = {"per_seed": per_seed, **spread(per_seed)}
    _say(w, out)
    return out


def _ratio_key(system: str) -> str:
    return "ratio_ddp_over_" + system.replace("-", "_")


def _secs(t: float | None) -> str:
    return "never" if t is None else f"{t:.1f} s"


def _say(w: Workload, out: dict[str, Any]) -> None:
    for system in out["systems"]:
        if system == "ddp":
            continue
        r = out[_ratio_key(system)]
        shown = "n/a (a system missed the target)" if r["mean"] is None else (
            f"mean {r['mean']:.2f} (min {r['min']:.2f}, max {r['max']:.2f}, {r['n']} seeds)")  # fmt: skip
        print(f"{w.name}: time to {w.metric} {w.target:g}, DDP / {TITLES[system]}: {shown}",
              flush=True)  # fmt: skip


def main(argv: Sequence[str] | None = None) -> None:
    """Run the benchmark, print the times to target and their ratios, write JSON and plot."""
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="one seed, no grid, seconds per run")
    ap.add_argument("--workloads", nargs="+", choices=sorted(WORKLOADS), default=sorted(WORKLOADS))
    ap.add_argument(
        "--plan-args", default="", help="added to 'hetpipe plan', e.g. '--objective time'"
    )
    ap.add_argument("--time-objective", action="store_true",
                    help="also train 'hetpipe-time': the plan 'hetpipe plan --objective time' "
                         "picks (it may be the AllReduce plan: then DDP's runs)")  # fmt: skip
    ap.add_argument("--seeds", type=int, default=0, help="seeds (0 = the mode's: 3, --quick 1)")
    ap.add_argument("--train-s", type=float, default=0.0, help="training seconds per seed's run")
    ap.add_argument("--grid-seeds", type=int, default=0,
                    help="seeds each grid lr runs at, its choice judged on their mean (0 = 2)")  # fmt: skip
    ap.add_argument("--out", type=Path, default=None, help="JSON to write (and .png beside it)")
    args = ap.parse_args(argv)
    budget = QUICK if args.quick else FULL
    budget = replace(
        budget,
        seeds=args.seeds or budget.seeds,
        train_s=args.train_s or budget.train_s,
        grid_seeds=args.grid_seeds or budget.grid_seeds,
    )
    workloads = [WORKLOADS[n] for n in args.workloads]
    if args.quick:
        workloads = [replace(w, target=w.quick_target) for w in workloads]
    systems = SYSTEMS if args.time_objective else SYSTEMS[:2]
    runs, secs = expected(budget, workloads, len(systems))
    print(f"{runs} runs, expected about {secs / 60:.0f} min "
          f"({'quick' if args.quick else 'full'} mode; more on a loaded machine)", flush=True)  # fmt: skip
    progress = Progress(runs, secs)
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="tta-plans-") as tmp:
        results = {w.name: bench_workload(w, budget, args.plan_args.split(), systems, progress,
                                          Path(tmp)) for w in workloads}  # fmt: skip
    out_path = args.out or RESULTS / ("tta_quick.json" if args.quick else "tta.json")
    doc = {"mode": "quick" if args.quick else "full", "budget": asdict(budget), "results": results,
           "seconds": time.perf_counter() - t0, "loadavg": os.getloadavg()}  # fmt: skip
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text(json.dumps(doc, indent=1) + "\n")
    plot(results, out_path.with_suffix(".png"))
    print(f"wrote {out_path} and {out_path.with_suffix('.png')}")


if __name__ == "__main__":
    main()
