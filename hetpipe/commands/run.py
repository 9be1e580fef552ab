"""`hetpipe run`: train a plan on this host: every VW through the WSP parameter servers, one VW
alone, or the DDP AllReduce baseline (``--sync allreduce``)."""

from __future__ import annotations

import shlex
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
import yaml

from hetpipe._common import console, handle_errors
from planner.cluster import Cluster, load_cluster
from planner.plan import Plan, load_plan
from profiler.errors import ConfigError

if TYPE_CHECKING:
    from runtime.config import OptimizerConfig, RunConfig

HELP = (
    "Train with a plan: PLAN.yaml (from 'hetpipe plan'), or CLUSTER.yaml (planned on the fly; "
    "--model, default mlp; an emulated cluster of 4+ devices gets 2 VWs by policy hd). Several "
    "VWs train through WSP parameter-server shards (one process each, placed per the plan) with "
    "one process per GPU (CPU processes for emulated devices, paced to their speed), each "
    "pipeline with Nm minibatches in flight and exact local staleness; --vw K runs one VW alone; "
    "--sync allreduce runs the DDP baseline. Shows progress and a summary (throughput, waiting "
    "and idle time per VW, test accuracy), writes metrics, checkpoints and weights to --out; "
    "--resume DIR continues from checkpoints. "
    "Several hosts: run 'torchrun --nnodes N --node-rank I --master-addr HOST "
    "--nproc-per-node K -m runtime PLAN.yaml' on each host (see docs/runtime.md)."
)


def _default_vws(cluster: Cluster) -> int:
    """2 VWs on an emulated cluster of at least 4 devices (the main job), else 1."""
    devices = cluster.devices
    return 2 if len(devices) >= 4 and all(d.emulation is not None for d in devices) else 1


def _load(
    path: Path,
    model: str | None,
    batch_size: int,
    nm: int,
    stages: int,
    vws: int,
    D: int,
    policy: str | None = None,
) -> Plan:
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except (OSError, yaml.YAMLError) as exc:
        raise ConfigError(f"{path}: cannot read ({exc})") from None
    if isinstance(data, dict) and "virtual_workers" in data:
        return load_plan(path)
    cluster = load_cluster(path)
    n_vws = vws or _default_vws(cluster)
    if n_vws > 1 or policy is not None:
        if stages:
            raise ConfigError("--stages applies to a hand-cut single VW; drop it or drop --policy")
        from planner.planner import make_plan

        return make_plan(
            cluster,
            model=model or "mlp",
            batch_size=batch_size,
            nm=nm or None,
            num_vws=n_vws,
            policy=policy or "hd",
            D=D,
        )
    from runtime.api import make_single_vw_plan
    from runtime.config import ModelSource

    return make_single_vw_plan(ModelSource(ref=model or "mlp"), batch_size, nm, cluster, stages)


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
        float,
        typer.Option(
            "--time-limit",
            help="stop admitting minibatches after SECONDS (several VWs: all stop at one agreed wave)",
        ),
    ] = 0.0,
    seed: Annotated[int, typer.Option(help="seed of the initial weights and the data order")] = 0,
    nm: Annotated[int, typer.Option(help="minibatches in flight (0 = the plan's Nm)")] = 0,
    vw: Annotated[
        int, typer.Option(help="run only this virtual worker of the plan (-1 = all, through WSP)")
    ] = -1,
    vws: Annotated[
        int,
        typer.Option(help="VWs when planning on the fly (0 = 2 on an emulated 4+ device cluster)"),
    ] = 0,
    policy: Annotated[
        str | None,
        typer.Option(
            "--policy",
            help="allocation policy when planning on the fly: np | ed | hd | auto (default hd; "
            "with --vws 1 the planner's single VW with parameter servers instead of a hand cut)",
        ),
    ] = None,
    staleness: Annotated[
        int | None, typer.Option("--D", help="WSP clock-distance threshold D (default: the plan's)")
    ] = None,
    sync: Annotated[
        str, typer.Option(help="wsp (parameter servers) or allreduce (DDP baseline)")
    ] = "wsp",
    checkpoint_every: Annotated[
        int,
        typer.Option(
            "--checkpoint-every",
            help="checkpoint every K global clocks into --out/checkpoints (0 = never)",
        ),
    ] = 5,
    resume: Annotated[
        str | None,
        typer.Option(
            "--resume",
            help="continue the run in DIR (its --out or its checkpoints folder) from its newest "
            "verified snapshot, or DIR@CLOCK from that one; on a finished run, write its "
            "weights.pt and summary.json from the last snapshot",
        ),
    ] = None,
    overwrite: Annotated[
        bool, typer.Option("--overwrite", help="replace another run's outputs in --out")
    ] = False,
    on_failure: Annotated[
        str,
        typer.Option(
            "--on-failure",
            help="stop: a failed process ends the run; restart: restart the whole job from its "
            "last snapshot (up to --max-restarts times)",
        ),
    ] = "stop",
    max_restarts: Annotated[
        int, typer.Option("--max-restarts", help="restarts allowed with --on-failure restart")
    ] = 3,
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
    """Train a plan (all its VWs through WSP, one VW, or the AllReduce baseline); print the summary."""
    from runtime.config import ModelSource, OptimizerConfig, RunConfig
    from runtime.launcher import launch
    from runtime.metrics import summary_table
    from runtime.run_dir import resume_target

    if sync not in ("wsp", "allreduce"):
        raise ConfigError(f"--sync {sync!r}: use wsp or allreduce")
    if on_failure not in ("stop", "restart"):
        raise ConfigError(
            f"--on-failure {on_failure!r}: use stop or restart (continue, which evicts a lost VW, "
            "is not implemented: see docs/fault_tolerance.md)"
        )
    restarts = max_restarts if on_failure == "restart" else 0
    if sync == "allreduce" and resume is None:
        _allreduce(
            path, model, batch_size, steps, epochs, seed, lr, momentum, out, timeout, emulate
        )
        return
    target = resume_target(resume) if resume is not None else None
    if target is not None and out is None:
        out = target[0]
    saved = out / "plan.json" if out is not None else None
    if resume is not None and saved is not None and saved.exists():
        plan = load_plan(saved)  # the plan the interrupted run used
    else:
        plan = _load(path, model, batch_size, nm, stages, vws, staleness or 0, policy)
    if model is not None and model != plan.model:
        raise ConfigError(
            f"--model {model} does not match the plan's model {plan.model!r}; drop --model"
        )
    cfg = OptimizerConfig(
        name=optimizer, lr=lr, momentum=momentum, weight_decay=weight_decay, schedule=schedule
    )
    n_vws = len(plan.virtual_workers)
    through_wsp = vw < 0 and bool(plan.shards)  # every VW, through the parameter servers
    if through_wsp and n_vws > 1 and steps == 0 and epochs == 0 and time_limit == 0:
        epochs = 40.0  # the main job: a few minutes on a 2-core machine
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
    if through_wsp:
        _wsp(
            path, plan, cfg, run_cfg, staleness, checkpoint_every, target, out, overwrite, restarts
        )
        return
    vw = max(vw, 0)
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
            f"metrics: {out / 'metrics.csv'}, {out / 'stages.csv'}; weights: {out / 'weights.pt'}; "
            f"timeline: {out / 'timeline.png'}, {out / 'trace.json'}"
        )


