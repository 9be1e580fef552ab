"""`hetpipe plan`: form virtual workers, partition the model, place shards, predict throughput."""

from __future__ import annotations

import sys
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.markup import escape
from rich.table import Table

from hetpipe._common import console, err_console, handle_errors
from hetpipe._rules import RuleValues, apply_rule, rule_params, sync_help, with_rule_options
from hetpipe.commands.objective import (
    Calibration,
    choose_for_time,
    d_values,
    efficiency_inputs,
    other_allocations,
    render_objective,
    with_objective,
)
from planner.cluster import Cluster, load_cluster
from planner.plan import Plan, Prediction, StagePlan, VirtualWorker
from planner.rules import DEFAULT_RULE, get_rule, time_ranked
from profiler.errors import ConfigError, shown
from runtime.options import OPTIONS, PLAN_OPTIONS, Range, check_number, check_values

if TYPE_CHECKING:  # heavy (torch, pandas, PuLP): imported when a plan is made
    from rich.console import Console

    from planner.auto_search import Candidate
    from planner.efficiency import EfficiencyInputs
    from profiler.table import Profile

HELP = (
    "Plan HetPipe training on CLUSTER.yaml: form virtual workers with an allocation policy "
    "(np, ed, hd or auto), choose each VW's GPU order and layer split (exact DP, proven optimal), pick Nm, place "
    "parameter-server shards and predict throughput. Profiles come from --profiles (hetpipe CSVs "
    "or PipeDream graph.txt); GPU types without one get analytic profiles (and the output says so)."
)


def load_profiles(paths: list[Path], reference_type: str | None) -> list[Profile]:
    """hetpipe CSV profiles from files/folders, plus PipeDream ``graph.txt`` files or their
    folders (``plan --profiles`` and ``simulate --profiles``)."""
    from profiler.pipedream import import_pipedream
    from profiler.table import load_profile_set

    out: list[Profile] = []
    csvs: list[Path] = []
    for p in paths:
        if not p.exists():
            raise ConfigError(f"{p}: no such profile file or folder")
        graph = p if p.name == "graph.txt" else p / "graph.txt"
        if graph.is_file():
            out.append(import_pipedream(graph))
        else:
            csvs.append(p)
    if csvs:
        out += load_profile_set(csvs)
    if not out:
        raise ConfigError(
            f"no profiles found in {', '.join(map(str, paths))} (expected *.csv or graph.txt)"
        )
    return out


def _mem(used: float, cap: float) -> str:
    """``used/cap`` in GiB, or MiB for small (emulated) devices."""
    if cap < 2**30:
        return f"{used / 2**20:.1f}/{cap / 2**20:.1f} MiB"
    return f"{used / 2**30:.2f}/{cap / 2**30:.2f} GiB"


def _placement(s: StagePlan) -> str:
    """Memory placement letters (keep/offload/recompute of weights, activations, optimizer,
    gradients) and the host bytes, e.g. ``ORKO 1.2 MiB``."""
    from planner.offload import MemoryPlacement

    code = MemoryPlacement.parse(s.memory).code
    return f"{code} {s.host_bytes / 2**20:.1f} MiB" if s.host_bytes else code


def _proof(vw: VirtualWorker) -> str:
    """How good the VW's partition is proven to be."""
    if vw.bound_ms <= 0:
        return "optimality unknown"
    if vw.gap <= 1e-6:
        return f"proven optimal ({escape(vw.partitioner)})"
    return (
        f"slowest stage <= {100 * vw.gap:.1f} % above the optimum (proven bound "
        f"{vw.bound_ms:.2f} ms, {escape(vw.partitioner)})"
    )


def _allreduce_plan(
    cluster: Cluster, profiles: list[Profile], model: str | None, batch: int | None, opt: str
) -> Plan:
    from planner.baseline import allreduce_plan

    return allreduce_plan(cluster, model, batch, profiles=profiles or None, optimizer=opt)


def _plan_once(
    cl: Cluster,
    profs: list[Profile],
    sync: str,
    kwargs: dict[str, Any],
    by_policy: Callable[[Cluster, list[Profile]], Plan],
) -> tuple[list[Profile], Plan]:
    """The profiles the planner prices (``kwargs``' model, batch size and precision; fp32
    under a ``ddp`` rule) and the plan: the AllReduce baseline's under a ``ddp`` rule, else
    ``by_policy``'s (the allocation policy's)."""
    from hetpipe.planning import profiles_for

    ddp = get_rule(sync).layout == "ddp"
    model, batch = kwargs["model"], kwargs["batch_size"]
    measured_at = "fp32" if ddp else kwargs["precision"]  # what the planner prices
    profs = profiles_for(cl, profs, model, batch, measured_at)
    if ddp:
        return profs, _allreduce_plan(cl, profs, model, batch, kwargs["optimizer"])
    return profs, by_policy(cl, profs)


