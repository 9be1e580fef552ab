"""The ``links: {scale: F}`` that gives an emulated cluster the paper's share of communication.

An emulated device computes thousands of times slower than the GPU it stands for, while its
links, written as the real ones, would cost what they cost on the real cluster: communication
would be almost free next to computation, and the AllReduce baseline would lose nothing to its
all-reduce, unlike Horovod in the paper (Sec. 8.4). The factor keeps the real proportion:

1. **The real share.** Paper Table 4 gives Horovod's measured throughput on 8 GPUs (4 TITAN V +
   4 TITAN RTX, two nodes over 56 Gbit/s InfiniBand): 353 samples/s for ResNet-152 and 205 for
   VGG-19 at batch 32. The cost model's compute-only iteration for the same GPUs (analytic
   profiles, the slowest GPU's forward + backward) is ``c``; the measured iteration is
   ``8 x 32 / throughput``; the rest, ``1 - c / measured``, is what Horovod lost to
   communication: 0.44 (ResNet-152) and 0.54 (VGG-19).
2. **The emulated share.** The baseline's plan on the emulated cluster (``hetpipe plan
   CLUSTER --sync allreduce``, links unscaled) has an all-reduce of ``a`` ms per iteration of
   ``c' + a`` ms; a scale ``F`` multiplies every transfer time (``Link.scaled``), so the share
   is ``F a / (c' + F a)``, and ``F = share / (1 - share) x c' / a`` gives the real one.

Run: ``python benchmarks/link_scale.py benchmarks/tta_cluster_cnn.yaml --model
benchmarks.tta_tasks:digits_cnn --batch-size 32`` (about 15 s: it measures the model's CPU
profile, as ``hetpipe plan`` does). The time-to-accuracy clusters carry the result.
"""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
PAPER_CLUSTER = REPO / "examples" / "paper_cluster.yaml"
# paper Table 4, Horovod on the TITAN V and TITAN RTX nodes (8 GPUs, batch 32), samples/s
PAPER_HOROVOD_8 = {"resnet152": 353.0, "vgg19": 205.0}


def paper_share(model: str) -> float:
    """Fraction of Horovod's measured iteration (Table 4, 8 GPUs) not explained by compute."""
    from planner.cluster import parse_cluster
    from planner.planner import make_plan
    from planner.sim.simulator import allreduce_for_plan
    from profiler.analytic import analytic_profile

    doc = yaml.safe_load(PAPER_CLUSTER.read_text(encoding="utf-8"))
    doc["nodes"] = [n for n in doc["nodes"] if n["gpu"] in ("TITAN V", "TITAN RTX")]
    cluster = parse_cluster(doc, str(PAPER_CLUSTER))
    profiles = {n.gpu_type: analytic_profile(model, 32, n.gpu_type) for n in cluster.nodes}
    plan = make_plan(cluster, profiles, model=model, batch_size=32, policy="ed", nm=1)
    ar = allreduce_for_plan(plan, profiles)
    compute_ms = ar.iteration_ms - ar.allreduce_ms
    measured_ms = ar.gpus * 32 / PAPER_HOROVOD_8[model] * 1e3
    return 1.0 - compute_ms / measured_ms


def scale_for(
    cluster_path: Path, model: str, batch: int, share: float
) -> tuple[float, float, float]:
    """``(F, compute ms, all-reduce ms at F = 1)`` for the baseline on ``cluster_path``."""
    from hetpipe.planning import profiles_for
    from planner.baseline import allreduce_plan
    from planner.cluster import load_cluster
    from planner.sim.simulator import allreduce_for_plan

    cluster = load_cluster(cluster_path)
    cluster = dataclasses.replace(cluster, link_scale=1.0)
    plan = allreduce_plan(cluster, model, batch, profiles=profiles_for(cluster, [], model, batch))
    ar = allreduce_for_plan(plan)
    compute_ms = ar.iteration_ms - ar.allreduce_ms
    return share / (1.0 - share) * compute_ms / ar.allreduce_ms, compute_ms, ar.allreduce_ms


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("cluster", type=Path)
    ap.add_argument("--model", required=True)
    ap.add_argument("--batch-size", type=int, required=True)
    ap.add_argument("--paper-model", choices=sorted(PAPER_HOROVOD_8), default="resnet152")
    args = ap.parse_args()
    shares = {m: paper_share(m) for m in PAPER_HOROVOD_8}
    for m, s in shares.items():
        print(f"paper Table 4, Horovod on 8 GPUs, {m}: {s:.0%} of the iteration is not compute")
    share = shares[args.paper_model]
    f, compute_ms, ar_ms = scale_for(args.cluster, args.model, args.batch_size, share)
    print(
        f"{args.cluster}: the baseline computes {compute_ms:.1f} ms and all-reduces "
        f"{ar_ms:.2f} ms per iteration with links as written; links: {{scale: {f:.0f}}} makes "
        f"the all-reduce {share:.0%} of it, as {args.paper_model}'s in the paper"
    )


if __name__ == "__main__":
    main()
