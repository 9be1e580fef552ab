"""Time to a target test accuracy: HetPipe (WSP, all devices) vs the DDP AllReduce baseline.

Both run end to end through ``hetpipe run`` (separate processes, emulated devices paced to their
speed, memory caps enforced) on the same cluster, model and data (scikit-learn digits, the
same held-out split). Each system trains for a ladder of budgets (minibatches per worker); every
budget is a fresh run from the same initial weights, which gives test accuracy against training
wall time (the run's own ``wall_s``, start-up excluded). The time to a target accuracy is read
off that curve (linear interpolation between budgets), and the ratio of the two times is the
figure (paper Sec. 8.4: HetPipe reaches the target 39-49 % sooner than Horovod).

The default model ``mlp(hidden=384,depth=4)`` needs 3.8 MiB as a whole (planner estimate, plain
SGD) so, as in the paper, DDP can only use the devices that hold it (V 4 MiB, R 8 MiB) while
HetPipe also uses the whimpy G and Q inside its virtual workers. Learning rates: HetPipe's VWs
each apply ``--lr`` (their updates add up on the parameter servers); DDP averages the gradients
of its ``world`` workers and applies ``--lr x world`` (the linear scaling rule), so both move the
weights by the same amount per sample.

Run: ``python benchmarks/bench_tta.py`` (about 3-5 min). Writes
``benchmarks/results/tta.json`` and ``tta.png``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results" / "tta.json"


def run(
    system: str, cluster: Path, args: argparse.Namespace, steps: int, lr: float
) -> dict[str, Any]:
    """One ``hetpipe run`` of ``system`` (``wsp`` or ``allreduce``) for ``steps`` minibatches."""
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [
            sys.executable, "-m", "hetpipe", "run", str(cluster), "--model", args.model,
            "--batch-size", str(args.batch), "--steps", str(steps), "--lr", str(lr),
            "--sync", system, "--seed", str(args.seed), "--out", tmp,
        ]  # fmt: skip
        if system == "wsp":
            cmd += ["--D", str(args.D), "--checkpoint-every", "0"]
            if args.nm:
                cmd += ["--nm", str(args.nm)]
            if args.policy:
                cmd += ["--policy", args.policy]
            if args.vws:
                cmd += ["--vws", str(args.vws)]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=900, check=False)
        if done.returncode != 0:
            raise SystemExit(
                f"{' '.join(cmd)} failed:\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}"
            )
        out = json.loads((Path(tmp) / "summary.json").read_text())  # every rule writes it
    workers = len(out["vws"])
    samples = steps * args.batch * workers
    return {
        "steps": steps,
        "samples": samples,
        "workers": workers,
        "wall_s": out["wall_s"],
        "throughput": out["throughput"],
        "test_accuracy": out["test_accuracy"],
    }


def time_to(points: list[dict[str, Any]], target: float) -> float | None:
    """Training time at which the accuracy curve first reaches ``target`` (interpolated)."""
    prev = {"wall_s": 0.0, "test_accuracy": 0.0}
    for p in sorted(points, key=lambda q: q["wall_s"]):
        if p["test_accuracy"] >= target:
            a0, a1 = prev["test_accuracy"], p["test_accuracy"]
            t0, t1 = prev["wall_s"], p["wall_s"]
            return t1 if a1 == a0 else t0 + (t1 - t0) * (target - a0) / (a1 - a0)
        prev = p
    return None


def plot(curves: dict[str, list[dict[str, Any]]], targets: list[float], path: Path) -> None:
    """Test accuracy against training time for both systems."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, pts in curves.items():
        pts = sorted(pts, key=lambda q: q["wall_s"])
        ax.plot(
            [0] + [p["wall_s"] for p in pts],
            [0] + [100 * p["test_accuracy"] for p in pts],
            marker="o",
            label=name,
        )
    for t in targets:
        ax.axhline(100 * t, color="grey", lw=0.8, ls="--")
    ax.set_xlabel("training wall time (s)")
    ax.set_ylabel("test accuracy (%)")
    ax.set_title("digits: HetPipe (WSP) vs DDP AllReduce, emulated V R G Q")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    """Run the ladders, print the times to target and their ratio, record them."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    ap.add_argument("--cluster", type=Path, default=REPO / "examples" / "emulated_cluster.yaml")
    ap.add_argument("--model", default="mlp(hidden=384,depth=4)")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--lr", type=float, default=0.05, help="per-update lr of one worker")
    ap.add_argument(
        "--lr-grid",
        type=float,
        nargs="+",
        default=[],
        help="tune each system's lr first: the one with the best test accuracy at the largest "
        "budget (HetPipe's local staleness Nm - 1 wants a smaller lr than synchronous DDP)",
    )
    ap.add_argument(
        "--policy", default="", help="HetPipe allocation policy (default: hetpipe run's)"
    )
    ap.add_argument("--vws", type=int, default=0, help="HetPipe VWs (0 = hetpipe run's default)")
    ap.add_argument("--results", type=Path, default=RESULTS, help="JSON to write (and .png)")
    ap.add_argument("--D", type=int, default=0)
    ap.add_argument("--nm", type=int, default=0, help="0 = the plan's")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--budgets", type=int, nargs="+", default=[60, 120, 240, 360, 480])
    ap.add_argument("--targets", type=float, nargs="+", default=[0.85, 0.90, 0.93])
    args = ap.parse_args()
    t0 = time.perf_counter()
    curves: dict[str, list[dict[str, Any]]] = {"HetPipe (WSP)": [], "DDP AllReduce": []}
    ddp_world = run("allreduce", args.cluster, args, 1, args.lr)["workers"]  # learn the world
    het_lr, ddp_lr = args.lr, args.lr * ddp_world
    tuning: dict[str, list[dict[str, Any]]] = {"wsp": [], "allreduce": []}
    if args.lr_grid:  # per system, the lr with the best accuracy at the largest budget
        top = max(args.budgets)
        for lr in args.lr_grid:
            for system, scale in (("wsp", 1), ("allreduce", ddp_world)):
                r = run(system, args.cluster, args, top, lr * scale)
                tuning[system].append({"lr": lr * scale, **r})
                print(f"tuning {system} lr {lr * scale:g}: {100 * r['test_accuracy']:.1f} %")
        het_lr = max(tuning["wsp"], key=lambda r: r["test_accuracy"])["lr"]
        ddp_lr = max(tuning["allreduce"], key=lambda r: r["test_accuracy"])["lr"]
        print(f"chosen lr: HetPipe {het_lr:g}, DDP {ddp_lr:g}")
    for steps in args.budgets:
        het = run("wsp", args.cluster, args, steps, het_lr)
        curves["HetPipe (WSP)"].append(het)
        ddp = run("allreduce", args.cluster, args, steps, ddp_lr)
        curves["DDP AllReduce"].append(ddp)
        print(
            f"budget {steps:4d}: HetPipe {het['samples']:6d} samples {het['wall_s']:6.1f} s "
            f"{100 * het['test_accuracy']:5.1f} %  |  DDP ({ddp['workers']} devices) "
            f"{ddp['samples']:6d} samples {ddp['wall_s']:6.1f} s {100 * ddp['test_accuracy']:5.1f} %",
            flush=True,
        )
    summary = []
    for t in args.targets:
        th = time_to(curves["HetPipe (WSP)"], t)
        td = time_to(curves["DDP AllReduce"], t)
        faster = None if th is None or td is None else 1.0 - th / td
        summary.append({"target": t, "hetpipe_s": th, "ddp_s": td, "hetpipe_faster_by": faster})
        show = "n/a (not reached)" if faster is None else f"HetPipe {100 * faster:+.0f} % faster"
        print(f"target {100 * t:.0f} %: HetPipe {th} s, DDP {td} s -> {show}")
    het_tp = [p["throughput"] for p in curves["HetPipe (WSP)"]]
    ddp_tp = [p["throughput"] for p in curves["DDP AllReduce"]]
    out = {
        "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "ddp_world": ddp_world,
        "hetpipe_lr": het_lr,
        "ddp_lr": ddp_lr,
        "lr_tuning": tuning,
        "curves": curves,
        "time_to_target": summary,
        "throughput_ratio_median": sorted(h / d for h, d in zip(het_tp, ddp_tp, strict=True))[
            len(het_tp) // 2
        ],
        "seconds": time.perf_counter() - t0,
        "loadavg": os.getloadavg(),
    }
    print(f"throughput HetPipe / DDP (median over budgets): {out['throughput_ratio_median']:.2f}")
    args.results.parent.mkdir(parents=True, exist_ok=True)
    args.results.write_text(json.dumps(out, indent=1) + "\n")
    plot(curves, args.targets, args.results.with_suffix(".png"))
    print(f"wrote {args.results} and {args.results.with_suffix('.png')}")


if __name__ == "__main__":
    main()
