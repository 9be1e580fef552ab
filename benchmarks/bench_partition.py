"""Partitioner speed: the exact search, PuLP MILP (HiGHS and CBC) and the per-order DP; planning time.

Run: ``python benchmarks/bench_partition.py`` (from the repo root; ``--paper`` re-runs only the
paper-cluster part, ``--scaling`` only the exact search's scaling sweep, writing
``benchmarks/results/partition_scaling.json``). Prints a table and writes
``benchmarks/results/partition.json``. Instances: synthetic random layer DAGs (tests/planner/synth.py)
on VWs of the paper cluster: homogeneous (NP-like, no order to choose), 2 types on 2 nodes (HD-like)
and one GPU per node (ED-like, the hardest order choice). The DP column is the exact optimum over
every distinct GPU order (DP per order); "same" says whether the MILP matched it within 1e-6.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from planner.cluster import Cluster, Device, load_cluster, parse_cluster  # noqa: E402
from planner.costmodel import CostModel  # noqa: E402
from planner.partition.dp import partition_dp, partition_dp_best_order  # noqa: E402
from planner.partition.milp import available_solvers, partition_milp  # noqa: E402
from planner.partition.search import partition_exact  # noqa: E402
from planner.planner import PlanOptions, make_plan  # noqa: E402
from profiler.errors import PlanError  # noqa: E402
from tests.planner.synth import synthetic_profiles  # noqa: E402

TIME_LIMIT_S = 30.0


def _vws(devs: tuple[Device, ...], k: int) -> dict[str, list[Device]]:
    v, r, g, q = devs[0:4], devs[4:8], devs[8:12], devs[12:16]
    if k == 4:
        return {"VVVV": list(v), "VVQQ": [*v[:2], *q[:2]], "VRGQ": [v[0], r[0], g[0], q[0]]}
    return {
        "VVVVRRRR": [*v, *r],
        "VVVVQQQQ": [*v, *q],
        "VVRRGGQQ": [*v[:2], *r[:2], *g[:2], *q[:2]],
    }


def _time(fn: object) -> tuple[float | None, float | None, str]:
    t = time.perf_counter()
    try:
        part = fn()  # type: ignore[operator]
    except PlanError as exc:
        return None, None, str(exc)[:100]
    return time.perf_counter() - t, part.objective_ms, ""


def bench_partitions() -> list[dict[str, object]]:
    """Per instance: DP for the given order; MILP with that order fixed (with / without the DP
    bound); DP over every distinct order; MILP choosing the order (joint)."""
    cluster = load_cluster(REPO / "examples" / "paper_cluster.yaml")
    rows: list[dict[str, object]] = []
    solvers = available_solvers()
    for layers, k in ((150, 4), (150, 8), (300, 8)):
        cm = CostModel(synthetic_profiles(layers, seed=1), cluster.link)
        for name, gpus in _vws(cluster.devices, k).items():
            row: dict[str, object] = {"layers": layers, "gpus": k, "vw": name}
            row["dp_fixed_s"], fixed_opt, _ = _time(lambda g=gpus, c=cm: partition_dp(c, g, nm=2))
            for solver in solvers:
                for bound in (True, False):
                    key = f"milp_fixed_{solver}{'' if bound else '_nobound'}"
                    row[key + "_s"], val, err = _time(
                        lambda g=gpus, s=solver, b=bound, c=cm: partition_milp(
                            c,
                            g,
                            nm=2,
                            solver=s,
                            fixed_order=True,
                            use_bound=b,
                            time_limit_s=TIME_LIMIT_S,
                        )
                    )
                    row[key + "_ok"] = (
                        val is not None
                        and fixed_opt is not None
                        and abs(val - fixed_opt) <= 1e-6 * fixed_opt
                    )
            row["dp_orders_s"], opt, _ = _time(
                lambda g=gpus, c=cm: partition_dp_best_order(c, g, nm=2)
            )
            row["opt_ms"] = opt
            for solver in solvers:
                key = f"milp_joint_{solver}"
                row[key + "_s"], val, err = _time(
                    lambda g=gpus, s=solver, c=cm: partition_milp(
                        c, g, nm=2, solver=s, time_limit_s=TIME_LIMIT_S
                    )
                )
                row[key + "_ok"] = (
                    val is not None and opt is not None and abs(val - opt) <= 1e-6 * opt
                )
                if err:
                    row[key + "_error"] = err
            rows.append(row)
            print(_fmt(row), flush=True)
    return rows


def _cell(row: dict[str, object], key: str) -> str:
    s = row.get(key + "_s")
    if s is None:
        return f"{'>' + str(int(TIME_LIMIT_S)):>8}"
    mark = "" if row.get(key + "_ok", True) else "!"
    return f"{s:7.3f}{mark or ' '}"


HEADER = (
    "layers x GPUs  VW        | DP fixed | MILP fixed order: highs  (no DP bound)  cbc  (no DP bound) "
    "| DP all orders | MILP joint: highs   cbc"
)


def _fmt(row: dict[str, object]) -> str:
    cells = [f"{row['layers']:>6} x {row['gpus']}  {row['vw']:<9}|", _cell(row, "dp_fixed") + " |"]
    for solver in ("highs", "cbc"):
        cells += [_cell(row, f"milp_fixed_{solver}"), _cell(row, f"milp_fixed_{solver}_nobound")]
    cells += ["|", _cell(row, "dp_orders"), "|"]
    cells += [_cell(row, f"milp_joint_{solver}") for solver in ("highs", "cbc")]
    return " ".join(cells)


def bench_paper_cluster() -> list[dict[str, object]]:
    cluster = load_cluster(REPO / "examples" / "paper_cluster.yaml")
    rows: list[dict[str, object]] = []
    for model in ("resnet152", "vgg19"):
        from planner.profiles import resolve_profiles

        t = time.perf_counter()
        profiles = [resolve_profiles(cluster, None, model, 32)[0][t_] for t_ in ("TITAN V",)]
        prof_s = time.perf_counter() - t
        for choice in ("max", "best"):
            t_all = time.perf_counter()
            for policy, placement in (
                ("np", "default"),
                ("ed", "default"),
                ("ed", "local"),
                ("hd", "default"),
            ):
                t = time.perf_counter()
                plan = make_plan(
                    cluster,
                    profiles,
                    model=model,
                    batch_size=32,
                    policy=policy,
                    placement=placement,
                    options=PlanOptions(nm_choice=choice),
                )
                rows.append(
                    {
                        "model": model,
                        "nm_choice": choice,
                        "policy": f"{policy}-{placement}" if placement == "local" else policy,
                        "plan_s": time.perf_counter() - t,
                        "nm": plan.nm,
                        "vws": [vw.signature for vw in plan.virtual_workers],
                        "throughput": plan.predicted.throughput,
                        "allreduce": plan.predicted.allreduce_throughput,
                        "allreduce_gpus": plan.predicted.allreduce_gpus,
                    }
                )
                r = rows[-1]
                print(
                    f"{model:<10} Nm {choice:<4} {r['policy']:<9} {r['plan_s']:6.2f} s  Nm {r['nm']:>3}  "
                    f"{'/'.join(r['vws'])}  {r['throughput']:8.1f} samples/s  "
                    f"(AllReduce {r['allreduce']:.1f} on {r['allreduce_gpus']} GPUs)",
                    flush=True,
                )
            print(
                f"{model} (Nm {choice}): every policy planned in {time.perf_counter() - t_all:.2f} s "
                f"(+ {prof_s:.2f} s analytic profiling, once)"
            )
    return rows


SWEEP_TYPES = ("A100", "V100", "TITAN RTX", "T4", "GeForce RTX 2060", "K80")


def _sweep_vw(cluster: Cluster, gpus: int, types: int) -> list[Device]:
    """``gpus`` GPUs dealt round-robin over the first ``types`` types (one node per type)."""
    pools = {t: [d for d in cluster.devices if d.type == t] for t in SWEEP_TYPES[:types]}
    return [pools[SWEEP_TYPES[i % types]][i // types] for i in range(gpus)]


def bench_scaling() -> list[dict[str, object]]:
    """Exact search (every GPU order, memory on, Nm = 2) vs layers, GPUs per VW and GPU types.

    Each point is the best of 2 runs, in CPU seconds of this process (``cpu_s``: robust to the
    shared machine's load) and wall seconds; ``proven`` says the search finished (gap 0, no time
    limit).
    """
    cluster = parse_cluster(
        {
            "name": "sweep",
            "nodes": [{"name": f"n{i}", "gpu": t, "count": 16} for i, t in enumerate(SWEEP_TYPES)],
        }
    )
    points = [(n, 8, 4) for n in (50, 150, 300, 600, 1000, 1500)]
    points += [(300, k, min(4, k)) for k in (2, 4, 12, 16)]
    points += [(300, 16, t) for t in (1, 2, 3, 5, 6)]
    rows: list[dict[str, object]] = []
    cms: dict[int, CostModel] = {}
    for layers, k, types in points:
        if layers not in cms:
            profs = synthetic_profiles(layers, SWEEP_TYPES, seed=1, act_mib=8.0, param_mib=2.0)
            cms[layers] = CostModel(profs, cluster.link)
        gpus = _sweep_vw(cluster, k, types)
        best, cpu, part = float("inf"), float("inf"), None
        for _ in range(2):
            t, c = time.perf_counter(), time.process_time()
            part = partition_exact(cms[layers], gpus, nm=2, time_limit_s=TIME_LIMIT_S)
            best, cpu = min(best, time.perf_counter() - t), min(cpu, time.process_time() - c)
        if part is None:
            continue
        row = {
            "layers": layers,
            "gpus": k,
            "types": types,
            "cpu_s": cpu,
            "solve_s": best,
            "bottleneck_ms": part.bottleneck_ms,
            "proven": part.solver == "dp" and part.gap == 0.0,
            "order": "".join(d.letter for d in part.gpus),
        }
        rows.append(row)
        print(
            f"{layers:>6} layers  {k:>2} GPUs  {types} types  {cpu:7.3f} CPU s  {best:7.3f} s wall  "
            f"{'proven optimal' if row['proven'] else 'NOT PROVEN'}  {row['order']}",
            flush=True,
        )
    return rows


def main() -> None:
    out = REPO / "benchmarks" / "results" / "partition.json"
    if "--scaling" in sys.argv:
        print(f"load average {os.getloadavg()[0]:.2f} (2 cores)")
        res = {"load_average": os.getloadavg()[0], "sweep": bench_scaling()}
        path = out.with_name("partition_scaling.json")
        path.write_text(json.dumps(res, indent=2))
        print(f"wrote {path}")
        return
    if "--paper" in sys.argv:  # only the paper-cluster part; keep the stored partition figures
        old = json.loads(out.read_text()) if out.exists() else {}
        print("paper cluster, batch 32, analytic profiles for every GPU type")
        old["paper_cluster"] = bench_paper_cluster()
        out.write_text(json.dumps(old, indent=2))
        print(f"wrote {out}")
        return
    print(
        "partition solve times, seconds (synthetic random DAG, Nm = 2, memory limits on; '!' = optimum differs)"
    )
    print(HEADER)
    parts = bench_partitions()
    print("\npaper cluster, batch 32, analytic profiles for every GPU type")
    cluster = bench_paper_cluster()
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"partition": parts, "paper_cluster": cluster}, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
