"""Whimpy devices made useful: the largest model one VW trains vs the largest DDP trains.

On the emulated cluster (``examples/emulated_cluster.yaml``: V 4 MiB, R 8 MiB, G 2 MiB, Q 2.5 MiB
of emulated memory), grow the built-in MLP (``mlp(hidden=H, depth=L)``, digits-sized input) and
find, by bisection on ``H`` for a fixed depth:

* **HetPipe**: the largest ``H`` for which the planner finds a partition of the model over ONE
  virtual worker made of all four devices (``policy=ed``, one VW, ``Nm >= 1``, the same memory
  model as ``hetpipe plan``: weights, gradients, optimizer state, stashed weights and
  activations of the minibatches in flight, per stage, under each device's cap);
* **DDP** (the AllReduce baseline): the largest ``H`` whose whole-model estimate
  (``planner.baseline.model_memory_bytes``, the rule ``hetpipe run --sync allreduce`` applies) fits the
  biggest single device.

The largest HetPipe model is then **trained** for a few minibatches by the real runtime on the
emulated devices, with the byte accounting on (a stage that exceeds its cap fails the run), and
its per-stage peak bytes are shown against the caps. Figures: parameters of the largest model /
summed caps (HetPipe's promise; the memory of parameters + gradients alone already makes 0.5 the
ceiling for plain SGD), planner memory of the partition / summed caps (limit 1.0), and the
HetPipe / DDP ratio of model sizes.

Run: ``python benchmarks/bench_whimpy.py [--depth 8 --batch 32 --steps 12]`` (about 1-2 min).
Writes ``benchmarks/results/whimpy.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from planner.baseline import device_capacity_bytes, model_memory_bytes  # noqa: E402
from planner.cluster import Cluster, load_cluster  # noqa: E402
from planner.plan import Plan  # noqa: E402
from planner.planner import make_plan  # noqa: E402
from profiler.errors import PlanError, ProfileError  # noqa: E402
from profiler.models import resolve_model  # noqa: E402

RESULTS = REPO / "benchmarks" / "results" / "whimpy.json"
MiB = 2**20


def ref(hidden: int, depth: int) -> str:
    """The sized built-in MLP reference."""
    return f"mlp(hidden={hidden},depth={depth})"


def param_bytes(model: str) -> int:
    """Bytes of the model's parameters (float32)."""
    spec = resolve_model(model, 1)
    return sum(p.numel() * p.element_size() for p in spec.module.parameters())


def hetpipe_plan(cluster: Cluster, model: str, batch: int) -> Plan | None:
    """One VW over every device of ``cluster``, or ``None`` when no partition fits memory."""
    try:
        return make_plan(
            cluster, model=model, batch_size=batch, policy="ed", num_vws=1, optimizer="sgd"
        )
    except PlanError:
        return None


def ddp_fits(cluster: Cluster, model: str, batch: int) -> bool:
    """Whether the whole model fits the biggest single device (the DDP baseline's rule)."""
    need = model_memory_bytes(cluster, model, batch, "sgd")
    return need <= max(device_capacity_bytes(d) for d in cluster.devices)


def largest(fits: Any, lo: int, hi: int, step: int) -> int:
    """Largest multiple of ``step`` in ``[lo, hi)`` with ``fits`` true (``fits(lo)`` must be)."""
    if not fits(lo):
        raise SystemExit(f"even hidden={lo} does not fit; lower --min-hidden")
    while hi - lo > step:
        mid = (lo + hi) // 2 // step * step
        mid = max(mid, lo + step)
        if mid >= hi:
            break
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo


def train_largest(plan: Plan, steps: int) -> dict[str, Any]:
    """Train ``plan`` (one VW) for ``steps`` minibatches with the byte accounting on."""
    from runtime.api import train

    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        result = train(plan.model, plan=plan, steps=steps, out_dir=tmp, return_state=False)
        wall = time.perf_counter() - t0
    stages = []
    for st, sp in zip(result.stages, plan.virtual_workers[0].stages, strict=True):
        cap = sp.capacity_bytes
        stages.append(
            {
                "device": st.device,
                "layers": [sp.first_index, sp.last_index],
                "peak_MiB": st.peak_bytes / MiB,
                "cap_MiB": cap / MiB,
                "peak_over_cap": st.peak_bytes / cap,
            }
        )
    return {
        "steps": result.steps,
        "losses_first_last": [result.losses[0], result.losses[-1]],
        "throughput": result.throughput,
        "wall_s": wall,
        "stages": stages,
    }