def _opt(name: str) -> typer.models.OptionInfo:
    """The typer option of planning option ``name`` (:data:`runtime.options.PLAN_OPTIONS`)."""
    o = PLAN_OPTIONS[name]
    return typer.Option(o.flag, help=o.help)


_CAL_LR = "--calibrate-efficiency: the run's learning rate (default: the run's, 0.05)"
_CAL_MOMENTUM = "--calibrate-efficiency: the run's SGD momentum (default: 0.9, sgd: 0)"
_CAL_SEED = "--calibrate-efficiency: the run's seed (its initial weights; default: the run's, 0)"
_CAL_DECAY = "--calibrate-efficiency: the run's weight decay (default: the run's, 0)"


class _Calibrating:
    """Progress of ``--calibrate-efficiency`` on the status line (each run and the seconds so
    far), and its total time."""

    def __init__(self, update: Callable[[str], object]) -> None:
        import time

        self._clock = time.perf_counter
        self._start, self._update, self.runs = self._clock(), update, 0
        self.took: float | None = None

    def __call__(self, what: str) -> None:
        self.runs += 1
        self._update(
            f"calibrating efficiency ({self.seconds:.0f} s, run {self.runs}): {escape(what)}"
        )

    @property
    def seconds(self) -> float:
        """Seconds since the calibration started."""
        return self._clock() - self._start

    def inputs(
        self, calibration: Calibration, model: str | None, batch: int, optimizer: str
    ) -> EfficiencyInputs:
        """:func:`hetpipe.commands.objective.efficiency_inputs`, progress shown here and the
        calibration's time noted."""
        inputs = efficiency_inputs(calibration, model, batch, optimizer, self)
        self.took = self.seconds if self.runs else None
        return inputs

    def report(self, out: Console) -> None:
        """The runs and seconds a calibration took (nothing without one)."""
        if self.took is not None:
            runs = f"{self.runs} run{'s' if self.runs > 1 else ''}"
            out.print(f"[dim]calibration: {runs} in {self.took:.1f} s[/]")


SUMMARY_VWS = 8
"""Above this many VWs the table shows one VW per kind unless ``--full``."""


def _kinds(plan: Plan) -> list[tuple[VirtualWorker, int]]:
    """One VW per kind (same GPU types, layers and stage times), with how many VWs share it."""
    kinds: dict[tuple[object, ...], list[VirtualWorker]] = {}
    for vw in plan.virtual_workers:
        key = tuple(
            (vw.gpus[s.gpu].type, s.first_index, s.last_index, round(s.time_ms, 6), s.memory)
            for s in vw.stages
        )
        kinds.setdefault(key, []).append(vw)
    return [(vws[0], len(vws)) for vws in kinds.values()]


def _overhead_line(pr: Prediction) -> str:
    """The runtime's own cost the prediction includes, and the prediction without it."""
    waves = (
        f", and {pr.overhead_ms_per_wave:.2f} ms + {pr.overhead_ms_per_mb:.2f} ms per MB of "
        "its parameters per stage per wave"
        if pr.overhead_ms_per_wave or pr.overhead_ms_per_mb
        else ""
    )
    return (
        f"  with the runtime's own cost, {pr.overhead_ms_per_task:.2f} ms per task (the "
        f"cluster's runtime_overhead){waves}; without it {pr.throughput_without_overhead:.1f}"
    )


def render(plan: Plan, full: bool = True) -> None:
    """Print the VW/stage table and the predictions with rich (``full``: every VW; else, above
    :data:`SUMMARY_VWS` VWs, one VW of each kind with its count)."""
    n = len(plan.virtual_workers)
    shown_vws = [(vw, 1) for vw in plan.virtual_workers]
    if not full and n > SUMMARY_VWS:
        shown_vws = _kinds(plan)
    console.print(_stage_table(plan, shown_vws))
    if len(shown_vws) < n:
        console.print(
            f"{n} VWs of {len(shown_vws)} kind{'s' if len(shown_vws) > 1 else ''}: one of each shown "
            "(xN: VWs alike); "
            "--full lists every VW"
        )
    cl = plan.cluster
    console.print(escape(cl.links.describe(cl.emulated)))  # what the runtime paces transfers to
    _render_predictions(plan)


