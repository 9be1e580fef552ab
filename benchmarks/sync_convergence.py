"""Convergence of backup workers and elastic averaging vs sequential SGD (issue 16).

Single-process *algorithmic* references of the two rules, in the style of
``benchmarks/convergence.py``'s WSP reference (its ``Trainer``, data shards, sequential SGD and
helpers are reused): ``n`` virtual workers (VWs), ``Nm`` minibatches per wave, every
minibatch computed on exactly the weights the rule gives it. Each VW's data follows the
rule's data rule as in the runtime (:func:`planner.sync.data_slice`): under WSP and EASGD its
own disjoint shard of the training split; under backup its slice of every global minibatch
of the whole split (so a late VW's dropped pushes are different samples every epoch). Two tasks (``--task``): ``digits`` (scikit-learn's digits, the mlp; test
accuracy) and ``lm`` (the tiny GPT-2 of ``examples/gpt2_lm.py`` on structured synthetic
tokens, ``benchmarks/lm_task.py``; test loss).

- :func:`backup` (``D = 0``, :mod:`planner.backup`): driven by the wave-level simulator
  (:func:`planner.sim.waves.play_waves`) under the straggler model (``--p``, ``--factor``, plus
  up to ``--jitter`` of noise per VW-wave: with exactly equal VWs a VW that rejoins mid-wave
  would stay last for ever, ties going to the lowest id): which VWs each wave counts
  and, for a VW left behind, the wave it continues at (its data goes on, its numbers skip).
  Each data wave starts from the global weights of the clock it was numbered by; minibatch
  ``p`` runs on local version ``p - Nm``: the runtime's arithmetic, tested equal to the
  multi-process run in ``tests/runtime/test_sync_run.py``;
- :func:`easgd` (:mod:`planner.easgd`): every VW keeps its own weights (local staleness ``Nm``);
  after every ``tau``-th wave each VW and the centre take the elastic update; the model
  evaluated is the centre. The centre *averages* the VWs where WSP and backup *sum* their
  updates, so each VW's learning rate is ``VWs x lr`` by default (``--easgd-lr``).

Settings see the same number of *computed* samples (``--steps`` minibatches over all VWs):
backup workers' dropped pushes are computed and thrown away, which is their price (a VW left
behind computes fewer waves, so the run closes more waves for the same computed samples).
Backup rows come twice: at equal computed samples and at equal *applied* samples (the waves'
counted samples equal sequential SGD's); WSP at ``D = 0`` is there for reference. Target
(issue 16): within 1 point of sequential SGD's accuracy for b = 1, 2 and for EASGD at its best
``tau``/``alpha``. A self-check asserts that backup with ``b = 0`` equals the WSP reference at
``D = 0``.

    python benchmarks/sync_convergence.py [--steps 2880 --lr 0.02 --vws 4 --nm 2 --seeds 2]
    python benchmarks/sync_convergence.py --task lm --steps 1600 --lr 0.05 --seeds 1

Writes ``benchmarks/results/sync_convergence[_lm].json`` and ``.png`` (metric vs samples).
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from convergence import (  # type: ignore[import-not-found]
    Trainer,
    Versions,
    sequential,
    shards_of,
    vw_sources,
    warm,
    write_results,
    wsp,
)
from torch import Tensor
from torch.utils.data import Dataset

from planner.easgd import check_elastic, elastic_difference, exchanges_after
from planner.sim.waves import WavePlay, play_waves
from planner.straggle import Straggle, uniform
from planner.sync import data_slice
from planner.wsp import wave_of
from runtime.data import DigitsDataset, MinibatchSource
from runtime.results.evaluation import split_dataset

RESULTS = Path(__file__).resolve().parent / "results"
Curve = list[tuple[int, float]]


def backup_sources(train: Dataset[Any], n: int, batch: int, seed: int) -> list[MinibatchSource]:
    """The backup rule's data, as the runtime's (:func:`planner.sync.data_slice`): VW ``v``
    takes slice ``v`` of every global minibatch of the whole split, so a late VW's dropped
    push is a different sample every epoch (with a shard each, the same shard every time)."""
    return [
        MinibatchSource(train, batch, seed, slice_of=data_slice("backup", v, n)) for v in range(n)
    ]


def backup(
    tr: Any, srcs: list[MinibatchSource], nm: int, lr: float, seed: int, every: int, play: WavePlay
) -> tuple[Tensor, Curve, int]:
    """Synchronous SGD with backup workers over VWs (D = 0), driven by a wave play: VW ``v``
    pushes its data wave ``d`` as wave ``play.numbers[v][d]`` (a late VW skips numbers: it
    continues at the clock, :func:`planner.backup.continue_at`), starting from the global
    weights of that clock; wave ``c`` sums ``play.counted[c]`` in VW id order. Exactly the
    runtime's arithmetic (``tests/runtime/test_sync_run.py``): minibatch ``p`` runs on local
    version ``p - Nm``, and the pull replaces the wave-end version.

    Returns:
        Final global weights, the curve (computed samples, metric of the global weights),
        and the number of dropped VW-waves.
    """
    n, waves = len(srcs), len(play.counted)
    glob = {0: tr.w0.clone()}  # global weights at each clock still needed
    vers = [Versions(tr.w0.clone(), nm) for _ in range(n)]
    done = [0] * n  # data waves trained
    deltas: list[dict[int, Tensor]] = [{} for _ in range(waves)]
    curve, computed, clock = [(0, tr.metric(tr.w0))], 0, 0
    todo = [len(ns) for ns in play.numbers]
    while any(done[v] < todo[v] for v in range(n)):
        ready = [v for v in range(n) if done[v] < todo[v] and play.numbers[v][done[v]] <= clock]
        if not ready:
            raise RuntimeError("the play's counted VWs and numbers are not consistent")
        for v in ready:
            d, c = done[v], play.numbers[v][done[v]]
            vers[v].last = glob[c]  # the pull at clock c (the first wave: w0)
            for p in range(d * nm + 1, (d + 1) * nm + 1):
                g = tr.grad(vers[v].for_minibatch(p), *srcs[v].batch(p))
                vers[v].append(vers[v].last - lr * g)
            deltas[c][v] = vers[v].last - glob[c]
            done[v] += 1
            computed += nm
            if computed % every < nm:
                curve.append((computed * tr.batch, tr.metric(glob[clock])))
        while clock < waves and all(u in deltas[clock] for u in play.counted[clock]):
            w = glob[clock].clone()
            for u in play.counted[clock]:  # VW id order, like the shard
                w += deltas[clock][u]
            deltas[clock] = {}
            clock += 1
            glob[clock] = w
        needed = min([play.numbers[v][done[v]] for v in range(n) if done[v] < todo[v]] + [clock])
        glob = {c: w for c, w in glob.items() if c >= needed}
    curve.append((computed * tr.batch, tr.metric(glob[clock])))
    return glob[clock], curve, play.dropped


def easgd(
    tr: Any,
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
        The final centre and the curve (computed samples, metric of the centre).
    """
    n = len(shards)
    check_elastic(n, tau, alpha)
    srcs = vw_sources(shards, tr.batch, seed)
    vers = [Versions(tr.w0.clone(), nm) for _ in range(n)]
    centre = tr.w0.clone()
    curve = [(0, tr.metric(centre))]
    for p in range(1, steps + 1):
        for v in range(n):
            g = tr.grad(vers[v].for_minibatch(p), *srcs[v].batch(p))
            vers[v].append(vers[v].last - warm(lr, p / steps, warmup) * g)
        if p % nm == 0 and exchanges_after(wave_of(p, nm), tau):
            ds = [elastic_difference(vers[v].last, centre, alpha) for v in range(n)]
            for v in range(n):
                vers[v].last = vers[v].last - ds[v]  # version p is the exchanged one
            total = ds[0].clone()
            for d in ds[1:]:
                total += d
            centre = centre + total
        if (p * n) % every == 0:
            curve.append((p * n * tr.batch, tr.metric(centre)))
    return centre, curve


