"""Emulated links: ED, HD and the AllReduce baseline, measured beside predicted throughput.

An emulated cluster whose links are scaled (``links: {scale: F}``) so that communication is
at least a fifth of a step: every stage-to-stage, parameter-server and AllReduce transfer is
paced to the plan's links (``runtime/link_pacing.py``), so the measured throughput should
follow the simulator's prediction, communication included. Each row reports the plan's
communication share (what the plan charges to links over the step), measured and predicted
samples/s and the load average (a loaded machine paces late: compare ratios, not figures).

    python benchmarks/bench_links.py                  # the lead's quiet run
    python benchmarks/bench_links.py --steps 10 --scale 100 --out /tmp/links.json   # a smoke run
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import tempfile
import time
from pathlib import Path
from typing import Any

from planner.cluster import Cluster, load_cluster, parse_cluster
from planner.plan import Plan
from planner.rules import layout

MODEL = "mlp(hidden=512,depth=4)"  # parameters heavy enough for the AllReduce to matter
RESULTS = Path(__file__).resolve().parent / "results" / "links.json"


def example_overhead() -> dict[str, Any]:
    """The runtime-overhead model of ``examples/emulated_cluster.yaml`` (this host's fit)."""
    example = load_cluster(
        Path(__file__).resolve().parents[1] / "examples" / "emulated_cluster.yaml"
    )
    return dataclasses.asdict(example.runtime_overhead)


def bench_cluster(scale: float) -> Cluster:
    """The example cluster's four GPU types (speeds by FP32 peak), caps that hold the whole
    model (so the AllReduce runs on all four), links slowed ``scale`` times."""
    emu = {"memory": "64MiB"}
    return parse_cluster(
        {
            "name": "links-bench",
            "nodes": [
                {"name": "V", "gpu": "TITAN V", "count": 1, "emulate": {"speed": 0.18, **emu}},
                {"name": "R", "gpu": "TITAN RTX", "count": 1, "emulate": {"speed": 0.20, **emu}},
                {"name": "G", "gpu": "GeForce RTX 2060", "count": 1, "emulate": {"speed": 0.08, **emu}},
                {"name": "Q", "gpu": "Quadro P4000", "count": 1, "emulate": {"speed": 0.065, **emu}},
            ],
            "links": {
                "intra_node": {"bandwidth": "2GB/s", "latency": "50us"},
                "inter_node": {"bandwidth": "1GB/s", "latency": "80us"},
                "scale": scale,
            },
            "runtime_overhead": example_overhead(),
        },
        "bench_links",
    )  # fmt: skip


def comm_share(plan: Plan) -> float:
    """The largest fraction of a step any VW's plan charges to links: receive times over
    stage times (WSP), the ring all-reduce over the step (AllReduce)."""
    if layout(plan.sync) == "ddp":
        from planner.sim.simulator import allreduce_for_plan

        r = allreduce_for_plan(plan)
        return r.allreduce_ms / r.iteration_ms if r.iteration_ms > 0 else 0.0
    shares = []
    for vw in plan.virtual_workers:
        step = sum(s.time_ms for s in vw.stages)
        shares.append(sum(s.recv_fwd_ms + s.recv_bwd_ms for s in vw.stages) / step)
    return max(shares)


def plans(cluster: Cluster, batch: int) -> list[tuple[str, Plan]]:
    """ED (one VW of every device), HD (two VWs) and the AllReduce baseline."""
    from hetpipe.planning import plan, profiles_for
    from planner.baseline import allreduce_plan

    cpu = profiles_for(cluster, [], MODEL, batch)  # the front end measures, the planner plans
    return [
        ("ED", plan(cluster, policy="ed", model=MODEL, batch_size=batch, num_vws=1)),
        ("HD", plan(cluster, policy="hd", model=MODEL, batch_size=batch, num_vws=2)),
        ("AllReduce", allreduce_plan(cluster, MODEL, batch, profiles=cpu)),
    ]


MIN_WAVES = 8
"""Waves every run trains at least: the plan predicts the steady state, and a run of 2 waves
(60 minibatches at Nm 32) is mostly warm-up and drain."""


def run_one(label: str, plan: Plan, steps: int) -> dict[str, Any]:
    """Train ``plan`` (paced links and devices) for ``steps`` minibatches per VW, at least
    :data:`MIN_WAVES` waves, and report it as one row and one line."""
    from hetpipe.api import train

    steps = max(steps, MIN_WAVES * plan.nm)
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        result = train(MODEL, plan=plan, steps=steps, out=tmp, return_state=False)
        wall = time.perf_counter() - t0
    predicted, measured = plan.predicted.throughput, result.throughput
    load = os.getloadavg()
    row = {
        "policy": label,
        "vws": len(plan.virtual_workers),
        "steps": steps,
        "comm_share": comm_share(plan),
        "predicted": predicted,
        "measured": measured,
        "measured_over_predicted": measured / predicted if predicted > 0 else None,
        "wall_s": wall,
        "loadavg": load,
    }
    print(
        f"  {label:9s} {len(plan.virtual_workers)} VWs, links {row['comm_share']:.0%} of a step: "
        f"{measured:8.1f} measured, {predicted:8.1f} predicted samples/s "
        f"({measured / predicted:.2f}), load {load[0]:.1f}"
    )
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--scale", type=float, default=50.0, help="links.scale of the cluster")
    ap.add_argument("--steps", type=int, default=60, help="minibatches per VW (at least 8 waves)")
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--out", type=Path, default=RESULTS, help="JSON file to write")
    args = ap.parse_args()
    cluster = bench_cluster(args.scale)
    print(f"{MODEL}, batch {args.batch_size}, {args.steps} steps: {cluster.links.describe(True)}")
    rows = [run_one(label, p, args.steps) for label, p in plans(cluster, args.batch_size)]
    low = [r["policy"] for r in rows if r["comm_share"] < 0.2]
    if low:
        print(f"  note: links are under a fifth of a step for {', '.join(low)}; raise --scale")
    by = {r["policy"]: r for r in rows}
    base = by["AllReduce"]
    vs = {
        p: {k: by[p][k] / base[k] if base[k] else None for k in ("measured", "predicted")}
        for p in ("ED", "HD")
    }
    for p, r in vs.items():
        print(
            f"  {p}/AllReduce: {r['measured'] or 0:.2f} measured, {r['predicted'] or 0:.2f} predicted"
        )
    doc = {
        "model": MODEL,
        "scale": args.scale,
        "steps": args.steps,
        "rows": rows,
        "vs_allreduce": vs,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(doc, indent=2), encoding="utf-8")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
