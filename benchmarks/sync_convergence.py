"""Convergence of backup workers and elastic averaging vs sequential SGD (issue 16), digits + mlp.

Single-process *algorithmic* references of the two rules, in the style of
``benchmarks/convergence.py``'s WSP reference (its ``Trainer``, data shards and sequential SGD
are reused): ``n`` virtual workers (VWs), each on its own disjoint shard of the training split,
``Nm`` minibatches per wave, every minibatch computed on exactly the weights the rule gives it:

- :func:`backup` (``D = 0``, :mod:`planner.backup`): minibatch ``p`` of VW ``v`` runs on
  ``w0 + sum_{c < G} sum_{u in counted(c)} U_u(c) + v's own updates of waves >= G up to p - Nm``
  with ``G = required_global_clock(p, Nm, 0)``; ``counted(c)``, the first ``N = n - b`` VWs to
  push wave ``c``, comes from the wave-level simulator (:func:`planner.sim.waves.play_waves`)
  under the straggler model, so who is dropped is what the emulated cluster would drop;
- :func:`easgd` (:mod:`planner.easgd`): every VW keeps its own weights (local staleness ``Nm``);
  after every ``tau``-th wave each VW and the centre take the elastic update; the model
  evaluated is the centre. The centre *averages* the VWs where WSP and backup *sum* their
  updates, so each VW's learning rate is ``VWs x lr`` by default (``--easgd-lr``).

All settings see the same number of *computed* samples (``n x steps_per_vw`` minibatches):
backup workers' dropped pushes are computed and thrown away, which is their price.
Target (issue 16): accuracy within 1 point of sequential SGD for b = 1, 2 and for EASGD at its
best ``tau``/``alpha``. Backup rows come twice: at equal computed samples and at equal
*applied* samples (``n / N`` times the steps: the samples that reach the weights equal
sequential SGD's); WSP at ``D = 0`` is there for reference. A self-check asserts that backup with ``b = 0`` equals the WSP reference
at ``D = 0`` bit for bit.

    python benchmarks/sync_convergence.py [--steps 2880 --lr 0.02 --vws 4 --nm 2 --seeds 2]

Writes ``benchmarks/results/sync_convergence.json`` and ``.png`` (test accuracy vs samples).
"""

from __future__ import annotations

import argparse
import json
import time
from collections import deque
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from convergence import Trainer, sequential, shards_of, warm, wsp  # type: ignore[import-not-found]
from torch import Tensor
from torch.utils.data import Dataset

from planner.easgd import check_elastic, elastic_difference, exchanges_after
from planner.sim.waves import play_waves
from planner.straggle import Straggle
from planner.wsp import required_global_clock, wave_of
from runtime.data import DigitsDataset, MinibatchSource
from runtime.sync.allreduce import split_dataset

RESULTS = Path(__file__).resolve().parent / "results"
Curve = list[tuple[int, float]]


def backup(
    tr: Trainer,
    shards: list[Dataset[Any]],
    steps: int,
    nm: int,
    lr: float,
    seed: int,
    every: int,
    counted: Callable[[int], Sequence[int]],
) -> tuple[Tensor, Curve, int]:
    """Synchronous SGD with backup workers over VWs (D = 0); ``counted(c)``: wave ``c``'s VWs.

    Returns:
        Final global weights, the curve (computed samples, accuracy of the global weights),
        and the number of dropped VW-waves.
    """
    n = len(shards)
    srcs = [MinibatchSource(s, tr.batch, seed + 101 * v) for v, s in enumerate(shards)]
    zero = tr.w0.new_zeros(tr.w0.shape)
    own = [zero.clone() for _ in range(n)]  # v's cumulative own updates
    recent: list[deque[Tensor]] = [deque([zero.clone()], maxlen=nm + 1) for _ in range(n)]
    at_wave: list[dict[int, Tensor]] = [{0: zero.clone()} for _ in range(n)]
    glob = {0: zero.clone()}  # global part at clock G: the counted waves' updates
    curve, dropped = [(0, tr.accuracy(tr.w0))], 0
    for p in range(1, steps + 1):
        g = required_global_clock(p, nm, 0)
        for v in range(n):
            local = recent[v][-nm] if p > nm else recent[v][0]
            w = tr.w0 + glob[g] + (local - at_wave[v][g])
            u = -lr * tr.grad(w, *srcs[v].batch(p))
            own[v] += u
            recent[v].append(own[v].clone())
        if p % nm == 0:
            c = wave_of(p, nm)
            for v in range(n):
                at_wave[v][c + 1] = own[v].clone()
            keep = sorted(counted(c))
            dropped += n - len(keep)
            glob[c + 1] = glob[c].clone()
            for v in keep:  # VW id order, like the shard
                glob[c + 1] += at_wave[v][c + 1] - at_wave[v][c]
            # the local copy: a VW's own updates below the clock are in glob or dropped
            for v in range(n):
                at_wave[v].pop(c - 1, None)
            glob.pop(c - 1, None)
        if (p * n) % every == 0:
            curve.append((p * n * tr.batch, tr.accuracy(tr.w0 + glob[max(glob)])))
    last = max(glob)
    return tr.w0 + glob[last], curve, dropped