def _stage_table(plan: Plan, shown_vws: list[tuple[VirtualWorker, int]]) -> Table:
    """The table of ``shown_vws`` (each VW with how many VWs alike it stands for): a row per
    stage (its GPU, layers, time and memory), then the VW's Nm cap and throughput."""
    table = Table(
        title=f"{plan.model} (batch {plan.batch_size}) on {plan.cluster.name}: policy {plan.policy}"
    )
    managed = any(s.memory != "keep" for vw in plan.virtual_workers for s in vw.stages)
    cols = ("VW", "stage", "GPU", "layers", "time ms", "memory used/cap")
    for col in (*cols, "WAOG host") if managed else cols:
        table.add_column(col, justify="right" if col in ("time ms", "VW", "stage") else "left")
    for vw, alike in shown_vws:
        for s in vw.stages:
            g = vw.gpus[s.gpu]
            table.add_row(
                (f"{vw.id} {vw.signature}" + (f" (x{alike})" if alike > 1 else ""))
                if s.gpu == 0
                else "",
                str(s.gpu),
                f"{g.node}:{g.index} {g.type}",
                f"{s.first_layer} .. {s.last_layer} ({s.last_index - s.first_index + 1})",
                f"{s.time_ms:.2f}",
                _mem(s.memory_bytes, s.capacity_bytes),
                *((_placement(s),) if managed else ()),
            )
        table.add_row(
            "",
            "",
            "",
            f"[dim]Nm max {vw.nm_max}, {vw.throughput:.1f} samples/s, {_proof(vw)}[/]",
            "",
            "",
            end_section=True,
        )
    return table


def _render_predictions(plan: Plan) -> None:
    """Print what the plan predicts: the AllReduce plan's throughput, or the pipeline's Nm,
    staleness, synchronisation, throughput (with the overhead it charges) and its AllReduce
    baseline; then a note per profile that was estimated rather than measured."""
    pr = plan.predicted
    if get_rule(plan.sync).layout == "ddp":
        console.print(
            f"AllReduce (DDP, BSP) on {len(plan.virtual_workers)} devices that hold the whole "
            f"model: predicted [bold]{pr.throughput:.1f}[/] samples/s ({pr.method})"
        )
        return
    console.print(
        f"Nm = {plan.nm}, D = {plan.D}: local staleness {plan.local_staleness}, global staleness bound "
        f"{plan.global_staleness}; placement {plan.placement}"
    )
    if plan.sync_params:  # a rule with parameters (backup, easgd)
        params = ", ".join(f"{k} {v:g}" for k, v in plan.sync_params)
        console.print(f"synchronisation: {plan.sync} ({params}); see docs/sync.md")
    console.print(
        f"predicted throughput: [bold]{pr.throughput:.1f}[/] samples/s (WSP, straggler-bound, {pr.method})"
    )
    if pr.charges_overhead:
        console.print(_overhead_line(pr))
    if pr.allreduce_gpus:
        console.print(
            f"AllReduce data-parallel baseline: {pr.allreduce_throughput:.1f} samples/s on {pr.allreduce_gpus} GPUs"
        )
    else:
        console.print("AllReduce baseline: no single GPU holds the whole model")
    for t, src in plan.profiles.items():
        if src.startswith(("analytic", "scaled", "emulated")) or "assumed" in src:
            console.print(f"[yellow]note:[/] {t}: {src}")


def _vw_summary(signatures: tuple[str, ...]) -> str:
    """``('VVQQ', 'VVQQ', 'RRGG', 'RRGG')`` -> ``2xVVQQ 2xRRGG`` (alike VWs counted together, in
    order of first appearance)."""
    counts: dict[str, int] = {}
    for sig in signatures:
        counts[sig] = counts.get(sig, 0) + 1
    return " ".join(f"{n}x{_short(sig)}" if n > 1 else _short(sig) for sig, n in counts.items())


def _short(sig: str, limit: int = 24) -> str:
    """A VW's letters, cut to ``limit`` characters with its GPU count (``VRGQVRGQ...(1280)``)."""
    return sig if len(sig) <= limit else f"{sig[:limit]}...({len(sig)})"


def _status(status: str, solve: str) -> str:
    """A candidate's status cell: solved ``exact`` or with a proven ``gap``, the winner marked."""
    if status == "planned":
        return solve
    return f"{status} ({solve})" if solve else status


