"""Why no pipelined plan beats AllReduce on the lm workload: samples to test-loss targets, per setting.

Issue 22 asks HetPipe's chosen plan to reach the tiny GPT-2's target (``bench_tta.py
--workloads lm``) 1.2x sooner than DDP. On ``benchmarks/tta_cluster_lm.yaml`` the planner's
pipelined plan is 4 VWs x Nm 4 (595 samples/s predicted, 2.28x DDP's 261), so it wins only if
it needs fewer than 2.28 / 1.2 = 1.9x DDP's samples. This script measures those samples with
the *algorithmic* single-process references (no processes, no timing: the figures do not
depend on the machine's load):

- ``ddp``: one model, minibatch ``world x batch`` (AllReduce of ``world`` devices: sequential
  SGD at the larger batch), no delay;
- ``wsp``: ``--vws`` VWs x ``--nm`` in flight under WSP at ``--d``, each VW on its own shard
  (``benchmarks/remedy_convergence.py``'s ``train_wsp``: deterministic pulls,
  ``planner.wsp``), with ``--remedy none`` or ``predict`` (momentum SGD), or
- ``--optimizer adam``: the same two, each VW with its own Adam state (the stages' rule:
  ``torch.optim.Adam`` per stage; its update is the VW's weight delta).

Every setting runs over its own lr grid (``--lrs``; ``ddp``: ``--ddp-lrs``); the figure is, per
target loss, the fewest samples any lr needed (``None``: no lr reached it within ``--samples``).
The targets lie ``--gaps`` nats above the chain's entropy (the best loss possible), so chains
of different entropy (``--chain``: ``benchmarks/lm_task.py``'s :data:`CHAINS`) compare alike.
``--nm 3 4`` runs the WSP setting at each ``Nm``. The gradient noise scale is reported too:
the calibration's measurement (:func:`hetpipe.calibrate.noise_scale` on the run's seeded
weights, what ``hetpipe plan --calibrate-efficiency`` prints) and the same estimator at the
end of the best DDP run (the noise scale grows as training goes on).

Usage: ``python benchmarks/lm_staleness.py [--optimizer momentum|adam] [--chain wide]
[--nm 3 4] [--samples 24000]``; writes ``benchmarks/results/lm_staleness_<optimizer>.json``
(``_<chain>`` appended for a chain other than the default). A setting takes 1-3 min of one
core per lr (the tiny GPT-2's gradients).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # run as a script: ``benchmarks.*`` from the repository root
    sys.path.insert(0, str(REPO))

import torch  # noqa: E402
from torch import Tensor  # noqa: E402
from torch.utils.data import Subset  # noqa: E402

from benchmarks import remedy_convergence as rc  # noqa: E402
from benchmarks.convergence import RESULTS, shards_of, vw_sources  # noqa: E402
from benchmarks.lm_task import CHAINS, Chain, LMTrainer, markov_tokens  # noqa: E402
from benchmarks.tta_tasks import LM_TEST, LM_TRAIN, Keyword  # noqa: E402
from planner.efficiency import simple_noise_scale  # noqa: E402
from planner.wsp import local_version, required_global_clock  # noqa: E402
from runtime.data import MinibatchSource  # noqa: E402

GAPS = (0.4, 0.2, 0.1, 0.05)
"""Target test losses, in nats per token above the chain's entropy (default chain: 1.578, so
1.98 / 1.78 / 1.68 / 1.63; ``bench_tta``'s lm target 1.6 is 0.022 above it)."""

Curve = list[tuple[int, float]]

ADAM = (0.9, 0.999, 1e-8)  # betas and eps: torch.optim.Adam's defaults, as the stages use


class Trainer(LMTrainer):
    """The lm reference with ``remedy_convergence``'s interface (higher is better: minus loss)."""

    def accuracy(self, w: Tensor) -> float:
        """Minus the test loss at weights ``w``."""
        return -self.metric(w)


