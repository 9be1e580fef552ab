"""Runtime throughput, measured side by side on this CPU (emulated heterogeneous devices).

1. **One VW on emulated heterogeneous devices** (``examples/emulated_cluster.yaml``, V R G Q):
   measured samples/s vs the simulator's prediction for the same stage times (the calibrated
   contention-free table divided by each device's speed) and vs the bound ``batch / slowest
   stage``. Targets: within 10 % of the prediction; >= 90 % of the bound when Nm >= stages.
2. **vs a pipeline that flushes every Nm minibatches** (what torch.distributed.pipelining's
   Schedule1F1B/GPipe do: our minibatch = their microbatch, Nm = their microbatch count), on
   the same partition, devices and pacing, run by hetpipe's runtime with
   the plan's ``schedule: flush``. Target ratio >= 1.1. ``--try-1f1b`` also runs the
   real ``Schedule1F1B`` (same partition, same pacing through autograd hooks), but in torch
   2.13 on gloo/CPU both Schedule1F1B and ScheduleGPipe deadlocked in our hands (with runtime
   shape inference and with explicit stage metadata): the last stage waits forever on its
   backward sends; the processes then exit after 120 s and the ratio is reported as NaN.
3. **One stage, Nm = 1 vs a plain PyTorch loop** on the same model (no pacing): overhead ratio,
   target >= 0.9.

Run: ``python benchmarks/bench_runtime.py [--model resnet --batch 8 --nm 4 --steps 48]``.
Prints the ratios and writes ``benchmarks/results/runtime.json``. The machine is shared (2 cores);
the load average is recorded next to the figures.
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import shutil
import sys
import tempfile
import time
from dataclasses import replace
from datetime import timedelta
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import multiprocessing as mp  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from planner.cluster import load_cluster  # noqa: E402
from planner.manual import cpu_cluster, manual_plan  # noqa: E402
from profiler.graph import ModelGraph  # noqa: E402
from runtime.config import ModelSource, OptimizerConfig, RunConfig  # noqa: E402
from runtime.data import MinibatchSource, default_dataset  # noqa: E402
from runtime.launch.launcher import launch  # noqa: E402
from runtime.spec import RunSpec  # noqa: E402
from runtime.stage.emulation import Calibration, pace_until  # noqa: E402
from runtime.stage.model import build_stage, reference_module, resolve_source  # noqa: E402

RESULTS = REPO / "benchmarks" / "results" / "runtime.json"


# ---------------------------------------------------------------- 1. emulated VW vs prediction


def _bench_cluster() -> Any:
    """The example emulated cluster's speeds with caps large enough for the benchmark model."""
    cluster = load_cluster(REPO / "examples" / "emulated_cluster.yaml")
    nodes = tuple(
        replace(n, emulation=replace(n.emulation, memory_bytes=1 << 30)) if n.emulation else n
        for n in cluster.nodes
    )
    return replace(cluster, nodes=nodes)


def time_balanced_cuts(model: str, batch: int, speeds: list[float]) -> tuple[int, ...]:
    """Cuts minimising the slowest stage's ``sum(layer time) / speed`` (devices in this order).

    Layer times come from the same contention-free calibration, one layer per stage.
    """
    from runtime.stage.emulation import calibrate
    from runtime.stage.model import sample_batch

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        spec = resolve_source(ModelSource(ref=model), batch, meta=False)
    graph = ModelGraph.from_spec(spec)
    n = len(graph.layers)
    inputs, targets = sample_batch(spec)
    cal = calibrate(
        graph.build_stages(list(range(1, n))), inputs, targets, spec.loss, "layers", reps=3
    )
    t = [f + b for f, b in zip(cal.fwd_s, cal.bwd_s, strict=True)]
    pre = [0.0]
    for x in t:
        pre.append(pre[-1] + x)
    k = len(speeds)
    inf = float("inf")
    # best[j][i]: smallest max stage time placing layers [0, i) on the first j devices
    best = [[inf] * (n + 1) for _ in range(k + 1)]
    arg = [[0] * (n + 1) for _ in range(k + 1)]
    best[0][0] = 0.0
    for j in range(1, k + 1):
        for i in range(j, n - (k - j) + 1):
            for c in range(j - 1, i):
                v = max(best[j - 1][c], (pre[i] - pre[c]) / speeds[j - 1])
                if v < best[j][i]:
                    best[j][i], arg[j][i] = v, c
    cuts, i = [], n
    for j in range(k, 1, -1):
        i = arg[j][i]
        cuts.append(i)
    return tuple(sorted(cuts))


