"""Simulator scale: 1,024 GPUs (256 VWs x 4 stages) for 50 waves, and growth with cluster size.

Prints wall time, events and microseconds per event for 64, 256 and 1,024 GPUs (all 4-stage
VWs, Nm = 4, D = 0, random heterogeneous stage times, push/pull costs), side by side in one
run, and writes ``benchmarks/results/simulator.json``. Near-linear growth shows as a flat
``us/event`` column and a ``time ratio`` close to the ``events ratio``.

Usage: ``python benchmarks/bench_simulator.py [--waves 50] [--repeat 1]``
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path

from planner.simulator import PipelineSpec, simulate_pipelines

RESULTS = Path(__file__).resolve().parent / "results" / "simulator.json"


def cluster(n_vws: int, n_stages: int, seed: int) -> list[PipelineSpec]:
    """Heterogeneous VWs: each stage 2-6 ms forward, twice that backward, 0.2-1 ms transfers."""
    rng = random.Random(seed)
    specs = []
    for _ in range(n_vws):
        fwd = [rng.uniform(2.0, 6.0) for _ in range(n_stages)]
        specs.append(
            PipelineSpec.from_times(
                fwd,
                [2 * f for f in fwd],
                [0.0] + [rng.uniform(0.2, 1.0) for _ in range(n_stages - 1)],
                [rng.uniform(0.2, 1.0) for _ in range(n_stages - 1)] + [0.0],
                push_ms=rng.uniform(1.0, 4.0),
                pull_ms=rng.uniform(1.0, 4.0),
            )
        )
    return specs


def main() -> None:
    """Run the benchmark and print a table."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--waves", type=int, default=50)
    ap.add_argument("--repeat", type=int, default=1, help="best of N runs per size")
    args = ap.parse_args()
    rows = []
    for gpus in (64, 256, 1024):
        specs = cluster(gpus // 4, 4, seed=gpus)
        best = float("inf")
        for _ in range(args.repeat):
            t0 = time.perf_counter()
            res = simulate_pipelines(specs, nm=4, D=0, waves=args.waves, batch_size=32)
            best = min(best, time.perf_counter() - t0)
        rows.append(
            {
                "gpus": gpus,
                "vws": len(specs),
                "waves": args.waves,
                "events": res.events,
                "seconds": round(best, 3),
                "us_per_event": round(best / res.events * 1e6, 2),
                "throughput_samples_s": round(res.throughput, 1),
                "max_clock_distance": res.max_clock_distance,
            }
        )
    base = rows[0]
    print(
        f"{'GPUs':>6} {'events':>9} {'seconds':>8} {'us/event':>9} {'events ratio':>13} {'time ratio':>11}"
    )
    for r in rows:
        print(
            f"{r['gpus']:>6} {r['events']:>9} {r['seconds']:>8.2f} {r['us_per_event']:>9.2f} "
            f"{r['events'] / base['events']:>13.1f} {r['seconds'] / base['seconds']:>11.1f}"
        )
    big = rows[-1]
    verdict = "under" if big["seconds"] < 60 else "OVER"
    print(f"1,024 GPUs x {args.waves} waves: {big['seconds']:.2f} s ({verdict} the 60 s target)")
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps({"rows": rows}, indent=2) + "\n")


if __name__ == "__main__":
    main()
