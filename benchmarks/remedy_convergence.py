"""Staleness remedies (``planner.staleness``) vs no remedy vs sequential SGD: digits, mlp.

An *algorithmic* single-process reference of one VW with ``Nm`` minibatches in flight: minibatch
``p`` computes its gradient on the weights holding ``p - Nm`` updates (exact local staleness,
``planner.wsp.local_version``), under each remedy:

- ``none``: as it is;
- ``predict``: on those weights predicted ``s`` updates ahead, ``w - s * lr * v``
  (``planner.staleness.predict_scale``; ``v`` the momentum buffer, or the last gradient);
- ``pipemare``: the step size ``planner.staleness.pipemare_lr`` (``lr / (Nm - 1)`` warming up
  to ``lr`` over ``--warmup-updates``).

Updates are SGD (``--momentum``, torch's rule ``v = mu v + g``, ``w -= lr v``), the rules the
stages apply (``tests/runtime/test_remedy.py`` checks the runtime against the same loop).
Sequential SGD is ``Nm = 1`` (every remedy is a no-op there). Figures: the mean final test
accuracy over ``--seeds`` seeds and the mean number of samples until the test accuracy first
reaches ``--target`` (a run that never does counts as the run's length; their number is given).

Usage: ``python benchmarks/remedy_convergence.py [--steps 720] [--seeds 5] [--lr 0.1]
[--momentum 0.9] [--target 0.9]``; writes ``benchmarks/results/remedy_convergence*.json``.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks.convergence import RESULTS, Trainer
from planner.staleness import REMEDIES, pipemare_lr, predict_scale, stage_delay
from planner.wsp import local_version
from runtime.data import DigitsDataset, MinibatchSource
from runtime.results.evaluation import split_dataset


def train(
    tr: Trainer, src: MinibatchSource, nm: int, remedy: str, args: argparse.Namespace
) -> list[tuple[int, float]]:
    """One VW's run; its curve (samples, test accuracy)."""
    w, vel = tr.w0.clone(), tr.w0.new_zeros(tr.w0.shape)
    history = {0: (w.clone(), vel.clone())}  # (weights, velocity) after each update
    curve = [(0, tr.accuracy(w))]
    for p in range(1, args.steps + 1):
        v = local_version(p, nm)
        w_v, vel_v = history[v]
        if remedy == "predict":
            w_v = w_v - predict_scale(p, nm, args.lr) * vel_v
        g = tr.grad(w_v, *src.batch(p))
        lr = args.lr
        if remedy == "pipemare":
            lr = pipemare_lr(lr, p - 1, stage_delay(nm), args.warmup_updates)
        vel = args.momentum * vel + g if args.momentum and p > 1 else g
        w = w - lr * vel
        history[p] = (w.clone(), vel.clone())
        history.pop(p - nm, None)  # minibatch p + 1 reads version p + 1 - nm at the oldest
        if p % args.eval_every == 0:
            curve.append((p * tr.batch, tr.accuracy(w)))
    return curve


def to_target(curve: list[tuple[int, float]], target: float) -> int | None:
    """Samples until the accuracy first reaches ``target`` (``None``: never)."""
    return next((n for n, acc in curve if acc >= target), None)


def main() -> None:
    """Run every (Nm, remedy) for every seed; print and write the summary."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    ap.add_argument("--steps", type=int, default=720)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--lr", type=float, default=0.1)
    ap.add_argument("--momentum", type=float, default=0.9)
    ap.add_argument("--seeds", type=int, default=5)
    ap.add_argument("--nms", type=int, nargs="+", default=[2, 3, 4])
    ap.add_argument("--warmup-updates", type=int, default=100, help="PipeMare's K")
    ap.add_argument("--target", type=float, default=0.9, help="test accuracy to reach")
    ap.add_argument("--eval-every", type=int, default=12, help="minibatches between points")
    ap.add_argument("--out", type=Path, default=RESULTS / "remedy_convergence.json")
    args = ap.parse_args()
    torch.set_num_threads(1)
    train_set, test = split_dataset(DigitsDataset(), 0.2, seed=0)
    t0 = time.perf_counter()
    rows: list[dict[str, Any]] = []
    for nm, remedy in [(1, "none")] + [(n, r) for n in args.nms for r in REMEDIES]:
        finals, reach = [], []
        for seed in range(args.seeds):
            tr = Trainer(args.batch, seed, test)
            curve = train(tr, MinibatchSource(train_set, args.batch, seed), nm, remedy, args)
            finals.append(curve[-1][1])
            reach.append(to_target(curve, args.target))
        never = sum(1 for r in reach if r is None)
        samples = [args.steps * args.batch if r is None else r for r in reach]
        rows.append({
            "nm": nm, "remedy": "sequential" if nm == 1 else remedy, "accuracy": finals,
            "mean_accuracy": sum(finals) / len(finals), "samples_to_target": reach,
            "mean_samples_to_target": sum(samples) / len(samples), "never_reached": never,
        })  # fmt: skip
        r = rows[-1]
        print(
            f"Nm={nm} {r['remedy']:>10}: final acc {100 * r['mean_accuracy']:6.2f} %  "
            f"samples to {100 * args.target:.0f} %: {r['mean_samples_to_target']:7.0f}"
            f"  (never: {never}/{args.seeds})",
            flush=True,
        )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    config = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    summary = {"seconds": time.perf_counter() - t0}
    args.out.write_text(json.dumps({"config": config, "summary": summary, "rows": rows}) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