def easgd(
    tr: Trainer,
    shards: list[Dataset[Any]],
    steps: int,
    nm: int,
    tau: int,
    alpha: float,
    lr: float,
    seed: int,
    every: int,
    warmup: float = 0.0,
) -> tuple[Tensor, Curve]:
    """Elastic averaging over VWs: own weights, exchange after every ``tau``-th wave.

    Returns:
        The final centre and the curve (computed samples, accuracy of the centre).
    """
    n = len(shards)
    check_elastic(n, tau, alpha)
    srcs = [MinibatchSource(s, tr.batch, seed + 101 * v) for v, s in enumerate(shards)]
    master = [tr.w0.clone() for _ in range(n)]
    recent: list[deque[Tensor]] = [deque([tr.w0.clone()], maxlen=nm + 1) for _ in range(n)]
    centre = tr.w0.clone()
    curve = [(0, tr.accuracy(centre))]
    for p in range(1, steps + 1):
        for v in range(n):
            w = recent[v][-nm] if p > nm else recent[v][0]  # version p - Nm
            master[v] = master[v] - warm(lr, p / steps, warmup) * tr.grad(w, *srcs[v].batch(p))
            recent[v].append(master[v])
        if p % nm == 0 and exchanges_after(wave_of(p, nm), tau):
            ds = [elastic_difference(master[v], centre, alpha) for v in range(n)]
            for v in range(n):
                master[v] = master[v] - ds[v]
                recent[v][-1] = master[v]  # version p is the exchanged one
            total = ds[0].clone()
            for d in ds[1:]:
                total += d
            centre = centre + total
        if (p * n) % every == 0:
            curve.append((p * n * tr.batch, tr.accuracy(centre)))
    return centre, curve


def who_first(
    n: int, waves: int, nm: int, backups: int, straggle: Straggle
) -> list[tuple[int, ...]]:
    """The counted VWs of each wave under the straggler model (equal VWs, wave-level play)."""
    play = play_waves("backup", [1.0] * n, waves, nm, straggle, backups=backups)
    return list(play.counted)