def render_candidates(rows: list[Candidate], budget_s: float) -> None:
    """The allocations policy ``auto`` compared (best bound first): solved exactly (or with a
    proven gap), cut by the budget or unable to win (with their bound), and the winner; then why
    some were infeasible."""
    table = Table(title=f"policy auto: candidates compared (budget {budget_s:g} CPU s)")
    for col in ("policy", "VWs", "bound/s", "pred/s", "Nm", "CPU s", "status"):
        right = col in ("bound/s", "pred/s", "Nm", "CPU s")
        table.add_column(col, justify="right" if right else "left", no_wrap=col != "VWs")
    reasons: list[str] = []
    for r in rows:
        vws = _vw_summary(r.signatures)
        status = r.status
        if status.startswith("infeasible: "):
            head = vws if len(vws) <= 60 else vws[:57] + "..."
            reasons.append(f"{r.policy} {head}: {status[len('infeasible: ') :]}")
            status = f"infeasible ({len(reasons)})"
        table.add_row(
            r.policy,
            escape(vws if len(vws) <= 40 else vws[:37] + "..."),
            f"{r.bound:.1f}" if r.bound else "-",
            f"{r.throughput:.1f}" if r.throughput else "-",
            str(r.nm) if r.nm else "-",
            f"{r.seconds:.2f}",
            escape(_status(status, r.solve)),
            style="bold" if r.status == "chosen" else None,
        )
    console.print(table)
    for n, reason in enumerate(reasons, 1):
        console.print(f"[dim]({n}) {escape(reason[:300])}[/]")


