"""`hetpipe run`: train one virtual worker of a plan with one process per GPU on this host."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
import yaml

from hetpipe._common import console, handle_errors
from planner.cluster import load_cluster
from planner.plan import Plan, load_plan
from profiler.errors import ConfigError

HELP = (
    "Train with a plan: PLAN.yaml (from 'hetpipe plan'), or CLUSTER.yaml with --model (a one-VW "
    "plan is made on the fly). Starts one process per GPU of the virtual worker (CPU processes "
    "for emulated devices, paced to their speed), runs the pipeline with Nm minibatches in flight "
    "and exact local staleness, shows progress and a summary, and writes metrics to --out. "
    "Several hosts: run 'torchrun --nnodes N --node-rank I --master-addr HOST "
    "--nproc-per-node K -m runtime PLAN.yaml' on each host (see docs/runtime.md)."
)


def _load(path: Path, model: str | None, batch_size: int, nm: int, stages: int) -> Plan:
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except (OSError, yaml.YAMLError) as exc:
        raise ConfigError(f"{path}: cannot read ({exc})") from None
    if isinstance(data, dict) and "virtual_workers" in data:
        return load_plan(path)
    if model is None:
        raise ConfigError(
            f"{path} is a cluster file: give --model (e.g. --model mlp) to plan on the fly"
        )
    from runtime.api import make_single_vw_plan
    from runtime.config import ModelSource

    return make_single_vw_plan(ModelSource(ref=model), batch_size, nm, load_cluster(path), stages)


@handle_errors
def run(
    path: Annotated[Path, typer.Argument(help="plan.yaml/plan.json, or cluster.yaml with --model")],
    model: Annotated[
        str | None, typer.Option(help="model for a cluster.yaml (built-in name or pkg.mod:factory)")
    ] = None,
    batch_size: Annotated[
        int, typer.Option("--batch-size", help="minibatch size when planning on the fly")
    ] = 32,
    stages: Annotated[
        int, typer.Option(help="stages when planning on the fly (0 = the planner's choice)")
    ] = 0,
    steps: Annotated[int, typer.Option(help="minibatches to train (0 = from --epochs)")] = 0,
    epochs: Annotated[
        float, typer.Option(help="passes over the data set (default 1 when no --steps)")
    ] = 0.0,
    time_limit: Annotated[
        float, typer.Option("--time-limit", help="stop admitting minibatches after SECONDS")
    ] = 0.0,
    seed: Annotated[int, typer.Option(help="seed of the initial weights and the data order")] = 0,
    nm: Annotated[int, typer.Option(help="minibatches in flight (0 = the plan's Nm)")] = 0,
    vw: Annotated[int, typer.Option(help="which virtual worker of the plan to run")] = 0,
    optimizer: Annotated[str, typer.Option(help="sgd or adam")] = "sgd",
    lr: Annotated[float, typer.Option(help="learning rate")] = 0.05,
    momentum: Annotated[float, typer.Option(help="SGD momentum")] = 0.0,
    weight_decay: Annotated[float, typer.Option("--weight-decay", help="weight decay")] = 0.0,
    schedule: Annotated[
        str, typer.Option(help="lr schedule: constant, step, cosine, warmup")
    ] = "constant",
    out: Annotated[
        Path | None,
        typer.Option("--out", help="run directory (metrics.csv, stages.csv, weights.pt)"),
    ] = None,
    timeout: Annotated[
        float, typer.Option(help="seconds before a stuck process-group operation fails")
    ] = 30.0,
    emulate: Annotated[
        bool, typer.Option(help="pace emulated devices and enforce their memory caps")
    ] = True,
    progress: Annotated[bool, typer.Option(help="show a progress bar")] = True,
) -> None:
    """Train one virtual worker and print the summary."""
    from runtime.config import ModelSource, OptimizerConfig, RunConfig
    from runtime.launcher import launch
    from runtime.metrics import summary_table

    plan = _load(path, model, batch_size, nm, stages)
    if model is not None and model != plan.model:
        raise ConfigError(
            f"--model {model} does not match the plan's model {plan.model!r}; drop --model"
        )
    cfg = OptimizerConfig(
        name=optimizer, lr=lr, momentum=momentum, weight_decay=weight_decay, schedule=schedule
    )
    run_cfg = RunConfig(
        steps=steps,
        epochs=epochs,
        time_limit_s=time_limit,
        seed=seed,
        nm=nm,
        out_dir=out,
        timeout_s=timeout,
        emulate=emulate,
        progress=progress,
    )
    worker = plan.virtual_workers[vw] if 0 <= vw < len(plan.virtual_workers) else None
    if worker is not None:
        console.print(
            f"training {plan.model} on VW {vw} ({worker.signature}, {len(worker.stages)} stages), "
            f"batch {plan.batch_size}, Nm {nm or plan.nm}"
        )
    result = launch(plan, ModelSource(ref=plan.model), cfg, run_cfg, vw=vw)
    console.print(summary_table(result))
    if out is not None:
        console.print(
            f"metrics: {out / 'metrics.csv'}, {out / 'stages.csv'}; weights: {out / 'weights.pt'}"
        )
