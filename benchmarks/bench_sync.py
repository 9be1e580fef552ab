"""Synchronisation rules under stragglers, side by side in one run (issue 16).

An emulated cluster of ``--vws`` identical devices (one per node, one VW each, the ``np``
policy), every (VW, wave) straggling with probability ``--p`` at ``--factor`` x its paced time
(``emulate: {straggle: ...}``, reproducible). Every rule trains the same model on the same data
for the same number of minibatches per VW, in this order, one after the other:

- WSP at D = 0 and at each ``--ds`` (the parameter servers' default rule);
- backup workers, ``b`` in ``--backups`` (a wave closes at the first ``VWs - b`` pushes);
- EASGD with ``--tau``/``--alpha`` (each VW's lr x VWs: the centre averages, WSP sums);
- DDP AllReduce (BSP every minibatch) on the same devices, lr x world (linear scaling).

Per rule: throughput (computed samples/s, and applied: the samples whose updates reached the
weights), the wave-level simulator's prediction of the applied throughput under the same
stragglers, waiting time, dropped VW-waves, the k-th push delays (seed 003 Fig. 4), final test
accuracy, and the wall time until the training loss (moving average over VWs) first reaches
``--target-loss``: a time-to-target measured inside each single run (the runs evaluate the test
accuracy only at the end).

    python benchmarks/bench_sync.py [--vws 4 --steps 150 --p 0.1 --factor 3]  # ~2 min

Writes ``benchmarks/results/sync.json``. The machine's load average is recorded before and
after: figures measured on a loaded machine say so.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
from pathlib import Path
from typing import Any

from hetpipe.planning import plan as plan_cluster
from hetpipe.planning import profiles_for
from planner.baseline import allreduce_plan
from planner.cluster import parse_cluster
from planner.sim.waves import predict_rule
from planner.sync import with_rule
from runtime.config import ModelSource, OptimizerConfig, RunConfig
from runtime.results.run_result import RunResult
from runtime.results.sync import dropped_vw_waves, kth_push_s
from runtime.run import run_plan
from runtime.spec import RunSpec

REPO = Path(__file__).resolve().parent.parent


def cluster(args: argparse.Namespace) -> Any:
    """``args.vws`` identical emulated nodes of one device, straggling as asked."""
    emu = {"speed": args.speed, "memory": "16MiB",
           "straggle": {"p": args.p, "factor": args.factor, "seed": args.seed}}  # fmt: skip
    nodes = [
        {"name": f"N{k}", "gpu": "TITAN V", "count": 1, "emulate": emu} for k in range(args.vws)
    ]
    return parse_cluster({"name": "stragglers", "nodes": nodes})


def time_to_loss(points: list[tuple[float, float]], target: float, window: int) -> float | None:
    """First time (s) the moving average of ``window`` losses (in time order) is <= target."""
    points.sort()
    for i in range(window, len(points) + 1):
        if sum(loss for _, loss in points[i - window : i]) / window <= target:
            return points[i - 1][0]
    return None


def final_loss(points: list[tuple[float, float]], window: int) -> float:
    """Mean of the last ``window`` losses in time order."""
    last = sorted(points)[-window:]
    return sum(loss for _, loss in last) / max(1, len(last))


def wsp_row(res: RunResult, args: argparse.Namespace, predicted: float) -> dict[str, Any]:
    """The figures of a run through the parameter servers."""
    t0 = min(s.start_time for v in res.vws for s in v.stages)
    points = [(t - t0, loss) for v in res.vws for (_, loss), t in
              zip(sorted(v.stages[-1].losses), v.stages[-1].done_times, strict=False)]  # fmt: skip
    dropped = dropped_vw_waves(res.vws)
    waves = sum(v.steps for v in res.vws) // res.nm  # computed VW-waves
    # applied (the ledger); AllReduce has no shards and applies every minibatch it computes;
    # under EASGD every minibatch trains its VW's replica (the ledger holds one entry per
    # exchange, every tau waves)
    counted = waves
    if res.states and res.sync != "easgd":
        counted = len({(e.vw, e.wave) for e in res.states[0].ledger})
    applied = res.throughput * counted / waves if waves else 0.0
    return {
        "throughput": res.throughput,
        "applied_throughput": applied,
        "predicted_applied": predicted,
        "waiting_s": sum(res.waiting_s(k) for k in range(len(res.vws))),
        "dropped_vw_waves": dropped,
        "kth_push_s": kth_push_s(res.vws),
        "test_accuracy": res.test_accuracy,
        "time_to_target_s": time_to_loss(points, args.target_loss, 2 * len(res.vws)),
        "final_loss": final_loss(points, 2 * len(res.vws)),
        "wall_s": res.wall_s,
    }


def settings(args: argparse.Namespace) -> list[tuple[str, str, dict[str, float], float]]:
    """(label, rule, params, lr) of every run, in order."""
    out = [(f"WSP D={d}", "wsp", {"D": float(d)}, args.lr) for d in [0, *args.ds]]
    out += [(f"backup b={b}", "backup", {"backups": float(b)}, args.lr) for b in args.backups]
    out.append((f"EASGD tau={args.tau} alpha={args.alpha:g}", "easgd",
                {"tau": float(args.tau), "alpha": args.alpha}, args.lr * args.vws))  # fmt: skip
    return out


def main() -> None:
    """Run every rule, then DDP; print one line each and write the JSON."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    ap.add_argument("--model", default="mlp(hidden=384,depth=4)")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--vws", type=int, default=4)
    ap.add_argument("--speed", type=float, default=0.05, help="emulated speed of every device")
    ap.add_argument("--steps", type=int, default=150, help="minibatches per VW")
    ap.add_argument("--nm", type=int, default=1, help="one-device VWs: a wave is a minibatch")
    ap.add_argument("--lr", type=float, default=0.05)
    ap.add_argument("--p", type=float, default=0.1)
    ap.add_argument("--factor", type=float, default=3.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--ds", type=int, nargs="+", default=[2])
    ap.add_argument("--backups", type=int, nargs="+", default=[1])
    ap.add_argument("--tau", type=int, default=2)
    ap.add_argument("--alpha", type=float, default=0.2)
    ap.add_argument("--target-loss", type=float, default=0.8)
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "sync.json"))
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING)
    cl = cluster(args)
    base = plan_cluster(cl, model=args.model, batch_size=args.batch, policy="np", nm=args.nm)
    source = ModelSource(ref=args.model)
    load_before = os.getloadavg()
    rows: dict[str, dict[str, Any]] = {}
    for label, rule, params, lr in settings(args):
        if rule == "wsp":
            plan = dataclasses.replace(base, D=int(params["D"]))
            pred = predict_rule(plan, "wsp", args.steps // plan.nm, D=plan.D)
        else:
            plan = with_rule(base, rule, params)
            pred = predict_rule(plan, rule, args.steps // plan.nm, backups=int(params.get("backups", 0)),
                                tau=int(params.get("tau", 1)))  # fmt: skip
        run = RunConfig(steps=args.steps, seed=args.seed, progress=False)
        res = run_plan(plan, source, RunSpec(run, OptimizerConfig(lr=lr)))
        assert isinstance(res, RunResult)
        rows[label] = wsp_row(res, args, pred.throughput(plan.batch_size))
        _print(label, rows[label])
    cpu = profiles_for(cl, [], args.model, args.batch)
    ddp_plan = allreduce_plan(cl, args.model, args.batch, profiles=cpu)
    world = len(ddp_plan.virtual_workers)
    run = RunConfig(steps=args.steps * args.vws // world, seed=args.seed, progress=False)
    ddp = run_plan(ddp_plan, source, RunSpec(run, OptimizerConfig(lr=args.lr * world)))
    assert isinstance(ddp, RunResult)  # the allreduce rule under the same launcher
    rows[f"DDP ({world} devices)"] = wsp_row(ddp, args, ddp.predicted_throughput)
    _print(f"DDP ({world} devices)", rows[f"DDP ({world} devices)"])
    load = [load_before, os.getloadavg()]
    print(f"load average before/after: {load[0][0]:.2f} / {load[1][0]:.2f}")
    Path(args.out).write_text(json.dumps({"config": vars(args), "load_before_after": load,
                                          "rows": rows}, indent=2) + "\n")  # fmt: skip
    print(f"wrote {args.out}")


def _print(label: str, r: dict[str, Any]) -> None:
    tt = r["time_to_target_s"]
    print(
        f"{label:>22}: {r['throughput']:7.1f} samples/s (applied {r['applied_throughput']:7.1f}, "
        f"predicted {r['predicted_applied']:7.1f}), waiting {r['waiting_s']:6.2f} s, dropped "
        f"{r['dropped_vw_waves']}, accuracy {r['test_accuracy']:.2%}, loss {r['final_loss']:.3f}, to target "
        f"{'not reached' if tt is None else f'{tt:.2f} s'}",
        flush=True,
    )


if __name__ == "__main__":
    main()