def adam_wsp(tr: Trainer, srcs: list[MinibatchSource], nm: int, lr: float,
             args: argparse.Namespace) -> tuple[Tensor, Curve]:  # fmt: skip
    """``len(srcs)`` VWs under WSP (``remedy_convergence.train_wsp``'s pulls), each VW updating
    with its own Adam state; the final weights and curve (samples of all VWs, minus test
    loss)."""
    b1, b2, eps = ADAM
    n, zero = len(srcs), tr.w0.new_zeros(tr.w0.shape)
    own = [[zero] for _ in range(n)]  # own[v][k]: v's own updates 1..k, summed
    state = [(zero.clone(), zero.clone()) for _ in range(n)]  # (m, v) per VW
    total, curve = zero.clone(), [(0, tr.accuracy(tr.w0))]
    for p in range(1, args.samples // (tr.batch * n) + 1):
        g_clock = required_global_clock(p, nm, args.d)
        pulled = tr.w0 + sum((own[u][g_clock * nm] for u in range(n)), zero)
        for v in range(n):
            w = pulled - own[v][g_clock * nm] + own[v][local_version(p, nm)]
            g = tr.grad(w, *srcs[v].batch(p))
            m, s = state[v]
            m, s = b1 * m + (1 - b1) * g, b2 * s + (1 - b2) * g * g
            state[v] = (m, s)
            step = lr * (m / (1 - b1**p)) / ((s / (1 - b2**p)).sqrt() + eps)
            own[v].append(own[v][-1] - step)
            total -= step
        if (p * n) % args.eval_every < n:
            curve.append((p * n * tr.batch, tr.accuracy(total + tr.w0)))
    return total + tr.w0, curve


def run(setting: str, lr: float, train: Subset[Any], test: Any, args: argparse.Namespace
        ) -> tuple[Trainer, Tensor, Curve]:  # fmt: skip
    """One setting (``ddp`` or ``wsp <Nm>``) at ``lr``: its trainer, final weights and curve
    (a point every ``--eval-samples`` samples)."""
    ddp = setting == "ddp"
    batch = args.batch * (args.world if ddp else 1)
    tr = Trainer(batch, args.seed, test)
    n, nm = (1, 1) if ddp else (args.vws, int(setting.split()[1]))
    if n == 1:
        srcs = [MinibatchSource(train, batch, args.seed)]
    else:
        srcs = vw_sources(shards_of(train, n), batch, args.seed)
    every = max(1, args.eval_samples // batch)  # minibatches (of all VWs) between points
    if args.optimizer == "adam":
        return tr, *adam_wsp(
            tr, srcs, nm, lr, argparse.Namespace(**{**vars(args), "eval_every": every})
        )
    ns = argparse.Namespace(steps=args.samples // batch, lr=lr, momentum=args.momentum, d=args.d,
                            eval_every=every, warmup_updates=100)  # fmt: skip
    remedy = "none" if ddp else args.remedy
    if n == 1:
        return tr, *rc.train(tr, srcs[0], nm, remedy, ns)
    return tr, *rc.train_wsp(tr, srcs, nm, remedy, ns)


def reach(curve: Curve, targets: dict[str, float]) -> dict[str, int | None]:
    """Samples until the test loss first falls to each target (named by its gap)."""
    return {k: next((s for s, m in curve if -m <= t), None) for k, t in targets.items()}


def calibration_noise(chain: Chain, batch: int, seed: int) -> float:
    """The gradient noise scale ``hetpipe plan --calibrate-efficiency`` measures on this
    chain's ``LM_TRAIN`` sequences (``tta_tasks`` keyword samples), batch ``batch`` and
    ``4 batch``, at the weights a run with ``--seed seed`` starts from."""
    from hetpipe.calibrate import feed, noise_scale, seeded_model

    data = Keyword(markov_tokens(LM_TRAIN, 0, chain).tensors[0])
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        spec = seeded_model("examples.gpt2_lm:tiny", batch, seed)
        loss_at, n = feed(data, spec, batch)
        params = {k: v.detach().clone().requires_grad_() for k, v in spec.module.named_parameters()}
        return noise_scale(loss_at, params, n, batch)


def trained_noise(tr: Trainer, w: Tensor, train: Subset[Any], batch: int, draws: int = 8
                  ) -> float:  # fmt: skip
    """The same estimator (batch ``batch`` and ``4 batch``, ``draws`` minibatches each) at the
    trained weights ``w``."""
    rng, ids = random.Random(0), train.dataset.tensors[0]  # type: ignore[attr-defined]

    def mean_sq(size: int) -> float:
        rows = [ids[rng.sample(range(len(ids)), size)] for _ in range(draws)]
        return sum(float((tr.grad(w, (x,), x) ** 2).sum()) for x in rows) / draws

    return simple_noise_scale(batch, 4 * batch, mean_sq(batch), mean_sq(4 * batch))


def parse() -> argparse.Namespace:
    """The command line, grids and output path filled in."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    ap.add_argument("--optimizer", choices=("momentum", "adam"), default="momentum")
    ap.add_argument("--remedy", choices=("none", "predict"), default="predict")
    ap.add_argument("--momentum", type=float, default=0.9, help="momentum SGD's (not Adam)")
    ap.add_argument("--chain", choices=sorted(CHAINS), default="default")
    ap.add_argument("--gaps", type=float, nargs="+", default=list(GAPS))
    ap.add_argument("--samples", type=int, default=24000)
    ap.add_argument("--batch", type=int, default=16, help="per device / per VW (bench_tta's)")
    ap.add_argument("--world", type=int, default=4, help="devices of the AllReduce baseline")
    ap.add_argument("--vws", type=int, default=4)
    ap.add_argument("--nm", type=int, nargs="+", default=[4])
    ap.add_argument("--d", type=int, default=0)
    ap.add_argument("--lrs", type=float, nargs="+", default=None)
    ap.add_argument("--ddp-lrs", type=float, nargs="+", default=None)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--eval-samples", type=int, default=1024, help="samples between points")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    adam = args.optimizer == "adam"
    args.lrs = args.lrs or ([0.0003, 0.001, 0.003] if adam else [0.0025, 0.005, 0.01])
    args.ddp_lrs = args.ddp_lrs or ([0.001, 0.003, 0.01] if adam else [0.04, 0.08, 0.16])
    suffix = "" if args.chain == "default" else f"_{args.chain}"
    args.out = args.out or RESULTS / f"lm_staleness_{args.optimizer}{suffix}.json"
    return args


def main() -> None:
    """Every setting at every lr; print and write the fewest samples per target."""
    args = parse()
    torch.set_num_threads(1)
    chain = CHAINS[args.chain]
    floor = chain.entropy_nats()
    targets = {f"{g:g}": floor + g for g in args.gaps}
    train = Subset(markov_tokens(LM_TRAIN, 0, chain), list(range(LM_TRAIN)))
    test = markov_tokens(LM_TEST, 1, chain)
    t0, load0 = time.perf_counter(), os.getloadavg()
    phi0 = calibration_noise(chain, args.batch, args.seed)
    print(f"chain {args.chain} {chain}: entropy {floor:.3f} nats, "
          f"targets {targets}, noise scale at the start {phi0:.1f}", flush=True)  # fmt: skip
    settings = [("ddp", args.ddp_lrs)] + [(f"wsp {nm}", args.lrs) for nm in args.nm]
    rows, trained = [], {}
    for setting, lrs in settings:
        for lr in lrs:
            tr, w, curve = run(setting, lr, train, test, args)
            rows.append({"setting": setting, "lr": lr, "reach": reach(curve, targets),
                         "best_loss": -max(m for _, m in curve), "curve": curve})  # fmt: skip
            if setting == "ddp":
                trained[lr] = (tr, w)
            print(f"{setting} lr {lr:g}: samples to {rows[-1]['reach']}, best loss "
                  f"{rows[-1]['best_loss']:.3f}", flush=True)  # fmt: skip
    best = {s: {k: min((r["reach"][k] for r in rows if r["setting"] == s
                        and r["reach"][k] is not None), default=None)
                for k in targets} for s, _ in settings}  # fmt: skip
    ddp_lr = min((r for r in rows if r["setting"] == "ddp"), key=lambda r: r["best_loss"])["lr"]
    phi1 = trained_noise(*trained[ddp_lr], train, args.batch)
    print(f"fewest samples per target: {best}; noise scale after DDP (lr {ddp_lr:g}): {phi1:.1f}")
    config = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    out = {"config": config, "chain": asdict(chain), "entropy_nats": floor, "targets": targets,
           "noise_scale": {"start": phi0, "after_ddp": phi1, "ddp_lr": ddp_lr},
           "best": best, "rows": rows, "seconds": time.perf_counter() - t0,
           "loadavg": {"start": load0, "end": os.getloadavg()}}  # fmt: skip
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
