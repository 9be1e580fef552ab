"""Profiler honesty and analytic-model error, measured side by side on this CPU.

1. **Honesty**: for every built-in model, the sum of the per-layer forward + backward times of a
   measured profile vs a measured whole-model training step (forward, loss, backward) with the
   same clock, and the profiling wall time. Both clocks are reported: ``cpu`` (this thread's
   CPU time; immune to preemption on a shared machine) and ``wall`` (``time.perf_counter``).
2. **Analytic error**: the roofline model calibrated on some measured CPU profiles predicts the
   others (pairwise, and leave-one-out: calibrate on all but one); error of the total time and
   time-weighted per-layer error ``sum |pred - meas| / sum meas`` (loss/output row excluded).
3. **Analytic build time** of VGG-19 and ResNet-152 at batch 32 (meta tensors, no compute).

Writes ``benchmarks/results/profiler.json``. One intra-op thread throughout.

Usage: ``python benchmarks/bench_profiler.py [--models mlp:64 resnet:16 ...] [--repeats 3]
[--big]`` (``--big`` adds ResNet-152 at batch 32, several minutes on one core).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from profiler.analytic import analytic_profile, calibrate, layer_costs
from profiler.measure import measure_profile, step_time_ms
from profiler.models import resolve_model
from profiler.table import Profile

RESULTS = Path(__file__).resolve().parent / "results" / "profiler.json"
DEFAULT_MODELS = ["mlp:64", "resnet:16", "transformer:16", "vgg19:2", "resnet152:2"]


def honesty(model: str, batch: int, clock: str, repeats: int) -> tuple[dict[str, Any], Profile]:
    """Per-layer sum vs whole step for one model with one clock.

    The whole step is timed before and after profiling; the ratio uses the second median, as
    the first steps of a process with new shapes are slowed by allocator and kernel warm-up
    (the first median is reported too).
    """
    cold = step_time_ms(resolve_model(model, batch), repeats=repeats, warmup=2, clock=clock)
    t0 = time.perf_counter()
    prof = measure_profile(resolve_model(model, batch), repeats=repeats, warmup=2, clock=clock)
    wall_s = time.perf_counter() - t0
    step = step_time_ms(resolve_model(model, batch), repeats=repeats, warmup=2, clock=clock)
    layer_sum = float(prof.table[["fwd_ms", "bwd_ms"]].sum().sum())
    row = {
        "model": model,
        "batch": batch,
        "clock": clock,
        "layers": len(prof.table),
        "layer_sum_ms": layer_sum,
        "step_ms": step,
        "first_step_ms": cold,
        "ratio": layer_sum / step,
        "profiling_wall_s": wall_s,
    }
    return row, prof


def errors(pred: Profile, meas: Profile) -> tuple[float, float]:
    """(total-time error, time-weighted per-layer error) of ``pred`` vs ``meas``, fractions."""
    mask = ~meas.table["op"].isin(["placeholder", "output"]).to_numpy()
    p = pred.table[["fwd_ms", "bwd_ms"]].to_numpy()[mask]
    m = meas.table[["fwd_ms", "bwd_ms"]].to_numpy()[mask]
    return float(p.sum() / m.sum() - 1), float(np.abs(p - m).sum() / m.sum())


def analytic_errors(measured: dict[str, Profile]) -> list[dict[str, Any]]:
    """Pairwise and leave-one-out prediction errors of the calibrated roofline."""
    rows = []
    names = list(measured)
    for target in names:
        meas = measured[target]
        others = [s for s in names if s != target]
        sources = [[s] for s in others] + ([others] if len(others) > 1 else [])
        for src in sources:
            cal = calibrate(*(measured[s] for s in src))
            pred = analytic_profile(meas.meta.model, meas.meta.batch_size, "cpu", cal)
            total, per_layer = errors(pred, meas)
            rows.append(
                {
                    "target": target,
                    "calibrated_on": "+".join(src),
                    "total_error": total,
                    "per_layer_error": per_layer,
                }
            )
    return rows


def main() -> None:
    """Run the three measurements, print them and write the JSON results."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=DEFAULT_MODELS, help="model:batch pairs")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--clocks", nargs="+", default=["cpu", "wall"])
    parser.add_argument("--big", action="store_true", help="add resnet152 at batch 32")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    torch.set_num_threads(1)
    models = [(m.split(":")[0], int(m.split(":")[1])) for m in args.models]
    if args.big:
        models.append(("resnet152", 32))

    print("== 1. per-layer sum vs whole training step (CPU, 1 thread)")
    print(
        f"{'model':>12} {'batch':>5} {'clock':>5} {'layers':>6} {'sum ms':>10} {'step ms':>10} "
        f"{'ratio':>6} {'profile s':>9} {'1st step ms':>11}"
    )
    honest = []
    measured: dict[str, Profile] = {}
    for model, batch in models:
        for clock in args.clocks:
            row, prof = honesty(model, batch, clock, args.repeats)
            honest.append(row)
            if clock == "cpu" and not (args.big and (model, batch) == models[-1]):
                measured[f"{model}:{batch}"] = prof
            print(
                f"{model:>12} {batch:>5} {clock:>5} {row['layers']:>6} {row['layer_sum_ms']:>10.2f} "
                f"{row['step_ms']:>10.2f} {row['ratio']:>6.3f} {row['profiling_wall_s']:>9.1f} "
                f"{row['first_step_ms']:>11.2f}",
                flush=True,
            )

    print("\n== 2. analytic (roofline) error on CPU: calibrate on some models, predict another")
    print(f"{'target':>16} {'calibrated on':>40} {'total err':>9} {'per-layer err':>13}")
    analytic = analytic_errors(measured) if len(measured) > 1 else []
    for r in analytic:
        print(
            f"{r['target']:>16} {r['calibrated_on']:>40} {r['total_error']:>+9.1%} {r['per_layer_error']:>13.1%}"
        )

    print("\n== 3. analytic profile build time (meta tensors, first call in this process)")
    build = []
    for model in ("vgg19", "resnet152"):
        layer_costs.cache_clear()
        t0 = time.perf_counter()
        analytic_profile(model, 32, "TITAN V")
        build.append({"model": model, "batch": 32, "seconds": time.perf_counter() - t0})
        print(f"{model:>12} batch 32: {build[-1]['seconds']:.2f} s")

    args.out.parent.mkdir(parents=True, exist_ok=True)
    doc = {
        "torch": torch.__version__,
        "honesty": honest,
        "analytic_error": analytic,
        "analytic_build": build,
    }
    args.out.write_text(json.dumps(doc, indent=2) + "\n", encoding="utf-8")
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
