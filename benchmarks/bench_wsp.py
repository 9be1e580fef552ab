"""WSP runtime figures on the emulated cluster, measured side by side in one run.

For one plan (2 VWs by policy hd on ``examples/emulated_cluster.yaml``, made once and reused):
``hetpipe run`` with D in ``--ds`` (throughput, waiting and idle seconds per VW, test accuracy),
then the DDP AllReduce baseline (``runtime.ddp.run_allreduce``) on the same emulated devices and
data for the same number of samples. Prints the ratios (waiting at each D / waiting at D = 0,
idle / waiting, HetPipe / AllReduce throughput) and writes ``benchmarks/results/wsp.json``.

    python benchmarks/bench_wsp.py [--epochs 10 --ds 0 4]
"""

from __future__ import annotations

import argparse
import json
import logging
import os
from pathlib import Path

from planner.cluster import load_cluster
from planner.planner import make_plan
from runtime.config import ModelSource, OptimizerConfig, RunConfig
from runtime.ddp import run_allreduce
from runtime.wsp_launcher import WSPConfig, launch_wsp

REPO = Path(__file__).resolve().parent.parent


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cluster", default=str(REPO / "examples" / "emulated_cluster.yaml"))
    ap.add_argument("--epochs", type=float, default=10.0)
    ap.add_argument("--ds", type=int, nargs="+", default=[0, 4])
    ap.add_argument("--results", default=str(REPO / "benchmarks" / "results" / "wsp.json"))
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING)
    cluster = load_cluster(args.cluster)
    plan = make_plan(cluster, model="mlp", batch_size=32, num_vws=2, policy="hd")
    opt = OptimizerConfig(lr=0.05)
    rows = []
    for d in args.ds:
        res = launch_wsp(
            plan, ModelSource(ref="mlp"), opt, RunConfig(epochs=args.epochs), WSPConfig(D=d)
        )
        row = {
            "D": d,
            "throughput": res.throughput,
            "predicted": res.predicted_throughput,
            "waiting_s": [res.waiting_s(k) for k in range(len(res.vws))],
            "idle_s": [res.idle_s(k) for k in range(len(res.vws))],
            "test_accuracy": res.test_accuracy,
            "samples": sum(v.steps for v in res.vws) * plan.batch_size,
            "max_clock_distance": res.max_clock_distance,
        }
        rows.append(row)
        print(
            f"D={d}: {row['throughput']:.1f} samples/s, waiting {sum(row['waiting_s']):.2f} s, "
            f"idle {sum(row['idle_s']):.2f} s, accuracy {row['test_accuracy']:.2%}"
        )
    samples = rows[0]["samples"]
    n_dev = len(cluster.devices)
    steps = max(2, round(samples / (plan.batch_size * n_dev)))
    ddp = run_allreduce(cluster, "mlp", plan.batch_size, steps, optimizer=opt)
    print(
        f"AllReduce on {' '.join(ddp.devices)}: {ddp.throughput:.1f} samples/s, accuracy {ddp.test_accuracy:.2%}"
    )
    base_wait = sum(rows[0]["waiting_s"]) or float("nan")
    ratios = {
        "waiting_vs_D0": {r["D"]: sum(r["waiting_s"]) / base_wait for r in rows},
        "idle_over_waiting": {
            r["D"]: sum(r["idle_s"]) / (sum(r["waiting_s"]) or float("nan")) for r in rows
        },
        "hetpipe_over_allreduce": {r["D"]: r["throughput"] / ddp.throughput for r in rows},
        "measured_over_predicted": {r["D"]: r["throughput"] / r["predicted"] for r in rows},
    }
    print(json.dumps(ratios, indent=2))
    out = {
        "load": os.getloadavg(),
        "plan": {"nm": plan.nm, "vws": [v.signature for v in plan.virtual_workers]},
        "runs": rows,
        "allreduce": {"throughput": ddp.throughput, "accuracy": ddp.test_accuracy, "steps": steps},
        "ratios": ratios,
    }
    Path(args.results).write_text(json.dumps(out, indent=2), encoding="utf-8")


if __name__ == "__main__":
    main()
