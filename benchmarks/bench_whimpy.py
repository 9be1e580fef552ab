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

Both with ``--memory keep`` (everything on the devices) and ``--memory auto`` (the memory
manager may offload stashed weight versions, activations, optimizer state and gradients to host
memory or recompute activations, ``docs/memory.md``; the limit is then the caps plus host memory).

The largest HetPipe model is then **trained** for a few minibatches by the real runtime on the
emulated devices, with the byte accounting on (a stage that exceeds its cap fails the run), and
its per-stage peak bytes are shown against the caps. Figures: parameters of the largest model /
summed caps (HetPipe's promise; the memory of parameters + gradients alone already makes 0.5 the
ceiling for plain SGD), planner memory of the partition / summed caps (limit 1.0), and the
HetPipe / DDP ratio of model sizes.

Equal device memory: HD (``policy=hd``) of ``--hd-model`` at ``--hd-batch`` on the same
devices with ``--memory keep`` and ``auto``: the Nm each reaches and measured vs predicted
samples/s, the runs alternating in one process (``--reps``).

Run: ``python benchmarks/bench_whimpy.py [--depth 8 --batch 32 --steps 12]`` (about 3-4 min).
Writes ``benchmarks/results/whimpy.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.plan_runs import run_row, train_plan  # noqa: E402
from hetpipe.planning import plan as plan_cluster  # noqa: E402
from hetpipe.planning import profiles_for  # noqa: E402
from planner.baseline import device_capacity_bytes, model_memory_bytes  # noqa: E402
from planner.cluster import Cluster, load_cluster  # noqa: E402
from planner.plan import Plan  # noqa: E402
from planner.planner import PlanOptions  # noqa: E402
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


def hetpipe_plan(cluster: Cluster, model: str, batch: int, memory: str = "keep") -> Plan | None:
    """One VW over every device of ``cluster``, or ``None`` when no partition fits memory.

    ``memory``: ``keep`` (everything on the devices) or ``auto`` (the memory manager may
    offload to host memory or recompute, ``docs/memory.md``)."""
    try:
        return plan_cluster(
            cluster,
            model=model,
            batch_size=batch,
            policy="ed",
            num_vws=1,
            optimizer="sgd",
            options=PlanOptions(memory=memory),
        )
    except PlanError:
        return None


