"""The GeePS experiment (Cui et al., EuroSys'16, Fig. 11) on the emulated cluster: throughput vs
the fraction of device memory allowed, one curve per batch size.

One VW over the four emulated devices of ``examples/emulated_cluster.yaml`` trains
``mlp(hidden=256,depth=8)`` at a fixed Nm (default 4). At fraction ``f`` every device's memory
cap is ``f`` times its cap in the cluster file; the planner (``--memory auto``) partitions the
model and places each stage's data (keep / offload to host memory / recompute,
``docs/memory.md``); the plan is then trained for real (paced, byte accounting on: a stage
above its cap fails the run). Figures per point: the device bytes the plan keeps over the bytes
of the all-keep plan at ``f = 1`` (GeePS's x axis: the fraction of the data kept on the device; ``--cap-scale`` multiplies every cap first, for
larger models whose longer tasks the machine's load disturbs less),
the placements, predicted and measured samples/s, and measured throughput relative to ``f = 1``.

The host link is the cluster's (``links.host_link``, PCIe by default) unless ``--host-link``
gives one (e.g. ``300MB/s``: the emulated devices compute ~10x slower than their GPUs, so a
link scaled the same way exposes transfer time as GeePS's PCIe did).

Run: ``python benchmarks/bench_geeps.py [--batches 16 32 --steps 300]`` (about 2-3 min).
Writes ``benchmarks/results/geeps.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.plan_runs import run_row, train_plan  # noqa: E402
from hetpipe.planning import plan as plan_cluster  # noqa: E402
from planner.cluster import Cluster, Link, load_cluster  # noqa: E402
from planner.plan import Plan  # noqa: E402
from planner.planner import PlanOptions  # noqa: E402
from profiler.errors import PlanError  # noqa: E402
from profiler.units import parse_bandwidth  # noqa: E402

RESULTS = REPO / "benchmarks" / "results" / "geeps.json"
FRACTIONS = (1.0, 0.85, 0.7, 0.6, 0.5, 0.4)


def scaled(cluster: Cluster, f: float) -> Cluster:
    """``cluster`` with every emulated memory cap times ``f``."""
    nodes = tuple(
        replace(n, emulation=replace(n.emulation, memory_bytes=int(n.emulation.memory_bytes * f)))
        if n.emulation is not None
        else n
        for n in cluster.nodes
    )
    return replace(cluster, nodes=nodes)


def plan_at(cluster: Cluster, model: str, batch: int, nm: int, memory: str) -> Plan | None:
    """One VW over every device at exactly ``nm`` (``None``: does not fit)."""
    try:
        plan = plan_cluster(
            cluster,
            model=model,
            batch_size=batch,
            policy="ed",
            num_vws=1,
            optimizer="momentum",
            nm=nm,
            options=PlanOptions(memory=memory, nm_choice="max"),
        )
    except PlanError:
        return None
    return plan if plan.nm == nm else None


def curve(cluster: Cluster, args: argparse.Namespace, batch: int) -> list[dict[str, Any]]:
    """The points of one batch size's curve."""
    full = plan_at(scaled(cluster, args.cap_scale), args.model, batch, args.nm, "keep")
    if full is None:
        raise SystemExit(f"{args.model} batch {batch} does not fit at Nm {args.nm} with keep")
    keep_bytes = sum(s.memory_bytes for s in full.virtual_workers[0].stages)
    rows: list[dict[str, Any]] = []
    for f in FRACTIONS:
        plan = plan_at(scaled(cluster, f * args.cap_scale), args.model, batch, args.nm, "auto")
        if plan is None:
            print(f"  batch {batch}, f {f:.2f}: no placement fits")
            rows.append({"batch": batch, "fraction_allowed": f, "fits": False})
            continue
        stages = plan.virtual_workers[0].stages
        measured = float(train_plan(plan, args.steps)[0].throughput) if args.train else None
        device = sum(s.memory_bytes for s in stages) / keep_bytes
        row = run_row(
            f"batch {batch}, f {f:.2f}, device {device:.2f} of all-keep",
            plan,
            measured,
            batch=batch,
            fraction_allowed=f,
            fits=True,
            device_over_all_keep=device,
            host_MiB=sum(s.host_bytes for s in stages) / 2**20,
            exposed_ms=[round(s.transfer_ms, 3) for s in stages],
            recompute_ms=[round(s.recompute_ms, 3) for s in stages],
        )
        rows.append(row)
        first = next(r for r in rows if r["fits"])
        row["predicted_over_f1"] = plan.predicted.throughput / first["predicted"]
        if measured is not None:
            row["measured_over_f1"] = measured / first["measured"]
    return rows


def main() -> None:
    """One curve per batch size; print and record."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    ap.add_argument("--cluster", type=Path, default=REPO / "examples" / "emulated_cluster.yaml")
    ap.add_argument("--model", default="mlp(hidden=256,depth=8)")
    ap.add_argument("--batches", type=int, nargs="+", default=[16, 32])
    ap.add_argument("--nm", type=int, default=4)
    ap.add_argument(
        "--cap-scale", type=float, default=1.0, help="multiply every emulated cap (bigger models)"
    )
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--host-link", default=None, help="e.g. 300MB/s (default: the cluster's)")
    ap.add_argument(
        "--no-train", dest="train", action="store_false", help="predictions only (no runs)"
    )
    ap.add_argument("--out", type=Path, default=RESULTS, help="the JSON to write")
    args = ap.parse_args()
    cluster = load_cluster(args.cluster)
    if args.host_link:
        cluster = replace(cluster, host_link=Link(parse_bandwidth(args.host_link), 1e-5))
    print(
        f"{args.model}, Nm {args.nm}, host link {cluster.host_link.bandwidth_bps / 1e6:,.0f} MB/s, "
        f"load {os.getloadavg()[0]:.1f}"
    )
    t0 = time.perf_counter()
    out: dict[str, Any] = {
        "cluster": str(args.cluster.relative_to(REPO)),
        "model": args.model,
        "nm": args.nm,
        "host_link_Bps": cluster.host_link.bandwidth_bps,
        "loadavg_before": os.getloadavg(),
        "curves": {str(b): curve(cluster, args, b) for b in args.batches},
    }
    out["wall_s"] = time.perf_counter() - t0
    out["loadavg_after"] = os.getloadavg()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