def _wsp(
    path: Path,
    plan: Plan,
    cfg: OptimizerConfig,
    run_cfg: RunConfig,
    staleness: int | None,
    checkpoint_every: int,
    resume: tuple[Path, Path, int | None] | None,
    out: Path | None,
    overwrite: bool,
    max_restarts: int,
) -> None:
    from runtime.config import ModelSource
    from runtime.wsp_launcher import WSPConfig, launch_wsp

    sigs = ", ".join(
        f"VW {k} {w.signature} ({len(w.stages)} stages)" for k, w in enumerate(plan.virtual_workers)
    )
    D = plan.D if staleness is None else staleness
    console.print(
        f"training {plan.model} on {len(plan.virtual_workers)} VWs through {len(plan.shards)} "
        f"parameter-server shards (WSP, D={D}): {sigs}; batch {plan.batch_size}, "
        f"Nm {run_cfg.nm or plan.nm}"
    )
    wsp = WSPConfig(
        D=staleness,
        checkpoint_dir=resume[1] if resume is not None else None,
        checkpoint_every=checkpoint_every,
        resume=resume is not None,
        resume_clock=resume[2] if resume is not None else None,
        resume_hint=_resume_hint(path),
        overwrite=overwrite,
        max_restarts=max_restarts,
    )
    result = launch_wsp(plan, ModelSource(ref=plan.model), cfg, run_cfg, wsp)
    console.print(result.table())
    if out is not None:
        console.print(
            f"metrics: {out}/vw*/metrics.csv, {out}/summary.json; weights: {out / 'weights.pt'}; "
            f"timeline: {out / 'timeline.png'}, {out / 'trace.json'}"
        )


def _resume_hint(path: Path) -> str:
    """This command line (without ``--resume``), for the message of a failed run."""
    argv = sys.argv[1:]
    if not sys.argv or not Path(sys.argv[0]).name.startswith("hetpipe") or "run" not in argv:
        return f"hetpipe run {path}"
    kept: list[str] = []
    skip = False
    for a in argv:
        if skip or a == "--resume":
            skip = not skip
            continue
        if not a.startswith("--resume=") and a != "--overwrite":  # --resume reuses the run
            kept.append(a)
    return "hetpipe " + " ".join(shlex.quote(a) for a in kept)


def _allreduce(
    path: Path,
    model: str | None,
    batch_size: int,
    steps: int,
    epochs: float,
    seed: int,
    lr: float,
    momentum: float,
    out: Path | None,
    timeout: float,
    emulate: bool,
) -> None:
    from runtime.config import OptimizerConfig
    from runtime.ddp import run_allreduce

    data = yaml.safe_load(path.read_text(encoding="utf-8"))
    if isinstance(data, dict) and "virtual_workers" in data:
        plan = load_plan(path)
        cluster, model, batch_size = plan.cluster, plan.model, plan.batch_size
    else:
        cluster = load_cluster(path)
    if steps == 0:
        steps = 50 * max(1, round(epochs or 1))
    ref = model or "mlp"
    console.print(f"training {ref} with DDP AllReduce (BSP) on {cluster.name}, {steps} steps")
    result = run_allreduce(
        cluster,
        ref,
        batch_size,
        steps,
        optimizer=OptimizerConfig(lr=lr, momentum=momentum),
        seed=seed,
        emulate=emulate,
        timeout_s=timeout,
        out_dir=out,
    )
    console.print(
        f"AllReduce on {' '.join(result.devices)}: {result.steps} steps, "
        f"{result.throughput:.1f} samples/s, test accuracy {result.test_accuracy:.2%}, "
        f"last loss {result.losses[-1]:.4f}, wall {result.wall_s:.1f} s"
    )
