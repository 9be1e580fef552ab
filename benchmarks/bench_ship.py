"""Shipping a user's module to the stage processes: its stage alone vs the whole module.

A ~320 MB model (five 4096 x 4096 linear layers) trained for one minibatch with
``hetpipe.train(module, ..., stages=S, emulate=False)``, in two modes, alternating in one
process:

- ``stage``: each stage process receives its stage alone (:func:`runtime.stage.model.ship_stage`,
  the default);
- ``whole``: the former behaviour, every stage process receives the whole module as one blob
  and splits it itself (``ship_stage`` replaced by the identity for the run).

Reported: bytes each stage process receives (the pickled ``ModelSource``) and the wall time of
the whole ``train`` call (spawn, ship, build, one step, results), median over the repeats.
Writes ``benchmarks/results/ship.json``.

Usage: ``python benchmarks/bench_ship.py [--stages 2] [--repeats 2]``.
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import statistics
import time
from pathlib import Path
from typing import Any
from unittest import mock

import torch
from torch import nn
from torch.utils.data import TensorDataset

import runtime.stage.model as stage_model
from hetpipe.api import _module_source, train
from planner.on_the_fly import PlanRequest, plan_for_run
from profiler.graph import ModelGraph
from runtime.config import OptimizerConfig

RESULTS = Path(__file__).resolve().parent / "results" / "ship.json"
WIDTH, LAYERS, BATCH = 4096, 5, 4


def model() -> nn.Module:
    """Five 4096 x 4096 linear layers with ReLUs: 336 MB of float32 parameters."""
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(LAYERS):
        layers += [nn.Linear(WIDTH, WIDTH), nn.ReLU()]
    return nn.Sequential(*layers[:-1])


def shipped_bytes(module: nn.Module, data: TensorDataset, stages: int) -> dict[str, Any]:
    """Bytes each stage process receives in either mode (the pickled model source)."""
    source = _module_source(module, data, None, BATCH)
    whole = len(pickle.dumps(source))
    graph = ModelGraph.from_spec(stage_model.resolve_source(source, BATCH, meta=False))
    request = PlanRequest(source.name, BATCH, 1, stages, vws=1, policy="ed")
    plan = plan_for_run(None, request, graph)  # the cuts train() makes
    cuts = tuple(st.first_index for st in plan.virtual_workers[0].stages[1:])
    per_stage = [
        len(pickle.dumps(stage_model.ship_stage(source, BATCH, cuts, s))) for s in range(stages)
    ]
    return {"whole_bytes_per_stage": whole, "stage_bytes": per_stage, "cuts": list(cuts)}


def one_run(module: nn.Module, data: TensorDataset, stages: int, mode: str) -> float:
    """Wall seconds of one ``train`` call (one minibatch) in ``mode``."""
    t0 = time.perf_counter()
    if mode == "whole":
        with mock.patch.object(stage_model, "ship_stage", lambda source, *a: source):
            train(module, data, stages=stages, nm=1, batch_size=BATCH, steps=1,
                  optimizer=OptimizerConfig(lr=1e-3), emulate=False, return_state=False)  # fmt: skip
    else:
        train(module, data, stages=stages, nm=1, batch_size=BATCH, steps=1,
              optimizer=OptimizerConfig(lr=1e-3), emulate=False, return_state=False)  # fmt: skip
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--stages", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(1)
    module = model()
    data = TensorDataset(torch.randn(4 * BATCH, WIDTH), torch.randint(0, WIDTH, (4 * BATCH,)))
    out: dict[str, Any] = {
        "model_bytes": sum(p.numel() * p.element_size() for p in module.parameters()),
        "stages": args.stages,
        "load_before": os.getloadavg()[0],
        **shipped_bytes(module, data, args.stages),
    }
    times: dict[str, list[float]] = {"stage": [], "whole": []}
    for _ in range(args.repeats):
        for mode in ("whole", "stage"):  # alternating: the same load for both
            times[mode].append(one_run(module, data, args.stages, mode))
    out["launch_s"] = {m: statistics.median(t) for m, t in times.items()}
    out["runs_s"] = times
    out["load_after"] = os.getloadavg()[0]
    RESULTS.write_text(json.dumps(out, indent=2) + "\n")
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
