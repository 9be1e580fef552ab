"""Simulator scale: up to 10,240 GPUs (2,560 VWs x 4 stages) for 50 waves.

Prints wall and CPU seconds, events and CPU microseconds per event for 64 ... 10,240 GPUs (all
4-stage VWs, Nm = 4, D = 0, random heterogeneous stage times, push/pull costs), one after the
other in one run, with the load average before and after, and writes
``benchmarks/results/simulator.json``. Linear growth shows as a flat ``cpu us/event`` column;
CPU seconds are given beside wall seconds because on a shared machine the wall time mostly
measures the other jobs. The target (issue 15): 10,000 GPUs x 50 waves in under 60 s.

Usage: ``python benchmarks/bench_simulator.py [--waves 50] [--repeat 1] [--gpus 64 256 ...]``
"""

from __future__ import annotations

import argparse
import json
import os
import random
import time
from pathlib import Path

from planner.sim.engine import simulate_pipelines
from planner.sim.types import PipelineSpec

RESULTS = Path(__file__).resolve().parent / "results" / "simulator.json"
SIZES = (64, 256, 1024, 2560, 5120, 10240)


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


def measure(gpus: int, waves: int, repeat: int) -> dict[str, float | int]:
    """Best-of-``repeat`` wall and CPU time of one size."""
    specs = cluster(gpus // 4, 4, seed=gpus)
    wall = cpu = float("inf")
    for _ in range(repeat):
        t0, c0 = time.perf_counter(), time.process_time()
        res = simulate_pipelines(specs, nm=4, D=0, waves=waves, batch_size=32)
        wall = min(wall, time.perf_counter() - t0)
        cpu = min(cpu, time.process_time() - c0)
    return {
        "gpus": gpus,
        "vws": len(specs),
        "waves": waves,
        "events": res.events,
        "seconds": round(wall, 3),
        "cpu_seconds": round(cpu, 3),
        "cpu_us_per_event": round(cpu / res.events * 1e6, 2),
        "throughput_samples_s": round(res.throughput, 1),
        "max_clock_distance": res.max_clock_distance,
    }


def main() -> None:
    """Run the benchmark and print a table."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--waves", type=int, default=50)
    ap.add_argument("--repeat", type=int, default=1, help="best of N runs per size")
    ap.add_argument(
        "--gpus", type=int, nargs="+", default=list(SIZES), help="sizes (x4 GPUs per VW)"
    )
    args = ap.parse_args()
    load_before = os.getloadavg()[0]
    rows = [measure(g, args.waves, args.repeat) for g in args.gpus]
    load_after = os.getloadavg()[0]
    base = rows[0]
    print(
        f"{'GPUs':>6} {'events':>9} {'wall s':>8} {'cpu s':>7} {'cpu us/event':>13} "
        f"{'events ratio':>13} {'cpu ratio':>10}"
    )
    for r in rows:
        print(
            f"{r['gpus']:>6} {r['events']:>9} {r['seconds']:>8.2f} {r['cpu_seconds']:>7.2f} "
            f"{r['cpu_us_per_event']:>13.2f} {r['events'] / base['events']:>13.1f} "
            f"{r['cpu_seconds'] / base['cpu_seconds']:>10.1f}"
        )
    big = rows[-1]
    verdict = "under" if big["seconds"] < 60 else "OVER"
    print(
        f"{big['gpus']:,} GPUs x {args.waves} waves: {big['seconds']:.1f} s wall, "
        f"{big['cpu_seconds']:.1f} s CPU ({verdict} the 60 s target); "
        f"load average {load_before:.1f} before, {load_after:.1f} after"
    )
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(
        json.dumps(
            {"load_average": [round(load_before, 2), round(load_after, 2)], "rows": rows},
            indent=2,
        )
        + "\n"
    )


if __name__ == "__main__":
    main()