def emulated_vw(model: str, batch: int, nm: int, steps: int, out: Path) -> dict[str, Any]:
    """Run one VW on the emulated cluster; compare with the simulator and the bound."""
    from planner.sim.simulator import simulate

    source = ModelSource(ref=model)
    graph = ModelGraph.from_spec(resolve_source(source, batch, meta=True))
    cluster = _bench_cluster()
    n = len(cluster.devices)
    cuts = time_balanced_cuts(
        model, batch, [d.emulation.speed for d in cluster.devices if d.emulation]
    )
    plan = manual_plan(graph, cuts, model, batch, nm, cluster)
    result = launch(
        plan,
        source,
        RunSpec(RunConfig(steps=steps, out_dir=out, timeout_s=120), OptimizerConfig(lr=0.01)),
    )
    cal = Calibration.load(out / "calibration.json")
    speeds = [g.speed for g in plan.virtual_workers[0].gpus]
    fwd_ms = [cal.fwd_s[s] / speeds[s] * 1e3 for s in range(n)]
    bwd_ms = [cal.bwd_s[s] / speeds[s] * 1e3 for s in range(n)]
    timed = manual_plan(graph, cuts, model, batch, nm, cluster, fwd_ms=fwd_ms, bwd_ms=bwd_ms)
    predicted = simulate(timed, waves=max(2, steps // nm)).throughput
    measured = result.throughput
    return {
        "model": model,
        "batch": batch,
        "nm": nm,
        "steps": steps,
        "cuts": list(cuts),
        "stage_ms": [round(f + b, 3) for f, b in zip(fwd_ms, bwd_ms, strict=True)],
        "measured": measured,
        "predicted": predicted,
        "bound": result.vws[0].bound_throughput,
        "measured_over_predicted": measured / predicted,
        "measured_over_bound": measured / result.vws[0].bound_throughput,
        "busy": [round(s.busy_fraction, 3) for s in result.stages],
        "max_in_flight": [s.max_in_flight for s in result.stages],
        "cal": cal,
        "cuts_t": cuts,
        "speeds": speeds,
    }


# ---------------------------------------------------------------- 2. Schedule1F1B, same pacing


class _Clock:
    t = 0.0


class _BackwardStarts(torch.autograd.Function):
    """At a stage's outputs: its backward runs first in the stage and records the start."""

    @staticmethod
    def forward(ctx: Any, clock: _Clock, *xs: torch.Tensor) -> Any:
        ctx.clock = clock
        return tuple(x.view_as(x) for x in xs)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> Any:
        ctx.clock.t = time.perf_counter()
        return (None, *grads)


class _BackwardEnds(torch.autograd.Function):
    """At a stage's inputs: its backward runs last and paces the stage's backward."""

    @staticmethod
    def forward(ctx: Any, clock: _Clock, target_s: float, *xs: torch.Tensor) -> Any:
        ctx.clock, ctx.target_s = clock, target_s
        return tuple(x.view_as(x) for x in xs)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> Any:
        pace_until(ctx.clock.t + ctx.target_s)
        return (None, None, *grads)


class PacedStage(torch.nn.Module):
    """A stage module paced like hetpipe's emulated devices (forward and backward)."""

    def __init__(self, inner: torch.nn.Module, fwd_s: float, bwd_s: float, last: bool) -> None:
        super().__init__()
        self.inner, self.fwd_s, self.bwd_s, self.last = inner, fwd_s, bwd_s, last
        self.clock = _Clock()

    def forward(self, *xs: torch.Tensor) -> Any:
        t0 = time.perf_counter()
        xs = tuple(
            x.detach().requires_grad_() if x.is_floating_point() and not x.requires_grad else x
            for x in xs
        )
        xs = _BackwardEnds.apply(self.clock, self.bwd_s, *xs)
        out = self.inner(*xs)
        outs = (out,) if isinstance(out, torch.Tensor) else tuple(out)
        if not self.last:
            outs = _BackwardStarts.apply(self.clock, *outs)
        else:  # the loss follows outside the module: start the backward clock at the output
            outs = _BackwardStarts.apply(self.clock, *outs)
        pace_until(t0 + self.fwd_s)
        return outs[0] if len(outs) == 1 else outs


def _gpipe_rank(rank: int, world: int, path: str, args: dict[str, Any], q: Any) -> None:
    import faulthandler

    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    faulthandler.dump_traceback_later(120, exit=True)  # it deadlocks on gloo: never hang
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"file://{path}",
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=120),
    )
    try:
        source = ModelSource(ref=args["model"])
        built = build_stage(source, args["batch"], args["cuts"], rank, 0)
        cal: Calibration = args["cal"]
        speed = args["speeds"][rank]
        last = rank == world - 1
        fwd_s = cal.fwd_s[rank] / speed
        bwd_s = cal.bwd_s[rank] / speed
        module = PacedStage(built.module.train(), fwd_s, bwd_s, last)
        stage_module = module if not args.get("unpaced") else built.module
        nm, batch = args["nm"], args["batch"]
        if rank == 0:
            example = tuple(torch.zeros(x.shape, dtype=x.dtype) for x in built.inputs)
        else:
            example = tuple(t.empty().zero_() for t in built.in_specs)
        example = tuple(x.requires_grad_() if x.is_floating_point() else x for x in example)
        out = module.inner(*example)  # with grad: outputs that need gradients must say so
        outs = (out,) if isinstance(out, torch.Tensor) else tuple(out)
        stage = PipelineStage(  # explicit metadata: the runtime inference deadlocks on gloo here
            stage_module,
            rank,
            world,
            torch.device("cpu"),
            input_args=tuple(x.detach() for x in example),
            output_args=tuple(o.detach() for o in outs),
            output_grads=None if last else tuple(torch.zeros_like(o.detach()) for o in outs),
            input_grads=None if rank == 0 else tuple(torch.zeros_like(x.detach()) for x in example),
        )
        sched_cls = ScheduleGPipe if args.get("gpipe") else Schedule1F1B
        sched = sched_cls(stage, nm, loss_fn=built.loss if last else None)
        opt = torch.optim.SGD(stage_module.parameters(), lr=0.01)
        data = MinibatchSource(
            default_dataset(args["model"], built.inputs, built.targets, batch),
            batch,
            0,
            tuple(built.targets.shape),
        )
        n_steps = max(2, args["steps"] // nm)
        times = []
        for step in range(n_steps):
            mbs = [data.batch(step * nm + i + 1) for i in range(nm)]
            xs = torch.cat([m[0][0] for m in mbs])
            ys = torch.cat([m[1] for m in mbs])
            opt.zero_grad()
            if rank == 0:
                sched.step(xs)
            elif last:
                sched.step(target=ys, losses=[])
            else:
                sched.step()
            opt.step()
            dist.barrier()
            times.append(time.perf_counter())
        if rank == 0:  # steady: from the end of step 1 to the end
            q.put(nm * batch * (n_steps - 1) / (times[-1] - times[0]))
    finally:
        dist.destroy_process_group()


def schedule_1f1b(em: dict[str, Any]) -> float:
    """Samples/s of torch.distributed.pipelining's Schedule1F1B with the same pacing."""
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    args: dict[str, Any] = {
        k: em[k]
        for k in ("model", "batch", "nm", "steps", "cal", "speeds", "gpipe", "unpaced")
        if k in em
    }
    args["cuts"] = em["cuts_t"]
    world = len(em["speeds"])
    with tempfile.TemporaryDirectory() as tmp:
        procs = [
            ctx.Process(target=_gpipe_rank, args=(r, world, f"{tmp}/rdzv", args, q))
            for r in range(world)
        ]
        for p in procs:
            p.start()
        for p in procs:
            p.join()
    try:
        return float(q.get(timeout=5))
    except queue.Empty:  # the schedule deadlocked (see module docstring)
        return float("nan")


def flushed_baseline(
    model: str, batch: int, nm: int, steps: int, cuts: tuple[int, ...], cal_dir: Path
) -> float:
    """The same emulated pipeline, partition and pacing (the same calibration table), flushing
    after every Nm minibatches."""
    source = ModelSource(ref=model)
    graph = ModelGraph.from_spec(resolve_source(source, batch, meta=True))
    cluster = _bench_cluster()
    plan = replace(manual_plan(graph, cuts, model, batch, nm, cluster), schedule="flush")
    out = cal_dir / "flushed"
    out.mkdir()
    shutil.copy(cal_dir / "calibration.json", out / "calibration.json")
    run = RunConfig(steps=steps, out_dir=out, timeout_s=120)
    return launch(plan, source, RunSpec(run, OptimizerConfig(lr=0.01))).throughput


# ---------------------------------------------------------------- 3. one stage vs plain loop


def _plain_loop(model: str, batch: int, steps: int) -> float:
    """Samples/s of a plain single-thread PyTorch loop (first step excluded, like wave 0)."""
    source = ModelSource(ref=model)
    module, _, loss_fn = reference_module(source, batch, 0)
    spec = resolve_source(source, batch, meta=True)
    ds = default_dataset(model, spec.inputs, spec.targets, batch)
    data = MinibatchSource(ds, batch, 0, tuple(spec.targets.shape))
    torch.set_num_threads(1)
    opt = torch.optim.SGD(module.parameters(), lr=0.01)
    done = []
    for p in range(1, steps + 1):
        x, y = data.batch(p)
        opt.zero_grad()
        loss_fn(module(*x), y).backward()
        opt.step()
        done.append(time.perf_counter())
    return (steps - 1) * batch / (done[-1] - done[0])


def one_stage_vs_plain(model: str, batch: int, steps: int) -> dict[str, float]:
    """hetpipe with one stage and Nm = 1 (no pacing) vs a plain loop, alternated
    plain / hetpipe / plain / hetpipe so that load changes hit both alike."""
    source = ModelSource(ref=model)
    graph = ModelGraph.from_spec(resolve_source(source, batch, meta=True))
    plan = manual_plan(graph, (), model, batch, 1, cpu_cluster(1))
    ours, plain = [], []
    for _ in range(2):
        plain.append(_plain_loop(model, batch, steps))
        run = RunConfig(steps=steps, timeout_s=120)
        ours.append(launch(plan, source, RunSpec(run, OptimizerConfig(lr=0.01))).throughput)
    o, p = sum(ours) / len(ours), sum(plain) / len(plain)
    return {"hetpipe": o, "plain": p, "ratio": o / p}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0] if __doc__ else "")
    ap.add_argument("--model", default="resnet")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--nm", type=int, default=4)
    ap.add_argument("--steps", type=int, default=48)
    ap.add_argument("--results", type=Path, default=RESULTS, help="where to write the JSON")
    ap.add_argument(
        "--try-1f1b",
        action="store_true",
        help="also run torch Schedule1F1B (hangs on gloo in torch 2.13)",
    )
    a = ap.parse_args()
    load0 = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as tmp:
        em = emulated_vw(a.model, a.batch, a.nm, a.steps, Path(tmp))
        flushed = flushed_baseline(a.model, a.batch, a.nm, a.steps, em["cuts_t"], Path(tmp))
    print(f"[1] emulated VW ({a.model}, batch {a.batch}, Nm {a.nm}, stage ms {em['stage_ms']}):")
    print(
        f"    measured {em['measured']:.1f} samples/s, predicted {em['predicted']:.1f}, bound {em['bound']:.1f}"
    )
    print(
        f"    measured/predicted {em['measured_over_predicted']:.3f} (target 0.90-1.10), "
        f"measured/bound {em['measured_over_bound']:.3f} (target >= 0.90)"
    )
    print(
        f"[2] same pipeline with a flush every Nm minibatches (1F1B/GPipe-style): {flushed:.1f} samples/s; "
        f"hetpipe/flushed {em['measured'] / flushed:.3f} (target >= 1.1)"
    )
    theirs = float("nan")
    if a.try_1f1b:
        theirs = schedule_1f1b(em)
        print(
            f"[2b] torch Schedule1F1B same partition & pacing: {theirs:.1f} samples/s; "
            f"hetpipe/1F1B {em['measured'] / theirs:.3f}"
        )
    one = one_stage_vs_plain(a.model, a.batch, a.steps)
    print(
        f"[3] one stage Nm=1 {one['hetpipe']:.1f} vs plain loop {one['plain']:.1f} samples/s: ratio {one['ratio']:.3f} (target >= 0.9)"
    )
    load1 = os.getloadavg()[0]
    print(f"load average (1 min) before/after: {load0:.2f}/{load1:.2f} on {os.cpu_count()} cores")
    out = {k: v for k, v in em.items() if k not in ("cal", "cuts_t", "speeds")}
    out |= {
        "flushed_baseline": flushed,
        "hetpipe_over_flushed": em["measured"] / flushed,
        "schedule_1f1b": theirs,
        "one_stage": one,
        "loadavg_before_after": [load0, load1],
        "cpus": os.cpu_count(),
    }
    a.results.parent.mkdir(parents=True, exist_ok=True)
    a.results.write_text(json.dumps(out, indent=2), encoding="utf-8")
    print(f"wrote {a.results}")


if __name__ == "__main__":
    main()
