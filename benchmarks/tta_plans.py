"""The time-to-accuracy benchmark's systems: each one's plan file and what its runs need from it.

``hetpipe``: the plan ``hetpipe plan`` makes (with the benchmark's ``--plan-args``); ``ddp``:
the AllReduce baseline (``--sync allreduce``: every device that holds the model); and, with
``--time-objective``, ``hetpipe-time``: the plan ``hetpipe plan --objective time`` picks (the
fastest predicted time to target, which may be the AllReduce plan itself: the planner's
"never slower" rule).
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

SYSTEMS = ("hetpipe", "ddp", "hetpipe-time")  # every system, in the order they train
TITLES = {"hetpipe": "HetPipe (WSP)", "ddp": "DDP AllReduce",
          "hetpipe-time": "HetPipe --objective time"}  # fmt: skip


@dataclass(frozen=True)
class SystemPlan:
    """One system's plan and the figures its runs are sized by.

    Attributes:
        path: the plan file.
        allreduce: the AllReduce layout (one rank per device, no shards: a clock is one step).
        workers: VWs (AllReduce: devices).
        nm: minibatches per VW per global clock (AllReduce: 1).
        batch: samples per minibatch (per VW, per device).
        predicted: the plan's predicted samples/s.
        remedy: the staleness remedy the plan was chosen with (``--remedy`` of its runs).
        key: what makes two plans the same training (rule, devices per VW, Nm, D, remedy).
    """

    path: Path
    allreduce: bool
    workers: int
    nm: int
    batch: int
    predicted: float
    remedy: str
    key: str

    @property
    def per_clock(self) -> int:
        """Training samples per global clock (every VW's wave, or one AllReduce step)."""
        return self.nm * self.batch * self.workers


def hetpipe_cmd(*args: str) -> list[str]:
    """``python -m hetpipe ARGS`` (this interpreter, this checkout)."""
    return [sys.executable, "-m", "hetpipe", *args]


def check(cmd: list[str], timeout_s: float) -> None:
    """Run ``cmd`` from the repository root; exit with its output if it fails."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, check=False,
                          cwd=REPO, env=env)  # fmt: skip
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")


def system_plan(path: Path) -> SystemPlan:
    """Read what the benchmark needs from the plan file at ``path``."""
    from planner.plan_file import load_plan
    from planner.rules import layout

    plan = load_plan(path)
    ddp = layout(plan.sync) == "ddp"
    devices = [[f"{g.node}:{g.index}" for g in vw.gpus] for vw in plan.virtual_workers]
    nm = 1 if ddp else plan.nm
    key = f"{plan.sync} {devices} nm {nm} D {plan.D} {plan.remedy}"
    return SystemPlan(path, ddp, len(plan.virtual_workers), nm, plan.batch_size,
                      plan.predicted.throughput, plan.remedy, key)  # fmt: skip


def plan_args_of(
    system: str, plan_args: Sequence[str], data: str = "", momentum: float = 0.9
) -> list[str]:
    """What ``hetpipe plan`` adds for ``system`` (besides the cluster, model and optimizer);
    ``hetpipe-time`` calibrates its efficiency model on ``data`` (the data the runs train on,
    ``--calibrate-efficiency``; empty: the model's defaults) with the runs' ``momentum``.

    >>> plan_args_of("ddp", ["--policy", "ed"]), plan_args_of("hetpipe-time", [], "pkg:data")
    (['--sync', 'allreduce'], ['--objective', 'time', '--calibrate-efficiency', 'pkg:data', \
'--momentum', '0.9'])
    """
    if system == "ddp":
        return ["--sync", "allreduce"]
    if system == "hetpipe-time":
        calibrate = ["--calibrate-efficiency", data] if data else []
        if data and momentum:  # plain SGD (--optimizer sgd) takes no --momentum
            calibrate += ["--momentum", f"{momentum:g}"]
        return [*plan_args, "--objective", "time", *calibrate]
    return list(plan_args)


def make_plans(
    common: Sequence[str],
    plan_args: Sequence[str],
    systems: Sequence[str],
    folder: Path,
    tag: str,
    data: str = "",
    momentum: float = 0.9,
) -> dict[str, SystemPlan]:
    """Each of ``systems``' plan (``hetpipe plan COMMON ...``), written to ``folder``;
    ``hetpipe-time`` calibrated on ``data`` with the runs' ``momentum``."""
    plans = {}
    for system in systems:
        path = folder / f"{tag}_{system}.json"
        args = plan_args_of(system, plan_args, data, momentum)
        check(hetpipe_cmd("plan", *common, *args, "-o", str(path)), 900)
        plans[system] = system_plan(path)
    return plans