@with_rule_options
@handle_errors
def plan(  # long by its typer signature (the command's options); the body is under 60 lines
    cluster: Annotated[Path, typer.Argument(help="cluster.yaml")],
    model: Annotated[
        str | None, typer.Option("--model", "-m", help="built-in model or package.module:factory")
    ] = None,
    profiles: Annotated[
        list[Path] | None,
        typer.Option(
            "--profiles", "-p", help="profile CSVs/folders or PipeDream graph.txt (repeatable)"
        ),
    ] = None,
    policy: Annotated[
        str | None,
        typer.Option(
            "--policy", help="np | ed | hd | auto (default: hd where it applies, else ed)"
        ),
    ] = None,
    batch_size: Annotated[
        int | None,
        typer.Option("--batch-size", "-b", help="minibatch size (default: the profiles', else 32)"),
    ] = None,
    nm: Annotated[
        int | None,
        typer.Option(
            "--nm", help="cap on concurrent minibatches per VW (at most what memory allows)"
        ),
    ] = None,
    staleness: Annotated[
        int | None, typer.Option("-D", help="WSP clock-distance threshold D (default 0)")
    ] = None,
    placement: Annotated[str, typer.Option("--placement", help="default | local")] = "default",
    vws: Annotated[int | None, typer.Option("--vws", help="number of virtual workers")] = None,
    optimizer: Annotated[
        str, typer.Option("--optimizer", help="sgd | momentum | adam (memory)")
    ] = "momentum",
    links: Annotated[Path | None, typer.Option("--links", help="measured links.yaml")] = None,
    memory: Annotated[
        str,
        typer.Option(
            "--memory",
            help="keep (default) | auto: offload to host memory or recompute where it pays "
            "(docs/memory.md) | one placement for every stage, e.g. activations:recompute",
        ),
    ] = "keep",
    nm_choice: Annotated[
        str,
        typer.Option("--nm-choice", help="best: fastest predicted Nm | max: largest feasible Nm"),
    ] = "best",
    partitioner: Annotated[
        str, typer.Option("--partitioner", help="dp (exact, default) | milp")
    ] = "dp",
    solver: Annotated[str, typer.Option("--solver", help="auto | highs | cbc")] = "auto",
    profile_gpu: Annotated[
        str | None, typer.Option("--profile-gpu", help="GPU an imported profile was measured on")
    ] = None,
    max_cuts: Annotated[
        int | None,
        typer.Option(
            "--max-cuts",
            help="approximate: coarsen graphs with more candidate cuts (default: exact, every cut)",
        ),
    ] = None,
    time_limit: Annotated[
        float,
        typer.Option(
            "--time-limit",
            help="solver seconds per partition; when hit, the best plan found and its proven gap",
        ),
    ] = 60.0,
    auto_budget: Annotated[
        float,
        typer.Option(
            "--auto-budget",
            help="CPU seconds policy auto may spend solving candidates (shared between them)",
        ),
    ] = 120.0,
    auto_max_vw_gpus: Annotated[
        int, typer.Option("--auto-max-vw-gpus", help="largest VW policy auto tries")
    ] = 16,
    full: Annotated[
        bool,
        typer.Option(
            "--full",
            help=f"list every VW and stage (default above {SUMMARY_VWS} VWs: one VW of each kind)",
        ),
    ] = False,
    output: Annotated[
        Path | None, typer.Option("--output", "-o", help="write the plan (YAML, or JSON if *.json)")
    ] = None,
    as_json: Annotated[
        bool, typer.Option("--json", help="print the plan as JSON on stdout")
    ] = False,
    sync: Annotated[
        str,
        typer.Option(
            "--sync",
            help=sync_help() + " (allreduce: every device that holds the whole model)",
        ),
    ] = DEFAULT_RULE,
    precision: Annotated[
        str,
        typer.Option(help="fp32 | bf16: the memory model's bytes (autocast, fp32 master weights)"),
    ] = "fp32",
    objective: Annotated[str, _opt("objective")] = PLAN_OPTIONS["objective"].default,
    target_samples: Annotated[float, _opt("target_samples")] = PLAN_OPTIONS[
        "target_samples"
    ].default,
    remedy: Annotated[str, _opt("remedy")] = PLAN_OPTIONS["remedy"].default,
    d_text: Annotated[str, _opt("d_values")] = PLAN_OPTIONS["d_values"].default,
    calibrate: Annotated[str | None, _opt("calibrate")] = None,
    lr: Annotated[float | None, typer.Option("--lr", help=_CAL_LR)] = None,
    momentum: Annotated[float | None, typer.Option("--momentum", help=_CAL_MOMENTUM)] = None,
    seed: Annotated[int | None, typer.Option("--seed", help=_CAL_SEED)] = None,
    weight_decay: Annotated[float | None, typer.Option("--weight-decay", help=_CAL_DECAY)] = None,
    calibrate_lr: Annotated[str, _opt("calibrate_lr")] = PLAN_OPTIONS["calibrate_lr"].default,
    rule_values: RuleValues | None = None,
) -> None:
    """Plan HetPipe training (see HELP); ``rule_values``: the rule options
    (:class:`hetpipe._rules.with_rule_options`)."""
    from planner.costmodel import load_links
    from planner.plan_check import check_nm
    from planner.planner import PlanOptions, make_plan

    numbers = {"--batch-size": batch_size, "--nm": nm, "-D": staleness, "--vws": vws,
               "--time-limit": time_limit, "--auto-budget": auto_budget,
               "--auto-max-vw-gpus": auto_max_vw_gpus, "--max-cuts": max_cuts,
               "--lr": lr, "--momentum": momentum, "--seed": seed,
               "--weight-decay": weight_decay}  # fmt: skip
    rule = rule_params(sync, rule_values or {})
    _check_options(numbers, sync, bool(policy or vws or nm or staleness))
    check_values({"objective": objective, "target_samples": target_samples, "remedy": remedy,
                  "calibrate_lr": calibrate_lr}, PLAN_OPTIONS)  # fmt: skip
    calibration = Calibration(calibrate, lr, momentum, calibrate_lr, seed, weight_decay)
    _check_objective(objective, sync, calibration, model, optimizer)
    compared_d = d_values(d_text, staleness, objective)
    cl = load_cluster(cluster)
    out = err_console if as_json else console  # what is not the plan itself
    _pacing_note(cl, out)
    profs = load_profiles(profiles, profile_gpu) if profiles else []
    candidates: list[Candidate] = []
    options = PlanOptions(partitioner=partitioner, solver=solver, max_cuts=max_cuts,
                          nm_choice=nm_choice, memory=memory, time_limit_s=time_limit,
                          auto_max_vw_gpus=auto_max_vw_gpus, auto_budget_s=auto_budget,
                          remedy=remedy)  # fmt: skip
    with out.status(
        f"planning {model or 'the profiled model'} on {cl.name} (profiles, allocation, "
        "partition, Nm, placement, simulation)"
    ):
        kwargs = dict(model=model, batch_size=batch_size, D=staleness or 0, placement=placement,
                      optimizer=optimizer, links=load_links(links) if links else None,
                      reference_type=profile_gpu, precision=precision)  # fmt: skip
        by_policy = partial(make_plan, policy=policy, nm=nm, num_vws=vws, options=options,
                            report=candidates, **kwargs)  # type: ignore[arg-type]  # fmt: skip
        profs, result = _plan_once(cl, profs, sync, kwargs, by_policy)
    if nm is not None:
        check_nm(result, nm)  # the planner caps Nm at what memory allows: say so, do not write
    result = with_objective(apply_rule(result, sync, rule), objective, remedy)
    if objective != "time":
        _emit(result, output, as_json, candidates, auto_budget, full)
        return
    with out.status("ranking plans by time to target") as status:
        said = _Calibrating(status.update)
        inputs = said.inputs(calibration, model, result.batch_size, optimizer)
        result, ranked = choose_for_time(
            result,
            partial(make_plan, cl, profs, **kwargs),  # type: ignore[arg-type]
            options,
            partial(apply_rule, sync=sync, params=rule),
            partial(_allreduce_plan, cl, profs, model, result.batch_size, optimizer),
            inputs,
            target_samples,
            others=other_allocations(candidates, vws_given=vws is not None),
            nm_cap=nm,
            d_candidates=compared_d,
        )
    _emit(result, output, as_json, candidates, auto_budget, full)
    render_objective(ranked, inputs, target_samples, out)
    said.report(out)


