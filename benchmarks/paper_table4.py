"""Predicted throughput for the paper's Fig. 4 policies and Table 4 configurations, beside the paper.

Paper cluster (``examples/paper_cluster.yaml``), analytic profiles of vgg19 and resnet152 at
batch 32, D = 0. Nm is chosen by simulation (:func:`planner.sim.simulator.best_by_simulation`
over caps 1..32). Table 4: V4 = one VW of the 4 TITAN V; +R, +Q, +G = ED-local with 4 VWs
on the V, R(, Q(, G)) nodes; Horovod = the AllReduce baseline on the same GPUs.
Writes ``benchmarks/results/paper_table4.json`` and prints markdown tables.

Usage: ``python benchmarks/paper_table4.py``
"""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path
from typing import Any

from planner.cluster import Cluster, load_cluster
from planner.planner import make_plan
from planner.sim.simulator import allreduce_for_plan, best_by_simulation
from profiler.analytic import analytic_profile
from profiler.table import Profile

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results" / "paper_table4.json"
TYPES = ("TITAN V", "TITAN RTX", "GeForce RTX 2060", "Quadro P4000")
CAPS = (1, 2, 3, 4, 5, 6, 8, 10, 12, 16, 20, 24, 32)
PAPER_T4: dict[
    str, dict[str, list[Any]]
] = {  # paper Table 4: samples/s (total concurrent minibatches)
    "vgg19": {
        "Horovod": [164, 205, 265, 339],
        "HetPipe": ["300(5)", "530(16)", "572(20)", "606(20)"],
    },
    "resnet152": {
        "Horovod": [233, 353, 415, "X"],
        "HetPipe": ["256(5)", "516(20)", "538(24)", "580(28)"],
    },
}
CONFIGS = (
    ("V4", ("V",)),
    ("+R", ("V", "R")),
    ("+Q", ("V", "R", "Q")),
    ("+G", ("V", "R", "Q", "G")),
)


def sub_cluster(cluster: Cluster, nodes: tuple[str, ...]) -> Cluster:
    """The cluster restricted to ``nodes``."""
    return dataclasses.replace(cluster, nodes=tuple(n for n in cluster.nodes if n.name in nodes))


def predict(
    cluster: Cluster,
    profs: dict[str, Profile],
    model: str,
    policy: str,
    placement: str,
    vws: int | None,
) -> dict[str, Any]:
    """Best-Nm simulated prediction of one configuration plus its AllReduce baseline."""
    used = {n.gpu_type for n in cluster.nodes}
    p = {t: v for t, v in profs.items() if t in used}

    def make(cap: int) -> Any:
        return make_plan(
            cluster,
            p,
            model=model,
            batch_size=32,
            policy=policy,
            nm=cap,
            placement=placement,
            num_vws=vws,
        )

    plan, res = best_by_simulation(make, CAPS, waves=10, profile=next(iter(p.values())))
    ar = allreduce_for_plan(plan, p)
    samples = 10 * plan.nm * 32 * len(plan.virtual_workers)
    return {
        "vws": [v.signature for v in plan.virtual_workers],
        "nm": plan.nm,
        "concurrent": plan.nm * len(plan.virtual_workers),
        "analytic": round(plan.predicted.throughput, 1),
        "simulated": round(res.throughput, 1),
        "cross_node_mb_per_sample": round(res.cross_node_bytes / samples / 1e6, 2),
        "allreduce": round(ar.throughput, 1),
        "allreduce_gpus": ar.gpus,
        "allreduce_cross_node_mb_per_sample": round(
            ar.cross_node_bytes_per_iter / max(1, ar.gpus * 32) / 1e6, 2
        ),
    }


def main() -> None:
    """Compute, print and save the predictions."""
    t0 = time.perf_counter()
    cluster = load_cluster(ROOT / "examples" / "paper_cluster.yaml")
    out: dict[str, Any] = {}
    for model in ("vgg19", "resnet152"):
        profs = {t: analytic_profile(model, 32, t) for t in TYPES}
        pol = {}
        for name, policy, placement in (
            ("NP", "np", "default"),
            ("ED", "ed", "default"),
            ("ED-local", "ed", "local"),
            ("HD", "hd", "default"),
        ):
            pol[name] = predict(cluster, profs, model, policy, placement, None)
        t4 = {}
        for name, nodes in CONFIGS:
            sub = sub_cluster(cluster, nodes)
            if name == "V4":
                t4[name] = predict(sub, profs, model, "np", "default", 1)
            else:
                t4[name] = predict(sub, profs, model, "ed", "local", 4)
        out[model] = {"policies": pol, "table4": t4, "paper_table4": PAPER_T4[model]}
        print(f"\n### {model}: policies on the 16-GPU paper cluster (simulated, best Nm)\n")
        print(
            "| policy | VWs | Nm | analytic | simulated | cross-node MB/sample | AllReduce (GPUs) | AllReduce MB/sample |"
        )
        print("| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |")
        for name, r in pol.items():
            print(
                f"| {name} | {' '.join(r['vws'])} | {r['nm']} | {r['analytic']} | {r['simulated']} | "
                f"{r['cross_node_mb_per_sample']} | {r['allreduce']} ({r['allreduce_gpus']}) | {r['allreduce_cross_node_mb_per_sample']} |"
            )
        print(f"\n### {model}: Table 4 (samples/s; total concurrent minibatches in parentheses)\n")
        print("| | V4 | +R | +Q | +G |")
        print("| --- | ---: | ---: | ---: | ---: |")
        paper = PAPER_T4[model]
        print("| paper Horovod | " + " | ".join(str(x) for x in paper["Horovod"]) + " |")
        print(
            "| predicted AllReduce | "
            + " | ".join(
                f"{t4[c]['allreduce']} ({t4[c]['allreduce_gpus']} GPUs)" for c, _ in CONFIGS
            )
            + " |"
        )
        print("| paper HetPipe | " + " | ".join(str(x) for x in paper["HetPipe"]) + " |")
        print(
            "| predicted HetPipe | "
            + " | ".join(f"{t4[c]['simulated']}({t4[c]['concurrent']})" for c, _ in CONFIGS)
            + " |"
        )
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(out, indent=2) + "\n")
    print(f"\n({time.perf_counter() - t0:.0f} s; written to {RESULTS.relative_to(ROOT)})")


if __name__ == "__main__":
    main()
