"""Planning CPU time vs cluster size, up to 10,240 GPUs (issue #24: <= 30 CPU s).

Run: ``python benchmarks/bench_plan_scale.py [--sizes 64,256,...] [--policy hd]`` from the repo
root. Each cluster has 8-GPU nodes of the paper's four GPU types dealt round-robin (written to
a temporary cluster.yaml, as ``hetpipe plan`` would read it); the model is the vendored
PipeDream VGG-16 profile. Prints, per size, the VWs, the policy, the predicted throughput, the
CPU seconds of ``make_plan`` (this process only; imports are warmed up first) and the wall
seconds, with the load average; writes ``benchmarks/results/plan_scale.json``. CPU seconds are
the figure to compare: the wall seconds depend on the machine's load.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from planner.cluster import load_cluster  # noqa: E402
from planner.planner import make_plan  # noqa: E402
from profiler.pipedream import import_pipedream  # noqa: E402

TYPES = ("TITAN V", "TITAN RTX", "GeForce RTX 2060", "Quadro P4000")
SIZES = (64, 256, 1024, 4096, 10240)


def write_cluster(gpus: int, folder: Path) -> Path:
    """A cluster.yaml of ``gpus / 8`` nodes of 8 GPUs, the four types dealt round-robin."""
    nodes = [{"name": f"n{i}", "gpu": TYPES[i % 4], "count": 8} for i in range(gpus // 8)]
    path = folder / f"cluster_{gpus}.yaml"
    path.write_text(yaml.safe_dump({"name": f"gen{gpus}", "nodes": nodes}))
    return path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default=",".join(map(str, SIZES)))
    ap.add_argument("--policy", default=None, help="np | ed | hd | auto (default: hetpipe's)")
    args = ap.parse_args()
    prof = import_pipedream(REPO / "tests" / "data" / "pipedream" / "vgg16" / "graph.txt")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        make_plan(load_cluster(write_cluster(64, Path(tmp))), [prof])  # warm up the imports
        for gpus in (int(s) for s in args.sizes.split(",")):
            cluster = load_cluster(write_cluster(gpus, Path(tmp)))
            c0, w0 = time.process_time(), time.perf_counter()
            plan = make_plan(cluster, [prof], policy=args.policy)
            cpu, wall = time.process_time() - c0, time.perf_counter() - w0
            load = os.getloadavg()[0]
            row = {
                "gpus": gpus,
                "vws": len(plan.virtual_workers),
                "policy": plan.policy,
                "nm": plan.nm,
                "predicted": plan.predicted.throughput,
                "method": plan.predicted.method,
                "cpu_s": cpu,
                "wall_s": wall,
                "loadavg_1min": load,
            }
            rows.append(row)
            print(
                f"{gpus:6d} GPUs  {row['vws']:5d} VWs  {plan.policy:4s} Nm {plan.nm}  "
                f"{plan.predicted.throughput:12,.0f} samples/s ({plan.predicted.method})  "
                f"CPU {cpu:6.2f} s  wall {wall:6.2f} s  load {load:.1f}",
                flush=True,
            )
    out = REPO / "benchmarks" / "results" / "plan_scale.json"
    out.write_text(json.dumps(rows, indent=1) + "\n")
    print(f"wrote {out.relative_to(REPO)}")


if __name__ == "__main__":
    main()