_RUN_NUMBERS = ("lr", "momentum", "seed", "weight_decay")
"""The run options ``hetpipe plan`` takes for ``--calibrate-efficiency``."""

_RANGES = {
    "--batch-size": Range(1), "--nm": Range(1), "-D": Range(0), "--vws": Range(1),
    "--time-limit": Range(0, open_low=True), "--auto-budget": Range(0),
    "--auto-max-vw-gpus": Range(1), "--max-cuts": Range(0),
    **{OPTIONS[k].flag: r for k in _RUN_NUMBERS if (r := OPTIONS[k].range)},  # as run's
}  # fmt: skip
"""The values each numeric option of ``hetpipe plan`` takes (``None``: not given)."""


def _check_options(numbers: dict[str, float | None], sync: str, shapes_hetpipe: bool) -> None:
    """Refuse bad option values before any planning (one line each)."""
    for flag, value in numbers.items():
        check_number(flag, value, _RANGES[flag])
    if get_rule(sync).layout == "ddp" and shapes_hetpipe:
        raise ConfigError(
            f"--policy, --vws, --nm and -D shape HetPipe plans; drop them with --sync {sync}"
        )


def _check_objective(
    objective: str, sync: str, calibration: Calibration, model: str | None, optimizer: str
) -> None:
    """Refuse ``--objective time`` where it cannot rank, and calibration it cannot run
    (:meth:`hetpipe.commands.objective.Calibration.check`)."""
    calibrate = calibration.data
    if objective == "time" and sync not in (ranked := time_ranked()):
        raise ConfigError(
            f"--objective time compares HetPipe plans under --sync {' or '.join(ranked)} "
            f"with AllReduce; drop --sync {sync}, or use --objective throughput"
        )
    if calibrate and objective != "time":
        raise ConfigError(
            f"--calibrate-efficiency {shown(calibrate, 40)} feeds --objective time; add it, "
            "or drop --calibrate-efficiency"
        )
    if calibrate and model is None:
        raise ConfigError(
            f"--calibrate-efficiency {shown(calibrate, 40)} trains the model, so needs --model; "
            "give it, or drop --calibrate-efficiency for the defaults"
        )
    calibration.check(optimizer)


def _pacing_note(cl: Cluster, out: Console) -> None:
    """Warn (a plan may run on another machine) when this machine could not pace the
    cluster's emulated devices all at once; ``hetpipe run`` refuses it."""
    import os

    from planner.pacing import pacing_problem

    devices = [(d.label, d.emulation.speed) for d in cl.devices if d.emulation is not None]
    problem = pacing_problem(devices, os.cpu_count() or 1) if devices else None
    if problem is not None:
        out.print(f"[yellow]note:[/] {escape(problem)}; 'hetpipe run' refuses that here")


def _emit(
    result: Plan,
    output: Path | None,
    as_json: bool,
    candidates: list[Candidate],
    budget: float,
    full: bool,
) -> None:
    """Write the plan (``-o``), print it as JSON (``--json``) or render it."""
    if output is not None:
        result.save(output)
    if as_json:
        sys.stdout.write(result.to_json() + "\n")
        if output is not None:
            err_console.print(f"wrote {output}")
        return
    if candidates:
        render_candidates(candidates, budget)
    render(result, full)
    if output is not None:
        console.print(f"wrote {output}")
