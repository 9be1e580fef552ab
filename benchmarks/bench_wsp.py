"""WSP runtime figures on the emulated cluster, measured side by side in one run.

For each allocation policy in ``--policies`` (a plan made once per policy on
``examples/emulated_cluster.yaml``: ``ed`` = one VW of V R G Q, ``hd`` = 2 VWs Q V and R G) and
each D in ``--ds``: ``launch`` for ``--steps`` minibatches per VW (throughput, the plan's
prediction, waiting and idle seconds per VW, test accuracy); then the DDP AllReduce baseline
(the ``allreduce`` rule of the same launcher on ``planner.baseline.allreduce_plan``) on the devices of the same cluster that hold the whole model, on
the same data, for the same number of samples as the first HetPipe run. The default model
``mlp(hidden=384,depth=4)`` (3.8 MiB as a whole with plain SGD) fits only V and R, as the paper's
large models fit only some GPUs; at batch 128 (stages of milliseconds, so compute dominates
per-message costs as in the paper) the activations leave only R able to hold the whole model
(measured: DDP ran on R:0 alone), so DDP uses 1 device and HetPipe all 4. Prints the ratios
(waiting at each D / waiting at D = 0, idle / waiting, HetPipe / AllReduce throughput,
measured / predicted) and writes ``benchmarks/results/wsp.json``.

    python benchmarks/bench_wsp.py [--model M --batch 128 --steps 300 --policies ed hd --ds 0 1 2 4]
"""

from __future__ import annotations

import argparse
import json
import logging
import os
from pathlib import Path

from hetpipe.planning import plan as plan_cluster
from hetpipe.planning import profiles_for
from planner.baseline import allreduce_plan
from planner.cluster import load_cluster
from runtime.config import ModelSource, OptimizerConfig, RunConfig
from runtime.launch.launcher import launch
from runtime.results.run_result import RunResult
from runtime.spec import RunSpec, SyncConfig

REPO = Path(__file__).resolve().parent.parent


def _run_policy(
    cluster: object, policy: str, args: argparse.Namespace, opt: OptimizerConfig
) -> list[dict[str, object]]:
    """Every D of ``args.ds`` on the plan of ``policy``; one row each."""
    n_vws = None if policy == "ed" else 2
    plan = plan_cluster(
        cluster, model=args.model, batch_size=args.batch, num_vws=n_vws, policy=policy,
        optimizer="sgd",
    )  # fmt: skip
    rows = []
    for d in args.ds:
        spec = RunSpec(RunConfig(steps=args.steps), opt, sync=SyncConfig(D=d))
        res = launch(plan, ModelSource(ref=args.model), spec)
        row = {
            "policy": policy,
            "vws": [v.signature for v in plan.virtual_workers],
            "nm": plan.nm,
            "D": d,
            "throughput": res.throughput,
            "predicted": res.predicted_throughput,
            "measured_over_predicted": res.throughput / res.predicted_throughput,
            "waiting_s": [res.waiting_s(k) for k in range(len(res.vws))],
            "idle_s": [res.idle_s(k) for k in range(len(res.vws))],
            "test_accuracy": res.test_accuracy,
            "samples": sum(v.steps for v in res.vws) * plan.batch_size,
            "max_clock_distance": res.max_clock_distance,
        }
        rows.append(row)
        print(
            f"{policy} {'/'.join(row['vws'])} Nm={plan.nm} D={d}: {res.throughput:.1f} samples/s "
            f"(predicted {res.predicted_throughput:.1f}, ratio {row['measured_over_predicted']:.2f}), "
            f"waiting {sum(row['waiting_s']):.2f} s, idle {sum(row['idle_s']):.2f} s, "
            f"accuracy {res.test_accuracy:.2%}",
            flush=True,
        )
    return rows


def main() -> None:
    """Run every policy and D, then the DDP baseline; print and record the ratios."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    ap.add_argument("--cluster", default=str(REPO / "examples" / "emulated_cluster.yaml"))
    ap.add_argument("--model", default="mlp(hidden=384,depth=4)")
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--steps", type=int, default=300, help="minibatches per VW")
    ap.add_argument("--lr", type=float, default=0.05)
    ap.add_argument("--policies", nargs="+", default=["ed", "hd"])
    ap.add_argument("--ds", type=int, nargs="+", default=[0, 1, 2, 4])
    ap.add_argument("--results", default=str(REPO / "benchmarks" / "results" / "wsp.json"))
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING)
    cluster = load_cluster(args.cluster)
    opt = OptimizerConfig(lr=args.lr)
    load_before = os.getloadavg()
    rows = [r for policy in args.policies for r in _run_policy(cluster, policy, args, opt)]
    ddp_samples = int(rows[0]["samples"])  # type: ignore[call-overload]
    cpu = profiles_for(cluster, [], args.model, args.batch)
    ddp_plan = allreduce_plan(
        cluster, args.model, args.batch, profiles=cpu, optimizer=opt.memory_class
    )
    world = len(ddp_plan.virtual_workers)
    steps = max(2, round(ddp_samples / (args.batch * world)))
    ddp_spec = RunSpec(RunConfig(steps=steps), OptimizerConfig(lr=args.lr * world))
    ddp = launch(ddp_plan, ModelSource(ref=args.model), ddp_spec)
    assert isinstance(ddp, RunResult)
    devices = [vw.stages[0].device for vw in ddp.vws]
    print(
        f"AllReduce on {' '.join(devices)} ({steps} steps, lr x {world}): "
        f"{ddp.throughput:.1f} samples/s, accuracy {ddp.test_accuracy:.2%}"
    )
    ratios: dict[str, dict[str, float]] = {}
    for policy in args.policies:
        mine = [r for r in rows if r["policy"] == policy]
        base_wait = sum(mine[0]["waiting_s"]) or float("nan")  # type: ignore[call-overload]
        for r in mine:
            key = f"{policy} D={r['D']}"
            wait = sum(r["waiting_s"])  # type: ignore[call-overload]
            ratios[key] = {
                "hetpipe_over_allreduce": float(r["throughput"]) / ddp.throughput,  # type: ignore[arg-type]
                "measured_over_predicted": float(r["measured_over_predicted"]),  # type: ignore[arg-type]
                "waiting_vs_D0": wait / base_wait,
                "idle_over_waiting": sum(r["idle_s"]) / (wait or float("nan")),  # type: ignore[call-overload]
            }
    print(json.dumps(ratios, indent=2))
    out = {
        "config": vars(args),
        "load_before_after": [load_before, os.getloadavg()],
        "runs": rows,
        "allreduce": {
            "devices": devices,
            "throughput": ddp.throughput,
            "accuracy": ddp.test_accuracy,
            "steps": steps,
            "lr": args.lr * world,
        },
        "ratios": ratios,
    }
    Path(args.results).write_text(json.dumps(out, indent=2), encoding="utf-8")
    print(f"wrote {args.results}")


if __name__ == "__main__":
    main()