def self_check(train: Any, test: Any, batch: int, lr: float) -> None:
    """Backup with b = 0 is WSP at D = 0: the two references agree to float precision."""
    tr = Trainer(batch, 0, test)
    shards = shards_of(train, 3)
    w_b, _, dropped = backup(tr, shards, 8, 2, lr, 0, 10**9, lambda c: (0, 1, 2))
    w_w, _, _ = wsp(tr, shards, 8, 2, 0, lr, 0, 10**9)
    assert dropped == 0
    torch.testing.assert_close(w_b, w_w, rtol=1e-5, atol=1e-6)


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    """Test accuracy vs computed samples, seed 0 of every setting."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for r in rows:
        xs, ys = zip(*r["curve"], strict=True)
        ax.plot(xs, [100 * y for y in ys], label=r["label"], lw=2 if r["label"] == "seq" else 1)
    ax.set_xlabel("computed training samples (all VWs)")
    ax.set_ylabel("test accuracy (%)")
    ax.set_ylim(0, 100)
    ax.set_title("digits, mlp: backup workers and EASGD vs sequential SGD")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def run_all(args: argparse.Namespace, train: Any, test: Any) -> list[dict[str, Any]]:
    """Every setting over ``args.seeds`` seeds; one row each."""
    n, nm, per_vw = args.vws, args.nm, args.steps // args.vws
    straggle = Straggle(args.p, args.factor, 0)
    settings: list[tuple[str, Callable[[Trainer, int], tuple[Tensor, Curve, int]]]] = [
        ("seq", lambda tr, s: (*sequential(tr, train, args.steps, args.lr, s, args.eval_every), 0))
    ]
    settings.append(("wsp D=0", lambda tr, s: (*wsp(
        tr, shards_of(train, n), per_vw, nm, 0, args.lr, s, args.eval_every)[:2], 0)))  # fmt: skip
    for b in args.backups:
        # equal computed samples, then equal *applied* samples (n / N times the steps)
        for label, steps in (
            (f"backup b={b}", per_vw),
            (f"backup b={b} equal applied", per_vw * n // (n - b)),
        ):
            firsts = who_first(n, steps // nm + 1, nm, b, straggle)
            settings.append((label, lambda tr, s, f=firsts, k=steps: backup(
                tr, shards_of(train, n), k, nm, args.lr, s, args.eval_every, f.__getitem__)))  # fmt: skip
    easgd_lr = args.easgd_lr if args.easgd_lr is not None else args.lr * n
    for tau in args.taus:
        for alpha in args.alphas:
            settings.append((f"easgd tau={tau} alpha={alpha}", lambda tr, s, t=tau, a=alpha: (*easgd(
                tr, shards_of(train, n), per_vw, nm, t, a, easgd_lr, s, args.eval_every), 0)))  # fmt: skip
    rows = []
    for label, fn in settings:
        accs, curve, dropped = [], [], 0
        for seed in range(args.seeds):
            tr = Trainer(args.batch, seed, test)
            w, c, dropped = fn(tr, seed)
            accs.append(tr.accuracy(w) if bool(torch.isfinite(w).all()) else 0.0)
            curve = curve or c
        rows.append({"label": label, "accuracy": accs, "mean_accuracy": sum(accs) / len(accs),
                     "dropped_vw_waves": dropped, "curve": curve})  # fmt: skip
        gap = 100 * (rows[-1]["mean_accuracy"] - rows[0]["mean_accuracy"])
        print(f"{label:>24}: acc {100 * rows[-1]['mean_accuracy']:6.2f} %  (vs seq {gap:+5.2f} pp)"
              f"  dropped VW-waves {dropped}", flush=True)  # fmt: skip
    return rows


def main() -> None:
    """Run every setting, write the JSON and the PNG."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    ap.add_argument(
        "--steps", type=int, default=2880, help="sequential minibatches (= VWs x per-VW)"
    )
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--lr", type=float, default=0.02)
    ap.add_argument("--seeds", type=int, default=2)
    ap.add_argument("--vws", type=int, default=4)
    ap.add_argument("--nm", type=int, default=2)
    ap.add_argument("--backups", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--taus", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--alphas", type=float, nargs="+", default=[0.1, 0.225])
    ap.add_argument(
        "--easgd-lr",
        type=float,
        default=None,
        help="each VW's lr under EASGD (default lr x VWs: the centre averages the VWs, where "
        "WSP and backup sum their updates, so the same per-sample step needs VWs x lr)",
    )
    ap.add_argument("--p", type=float, default=0.1, help="straggler probability per VW-wave")
    ap.add_argument("--factor", type=float, default=3.0, help="straggler slowdown")
    ap.add_argument("--eval-every", type=int, default=96, help="minibatches between curve points")
    ap.add_argument("--out", type=Path, default=RESULTS / "sync_convergence.json")
    args = ap.parse_args()
    torch.set_num_threads(1)
    train, test = split_dataset(DigitsDataset(), 0.2, seed=0)
    self_check(train, test, args.batch, args.lr)
    print("self-check: backup b=0 equals the WSP reference at D=0 (assert_close) ok")
    t0 = time.perf_counter()
    rows = run_all(args, train, test)
    base = rows[0]["mean_accuracy"]
    easgd_rows = [r for r in rows if r["label"].startswith("easgd")]
    summary = {
        "sequential_accuracy": base,
        "gaps_pp": {r["label"]: 100 * (r["mean_accuracy"] - base) for r in rows[1:]},
        "best_easgd": max(easgd_rows, key=lambda r: r["mean_accuracy"])["label"]
        if easgd_rows
        else None,
        "seconds": time.perf_counter() - t0,
    }
    print(json.dumps(summary, indent=2))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    config = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    args.out.write_text(json.dumps({"config": config, "summary": summary, "rows": rows}) + "\n")
    plot(rows, args.out.with_suffix(".png"))
    print(f"wrote {args.out} and {args.out.with_suffix('.png')}")


if __name__ == "__main__":
    main()