def ddp_fits(cluster: Cluster, model: str, batch: int) -> bool:
    """Whether the whole model fits the biggest single device (the DDP baseline's rule)."""
    need = model_memory_bytes(cluster, model, batch, "sgd", profiles_for(cluster, [], model, batch))
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
    result, wall = train_plan(plan, steps)
    stages = []
    for st, sp in zip(result.vws[0].stages, plan.virtual_workers[0].stages, strict=True):
        cap = sp.capacity_bytes
        stages.append(
            {
                "device": st.device,
                "memory": sp.memory,
                "planned_host_MiB": sp.host_bytes / MiB,
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


def largest_model(cluster: Cluster, args: argparse.Namespace, memory: str) -> dict[str, Any]:
    """Bisect the largest MLP one VW plans with ``memory``, then train it for real."""
    total_caps = sum(device_capacity_bytes(d) for d in cluster.devices)
    t0 = time.perf_counter()

    def fits(h: int) -> bool:
        return hetpipe_plan(cluster, ref(h, args.depth), args.batch, memory) is not None

    h = largest(fits, args.min_hidden, args.max_hidden, args.step)
    plan = hetpipe_plan(cluster, ref(h, args.depth), args.batch, memory)
    if plan is None:  # bisection said it fits
        raise SystemExit("internal error: the largest HetPipe model no longer plans")
    vw = plan.virtual_workers[0]
    planned = sum(s.memory_bytes for s in vw.stages)
    p = param_bytes(ref(h, args.depth))
    search_s = time.perf_counter() - t0
    return {
        "memory": memory,
        "model": ref(h, args.depth),
        "param_MiB": p / MiB,
        "params_over_summed_caps": p / total_caps,
        "planned_memory_over_summed_caps": planned / total_caps,
        "planned_host_MiB": sum(s.host_bytes for s in vw.stages) / MiB,
        "nm": plan.nm,
        "order": [str(vw.gpus[s.gpu]) for s in vw.stages],
        "search_s": search_s,
        "trained": train_largest(plan, args.steps),
    }


def equal_memory(cluster: Cluster, args: argparse.Namespace) -> list[dict[str, Any]]:
    """HD on the same devices with and without the memory manager: Nm, measured vs predicted.

    Runs alternate (keep, auto, keep, auto) in one process so that the machine's load hits both.
    """
    plans = {
        memory: plan_cluster(
            cluster,
            model=args.hd_model,
            batch_size=args.hd_batch,
            policy="hd",
            options=PlanOptions(memory=memory),
        )
        for memory in ("keep", "auto")
    }
    rows: list[dict[str, Any]] = []
    for rep in range(args.reps):
        for memory, plan in plans.items():
            res, _ = train_plan(plan, args.hd_steps)
            signatures = [vw.signature for vw in plan.virtual_workers]
            rows.append(
                run_row(
                    f"HD {memory:>4}",
                    plan,
                    res.throughput,
                    memory=memory,
                    rep=rep,
                    signatures=signatures,
                )
            )
    return rows


def main() -> None:
    """Bisect the limits with and without the memory manager, train them, compare at equal memory."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    ap.add_argument("--cluster", type=Path, default=REPO / "examples" / "emulated_cluster.yaml")
    ap.add_argument("--depth", type=int, default=8, help="hidden layers of the MLP")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--steps", type=int, default=12, help="minibatches to train the largest one")
    ap.add_argument("--min-hidden", type=int, default=16)
    ap.add_argument("--max-hidden", type=int, default=4096)
    ap.add_argument("--step", type=int, default=4, help="granularity of the hidden width")
    ap.add_argument("--hd-model", default="mlp(hidden=384,depth=4)", help="equal-memory model")
    ap.add_argument("--hd-batch", type=int, default=128)
    ap.add_argument("--hd-steps", type=int, default=60, help="minibatches per VW, equal memory")
    ap.add_argument("--reps", type=int, default=1, help="alternating repetitions, equal memory")
    ap.add_argument("--skip-equal-memory", action="store_true")
    ap.add_argument("--equal-memory-only", action="store_true", help="only the HD comparison")
    ap.add_argument("--out", type=Path, default=RESULTS, help="the JSON to write")
    args = ap.parse_args()
    cluster = load_cluster(args.cluster)
    caps = {d.node: device_capacity_bytes(d) for d in cluster.devices}
    total_caps = sum(caps.values())
    load_before = os.getloadavg()
    if args.equal_memory_only:
        print(f"equal device memory: HD, {args.hd_model}, batch {args.hd_batch}")
        rows = equal_memory(cluster, args)
        doc = {
            "equal_memory": rows,
            "loadavg_before": load_before,
            "loadavg_after": os.getloadavg(),
        }
        args.out.write_text(json.dumps(doc, indent=1) + "\n")
        print(f"wrote {args.out}")
        return
    het = {m: largest_model(cluster, args, m) for m in ("keep", "auto")}

    def ddp_ok(h: int) -> bool:
        try:
            return ddp_fits(cluster, ref(h, args.depth), args.batch)
        except ProfileError:
            return False

    h_ddp = largest(ddp_ok, args.min_hidden, args.max_hidden, args.step)
    p_ddp = param_bytes(ref(h_ddp, args.depth))
    out: dict[str, Any] = {
        "cluster": str(args.cluster.relative_to(REPO)),
        "caps_MiB": {k: v / MiB for k, v in caps.items()},
        "depth": args.depth,
        "batch": args.batch,
        "hetpipe": het["keep"],
        "hetpipe_memory_manager": het["auto"],
        "ddp": {
            "model": ref(h_ddp, args.depth),
            "param_MiB": p_ddp / MiB,
            "params_over_biggest_cap": p_ddp / max(caps.values()),
            "whole_model_MiB": model_memory_bytes(
                cluster,
                ref(h_ddp, args.depth),
                args.batch,
                "sgd",
                profiles_for(cluster, [], ref(h_ddp, args.depth), args.batch),
            )
            / MiB,
        },
        "hetpipe_over_ddp_params": het["keep"]["param_MiB"] / (p_ddp / MiB),
        "managed_over_ddp_params": het["auto"]["param_MiB"] / (p_ddp / MiB),
        "loadavg_before": load_before,
    }
    print(f"summed caps {total_caps / MiB:.1f} MiB over {len(caps)} devices; depth {args.depth}")
    for m, r in het.items():
        print(
            f"HetPipe, one VW, --memory {m}: {r['model']}: {r['param_MiB']:.2f} MiB of parameters = "
            f"{r['params_over_summed_caps']:.2f} of summed caps (planned device memory "
            f"{r['planned_memory_over_summed_caps']:.2f}, host {r['planned_host_MiB']:.2f} MiB), Nm {r['nm']}"
        )
        for s in r["trained"]["stages"]:
            print(
                f"  trained: {s['device']:>6} peak {s['peak_MiB']:.2f} MiB of cap {s['cap_MiB']:.2f} "
                f"({100 * s['peak_over_cap']:.0f} %) {s['memory']}"
            )
        first, last = r["trained"]["losses_first_last"]
        print(f"  {r['trained']['steps']} minibatches, loss {first} -> {last}")
    print(
        f"DDP, biggest device: {out['ddp']['model']}: {p_ddp / MiB:.2f} MiB of parameters "
        f"(whole-model estimate {out['ddp']['whole_model_MiB']:.2f} MiB)"
    )
    print(
        f"model size vs DDP: HetPipe {out['hetpipe_over_ddp_params']:.2f}x, with the memory "
        f"manager {out['managed_over_ddp_params']:.2f}x"
    )
    if not args.skip_equal_memory:
        print(f"equal device memory: HD, {args.hd_model}, batch {args.hd_batch}")
        out["equal_memory"] = equal_memory(cluster, args)
    out["loadavg_after"] = os.getloadavg()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