def main() -> None:
    """Bisect both limits, train the HetPipe one, print and record the ratios."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    ap.add_argument("--cluster", type=Path, default=REPO / "examples" / "emulated_cluster.yaml")
    ap.add_argument("--depth", type=int, default=8, help="hidden layers of the MLP")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--steps", type=int, default=12, help="minibatches to train the largest one")
    ap.add_argument("--min-hidden", type=int, default=16)
    ap.add_argument("--max-hidden", type=int, default=4096)
    ap.add_argument("--step", type=int, default=16, help="granularity of the hidden width")
    args = ap.parse_args()
    cluster = load_cluster(args.cluster)
    caps = {d.node: device_capacity_bytes(d) for d in cluster.devices}
    total_caps = sum(caps.values())
    t0 = time.perf_counter()

    def het_fits(h: int) -> bool:
        return hetpipe_plan(cluster, ref(h, args.depth), args.batch) is not None

    def ddp_ok(h: int) -> bool:
        try:
            return ddp_fits(cluster, ref(h, args.depth), args.batch)
        except ProfileError:
            return False

    h_het = largest(het_fits, args.min_hidden, args.max_hidden, args.step)
    h_ddp = largest(ddp_ok, args.min_hidden, args.max_hidden, args.step)
    plan = hetpipe_plan(cluster, ref(h_het, args.depth), args.batch)
    if plan is None:  # bisection said it fits
        raise SystemExit("internal error: the largest HetPipe model no longer plans")
    vw = plan.virtual_workers[0]
    planned = sum(s.memory_bytes for s in vw.stages)
    p_het, p_ddp = param_bytes(ref(h_het, args.depth)), param_bytes(ref(h_ddp, args.depth))
    search_s = time.perf_counter() - t0
    run = train_largest(plan, args.steps)
    out = {
        "cluster": str(args.cluster.relative_to(REPO)),
        "caps_MiB": {k: v / MiB for k, v in caps.items()},
        "depth": args.depth,
        "batch": args.batch,
        "hetpipe": {
            "model": ref(h_het, args.depth),
            "param_MiB": p_het / MiB,
            "params_over_summed_caps": p_het / total_caps,
            "planned_memory_over_summed_caps": planned / total_caps,
            "nm": plan.nm,
            "order": [str(vw.gpus[s.gpu]) for s in vw.stages],
        },
        "ddp": {
            "model": ref(h_ddp, args.depth),
            "param_MiB": p_ddp / MiB,
            "params_over_biggest_cap": p_ddp / max(caps.values()),
            "whole_model_MiB": model_memory_bytes(
                cluster, ref(h_ddp, args.depth), args.batch, "sgd"
            )
            / MiB,
        },
        "hetpipe_over_ddp_params": p_het / p_ddp,
        "trained": run,
        "search_s": search_s,
        "loadavg": os.getloadavg(),
    }
    print(f"summed caps {total_caps / MiB:.1f} MiB over {len(caps)} devices; depth {args.depth}")
    print(
        f"HetPipe, one VW: {out['hetpipe']['model']}: {p_het / MiB:.2f} MiB of parameters = "
        f"{p_het / total_caps:.2f} of summed caps (planned memory {planned / total_caps:.2f}), Nm {plan.nm}"
    )
    print(
        f"DDP, biggest device: {out['ddp']['model']}: {p_ddp / MiB:.2f} MiB of parameters "
        f"(whole-model estimate {out['ddp']['whole_model_MiB']:.2f} MiB)"
    )
    print(f"HetPipe / DDP model size: {p_het / p_ddp:.2f}x")
    for s in run["stages"]:
        print(
            f"  trained: {s['device']:>6} peak {s['peak_MiB']:.2f} MiB of cap {s['cap_MiB']:.2f} "
            f"({100 * s['peak_over_cap']:.0f} %)"
        )
    print(
        f"  {run['steps']} minibatches, loss {run['losses_first_last'][0]:.3f} -> {run['losses_first_last'][1]:.3f}"
    )
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
