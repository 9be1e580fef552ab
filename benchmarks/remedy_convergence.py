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
Sequential SGD is ``Nm = 1`` (every remedy is a no-op there).

With ``--vws 2 4`` the same remedies run on ``n`` VWs under WSP with deterministic pulls
(``benchmarks/convergence.py``'s reference: VW ``v``'s minibatch ``p`` runs on
``w0 + every VW's waves < G + v's own updates 1..p-Nm``, ``G = required_global_clock(p, Nm,
D)``), each VW on its own shard with its own momentum buffer, ``steps / n`` minibatches each
(the same samples as sequential SGD, at the same step per minibatch). There ``predict``
counts every update the gradient misses, the other VWs' too, as the stages do
(``predict_scale(p, Nm, lr, vws, D)``, ``planner.staleness.predict_steps``), and two more
variants run:

- ``predict-local``: the prediction over the VW's own local staleness only (``predict``
  before it counted the other VWs);
- ``none@M``: no remedy, the explicit momentum lowered to ``M`` (Mitliagkas et al. 2016:
  asynchrony adds implicit momentum). Figures: the mean final test
accuracy over ``--seeds`` seeds and the mean number of samples until the test accuracy first
reaches ``--target`` (a run that never does counts as the run's length; their number is given).

Usage: ``python benchmarks/remedy_convergence.py [--steps 720] [--seeds 5] [--lr 0.1]
[--momentum 0.9] [--target 0.9] [--vws 2 4 --d 0 --remedies none predict predict-local]``; writes ``benchmarks/results/remedy_convergence*.json``.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from benchmarks.convergence import RESULTS, Trainer, shards_of, vw_sources
from planner.staleness import REMEDIES, pipemare_lr, predict_scale, stage_delay
from planner.wsp import local_version, required_global_clock
from runtime.data import DigitsDataset, MinibatchSource
from runtime.results.evaluation import split_dataset


def train(
    tr: Trainer, src: MinibatchSource, nm: int, remedy: str, args: argparse.Namespace
) -> tuple[Tensor, list[tuple[int, float]]]:
    """One VW's run; its final weights and curve (samples, test accuracy)."""
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
        mu = _momentum(remedy, args)
        vel = mu * vel + g if mu and p > 1 else g
        w = w - lr * vel
        history[p] = (w.clone(), vel.clone())
        history.pop(p - nm, None)  # minibatch p + 1 reads version p + 1 - nm at the oldest
        if p % args.eval_every == 0:
            curve.append((p * tr.batch, tr.accuracy(w)))
    return w, curve


def _momentum(remedy: str, args: argparse.Namespace) -> float:
    """The explicit momentum of ``remedy``: ``none@M`` runs with ``M``."""
    return float(remedy.split("@")[1]) if "@" in remedy else args.momentum


def train_wsp(
    tr: Trainer, srcs: list[MinibatchSource], nm: int, remedy: str, args: argparse.Namespace
) -> tuple[Tensor, list[tuple[int, float]]]:
    """``len(srcs)`` VWs under WSP (deterministic pulls, ``args.d``); the final global weights
    ``w0 + every update`` and their curve (samples of all VWs, test accuracy)."""
    n, mu = len(srcs), _momentum(remedy, args)
    zero = tr.w0.new_zeros(tr.w0.shape)
    own = [[(zero, zero)] for _ in range(n)]  # own[v][k]: (v's own updates 1..k, velocity)
    total = zero.clone()
    curve = [(0, tr.accuracy(tr.w0))]
    for p in range(1, args.steps // n + 1):
        g_clock = required_global_clock(p, nm, args.d)
        lr = args.lr
        if remedy == "pipemare":
            lr = pipemare_lr(lr, p - 1, stage_delay(nm), args.warmup_updates)
        pulled = tr.w0 + sum((own[u][g_clock * nm][0] for u in range(n)), zero)
        for v in range(n):
            k = local_version(p, nm)
            mine, vel_k = own[v][k]
            w = pulled - own[v][g_clock * nm][0] + mine
            if remedy == "predict":
                w = w - predict_scale(p, nm, args.lr, n, args.d) * vel_k
            elif remedy == "predict-local":
                w = w - predict_scale(p, nm, args.lr) * vel_k
            grad = tr.grad(w, *srcs[v].batch(p))
            last, vel = own[v][-1]
            vel = mu * vel + grad if mu and p > 1 else grad
            own[v].append((last - lr * vel, vel))
            total -= lr * vel
        if (p * n) % args.eval_every < n:
            curve.append((p * n * tr.batch, tr.accuracy(total + tr.w0)))
    return total + tr.w0, curve


def self_check(train_set: Any, test: Any, batch: int) -> None:
    """The several-VW loop with one VW is the one-VW loop, every remedy: assert it."""
    args = argparse.Namespace(steps=12, lr=0.02, momentum=0.9, d=0, eval_every=12, warmup_updates=4)
    for remedy in REMEDIES:
        (w1, _), (w2, _) = (
            loop(Trainer(batch, 0, test), MinibatchSource(train_set, batch, 0), 3, remedy, args)
            for loop in (train, lambda tr, src, *rest: train_wsp(tr, [src], *rest))
        )
        if not torch.allclose(w1, w2, rtol=1e-6, atol=1e-7):
            raise RuntimeError(f"1 VW under WSP differs from one VW with remedy {remedy}")


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
    ap.add_argument("--vws", type=int, nargs="+", default=[1], help="VW counts (1: one VW)")
    ap.add_argument("--d", type=int, default=0, help="WSP threshold D (several VWs)")
    ap.add_argument(
        "--remedies",
        nargs="+",
        default=list(REMEDIES),
        help="remedies to compare (several VWs also: predict-local, none@M)",
    )
    ap.add_argument("--warmup-updates", type=int, default=100, help="PipeMare's K")
    ap.add_argument("--target", type=float, default=0.9, help="test accuracy to reach")
    ap.add_argument("--eval-every", type=int, default=12, help="minibatches between points")
    ap.add_argument("--out", type=Path, default=RESULTS / "remedy_convergence.json")
    args = ap.parse_args()
    torch.set_num_threads(1)
    train_set, test = split_dataset(DigitsDataset(), 0.2, seed=0)
    self_check(train_set, test, args.batch)
    t0 = time.perf_counter()
    rows: list[dict[str, Any]] = []
    cases = [(1, 1, "none")] + [
        (n, nm, r) for n in args.vws for nm in args.nms for r in args.remedies
    ]
    for vws, nm, remedy in cases:
        finals, reach = [], []
        for seed in range(args.seeds):
            tr = Trainer(args.batch, seed, test)
            if vws == 1:
                _, curve = train(tr, MinibatchSource(train_set, args.batch, seed), nm, remedy, args)
            else:
                srcs = vw_sources(shards_of(train_set, vws), args.batch, seed)
                _, curve = train_wsp(tr, srcs, nm, remedy, args)
            finals.append(curve[-1][1])
            reach.append(to_target(curve, args.target))
        never = sum(1 for r in reach if r is None)
        samples = [args.steps * args.batch if r is None else r for r in reach]
        rows.append({
            "vws": vws, "nm": nm, "remedy": "sequential" if (vws, nm) == (1, 1) else remedy,
            "accuracy": finals,
            "mean_accuracy": sum(finals) / len(finals), "samples_to_target": reach,
            "mean_samples_to_target": sum(samples) / len(samples), "never_reached": never,
        })  # fmt: skip
        r = rows[-1]
        print(
            f"{vws}vw Nm={nm} {r['remedy']:>14}: final acc {100 * r['mean_accuracy']:6.2f} %  "
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