def play_for(
    n: int,
    nm: int,
    backups: int,
    straggle: Callable[[int, int], float],
    computed: int = 0,
    applied: int = 0,
) -> WavePlay:
    """The wave play (equal VWs, the straggler model) whose VWs compute at least ``computed``
    minibatches in all, or whose waves apply ``applied`` minibatches: a VW left behind
    computes fewer waves than the run closes."""
    quorum_n = n - backups
    if applied:
        return play_waves("backup", [1.0] * n, -(-applied // (quorum_n * nm)), nm, straggle,
                          backups=backups)  # fmt: skip
    waves = -(-computed // (n * nm))
    while True:
        play = play_waves("backup", [1.0] * n, waves, nm, straggle, backups=backups)
        got = sum(len(ns) for ns in play.numbers) * nm
        if got >= computed:
            return play
        waves += -(-(computed - got) // (n * nm))


def self_check(tr: Any, train: Any, lr: float) -> None:
    """Backup with b = 0 is WSP at D = 0 on the same data: the two references agree to
    float precision."""
    srcs = backup_sources(train, 3, tr.batch, 0)
    play = play_waves("backup", [1.0] * 3, 4, 2)
    w_b, _, dropped = backup(tr, srcs, 2, lr, 0, 10**9, play)
    w_w, _, _ = wsp(tr, shards_of(train, 3), 8, 2, 0, lr, 0, 10**9, srcs=srcs)
    assert dropped == 0
    torch.testing.assert_close(w_b, w_w, rtol=1e-5, atol=1e-6)


def plot(rows: list[dict[str, Any]], path: Path, task: str = "digits") -> None:
    """The metric vs computed samples, seed 0 of every setting."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    scale = 100 if task == "digits" else 1
    for r in rows:
        xs, ys = zip(*r["curve"], strict=True)
        ax.plot(xs, [scale * y for y in ys], label=r["label"], lw=2 if r["label"] == "seq" else 1)
    ax.set_xlabel("computed training samples (all VWs)")
    if task == "digits":
        ax.set_ylabel("test accuracy (%)")
        ax.set_ylim(0, 100)
        ax.set_title("digits, mlp: backup workers and EASGD vs sequential SGD")
    else:
        ax.set_ylabel("test loss (nats/token)")
        ax.set_title("tiny GPT-2, Markov tokens: backup workers and EASGD vs sequential SGD")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


Run = Callable[[Any, int], tuple[Tensor, Curve, int]]


def settings(args: argparse.Namespace, train: Any) -> list[tuple[str, Run]]:
    """Every setting: sequential SGD, WSP D=0, backup b (equal computed, equal applied),
    EASGD over the tau x alpha grid."""
    n, nm, per_vw = args.vws, args.nm, args.steps // args.vws
    model = Straggle(args.p, args.factor, 0)

    def straggle(v: int, d: int) -> float:
        # equal VWs with a little noise: with exactly equal times a VW that rejoins mid-wave
        # would stay last forever (ties go to the lowest id), which no real device does
        return model.slowdown(v, d) * (1.0 + args.jitter * uniform(7919, v, d))

    out: list[tuple[str, Run]] = [
        ("seq", lambda tr, s: (*sequential(tr, train, args.steps, args.lr, s, args.eval_every), 0))
    ]
    out.append(("wsp D=0", lambda tr, s: (*wsp(
        tr, shards_of(train, n), per_vw, nm, 0, args.lr, s, args.eval_every)[:2], 0)))  # fmt: skip

    def data(tr: Any, s: int) -> list[MinibatchSource]:
        if args.backup_data == "shard":  # the old rule, for comparison: a shard per VW
            return vw_sources(shards_of(train, n), tr.batch, s)
        return backup_sources(train, n, tr.batch, s)

    for b in args.backups:
        plays = [(f"backup b={b}", play_for(n, nm, b, straggle, computed=args.steps))]
        if args.equal_applied:
            plays.append(
                (f"backup b={b} equal applied", play_for(n, nm, b, straggle, applied=args.steps))
            )
        for label, play in plays:
            out.append((label, lambda tr, s, pl=play: backup(
                tr, data(tr, s), nm, args.lr, s, args.eval_every, pl)))  # fmt: skip
    easgd_lr = args.easgd_lr if args.easgd_lr is not None else args.lr * n
    for tau in args.taus:
        for alpha in args.alphas:
            out.append((f"easgd tau={tau} alpha={alpha}", lambda tr, s, t=tau, a=alpha: (*easgd(
                tr, shards_of(train, n), per_vw, nm, t, a, easgd_lr, s, args.eval_every), 0)))  # fmt: skip
    return out


def run_all(
    args: argparse.Namespace, train: Any, make: Callable[[int], Any]
) -> list[dict[str, Any]]:
    """Every setting over ``args.seeds`` seeds; one row each (``make(seed)``: the trainer)."""
    rows: list[dict[str, Any]] = []
    unit, scale = ("%", 100) if args.task == "digits" else ("nats", 1)
    for label, fn in settings(args, train):
        metrics, curve, dropped = [], [], 0
        for seed in range(args.seeds):
            tr = make(seed)
            w, c, dropped = fn(tr, seed)
            bad = 0.0 if args.task == "digits" else float("inf")
            metrics.append(tr.metric(w) if bool(torch.isfinite(w).all()) else bad)
            curve = curve or c
        rows.append({"label": label, "metric": metrics, "mean_metric": sum(metrics) / len(metrics),
                     "dropped_vw_waves": dropped, "computed_samples": c[-1][0], "curve": curve})  # fmt: skip
        gap = scale * (rows[-1]["mean_metric"] - rows[0]["mean_metric"])
        print(f"{label:>28}: {args.task} {scale * rows[-1]['mean_metric']:7.3f} {unit} "
              f"(vs seq {gap:+6.3f})  dropped VW-waves {dropped}", flush=True)  # fmt: skip
    return rows


def main() -> None:
    """Run every setting, write the JSON and the PNG."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    ap.add_argument("--task", choices=("digits", "lm"), default="digits")
    ap.add_argument(
        "--steps", type=int, default=2880, help="computed minibatches (sequential = all VWs')"
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
    ap.add_argument(
        "--no-equal-applied",
        dest="equal_applied",
        action="store_false",
        help="skip the backup rows at equal applied samples",
    )
    ap.add_argument(
        "--backup-data",
        choices=("rule", "shard"),
        default="rule",
        help="backup's data: the runtime's rule (each VW its slice of every global minibatch) "
        "or, for comparison, a shard per VW",
    )
    ap.add_argument("--p", type=float, default=0.1, help="straggler probability per VW-wave")
    ap.add_argument("--factor", type=float, default=3.0, help="straggler slowdown")
    ap.add_argument(
        "--jitter", type=float, default=0.05, help="each VW-wave up to this much slower (uniform)"
    )
    ap.add_argument("--eval-every", type=int, default=96, help="minibatches between curve points")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    args.out = args.out or RESULTS / (
        "sync_convergence.json" if args.task == "digits" else "sync_convergence_lm.json"
    )
    torch.set_num_threads(1)
    if args.task == "digits":
        train, test = split_dataset(DigitsDataset(), 0.2, seed=0)
        make: Callable[[int], Any] = lambda seed: Trainer(args.batch, seed, test)  # noqa: E731
    else:
        from lm_task import LMTrainer, lm_split  # type: ignore[import-not-found]

        train, test = lm_split()
        make = lambda seed: LMTrainer(args.batch, seed, test)  # noqa: E731
    self_check(make(0), train, args.lr)
    print("self-check: backup b=0 equals the WSP reference at D=0 (assert_close) ok")
    t0, load0 = time.perf_counter(), os.getloadavg()
    rows = run_all(args, train, make)
    base = rows[0]["mean_metric"]
    easgd_rows = [r for r in rows if r["label"].startswith("easgd")]
    pick = max if args.task == "digits" else min
    summary = {
        "task": args.task,
        "sequential": base,
        "gaps": {r["label"]: r["mean_metric"] - base for r in rows[1:]},
        "best_easgd": pick(easgd_rows, key=lambda r: r["mean_metric"])["label"]
        if easgd_rows
        else None,
        "seconds": time.perf_counter() - t0,
        "load_average": {"start": load0, "end": os.getloadavg()},
    }
    write_results(args, summary, rows, lambda r, p: plot(r, p, args.task))


if __name__ == "__main__":
    main()
