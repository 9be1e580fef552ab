"""`hetpipe simulate`: predict a plan's behaviour and draw its pipeline."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from rich.markup import escape
from rich.table import Table

from hetpipe._common import console, handle_errors
from hetpipe._rules import RuleValues, apply_rule, rule_params, sync_help, with_rule_options
from planner.plan import Plan
from planner.plan_check import check_plan_layers
from planner.plan_file import load_plan
from planner.rules import DEFAULT_RULE as REFERENCE
from planner.rules import get_rule
from profiler.errors import ConfigError, HetPipeError
from runtime.options import Range, check_number

if TYPE_CHECKING:
    from planner.sim.types import SimResult
    from profiler.table import Profile

HELP = (
    "Simulate a plan (discrete events: Sec. 4 stage rules, Nm in flight, transfers, WSP) and "
    "print throughput, GPU busy fractions, WSP waiting/idle time and cross-node bytes; "
    "optionally compare with AllReduce and write a Gantt chart and a Chrome trace."
)

_GANTT_WAVES = 6  # the chart shows the first waves only, to stay legible


@with_rule_options
@handle_errors
def simulate(
    plan_path: Annotated[Path, typer.Argument(metavar="PLAN", help="plan.yaml or plan.json")],
    waves: Annotated[int, typer.Option("--waves", help="waves per virtual worker (>= 2)")] = 20,
    baseline: Annotated[
        str | None, typer.Option("--baseline", help="also predict a baseline: 'allreduce'")
    ] = None,
    gantt: Annotated[
        Path | None, typer.Option("--gantt", help="write a Gantt chart (.png or .svg)")
    ] = None,
    trace: Annotated[
        Path | None, typer.Option("--trace", help="write a Chrome-trace JSON (Perfetto)")
    ] = None,
    profiles: Annotated[
        list[Path] | None,
        typer.Option(
            "--profiles",
            help="profile CSVs/folders or PipeDream graph.txt: exact shard traffic and "
            "baseline; needed for a plan whose model hetpipe cannot build (imported profiles)",
        ),
    ] = None,
    actions: Annotated[
        bool,
        typer.Option(
            "--actions", help="print each stage's simulated task order of the first two waves"
        ),
    ] = False,
    overhead_ms_per_task: Annotated[
        float | None,
        typer.Option(
            "--overhead-ms-per-task",
            help="the runtime's own cost of every task, added to it (what 'hetpipe run "
            "--profile-runtime' reports as overhead ms/task; 0: none; default: the plan's "
            "predicted.overhead_ms_per_task)",
        ),
    ] = None,
    sync: Annotated[
        str | None,
        typer.Option(help=sync_help() + "; simulate the plan under this rule (default: its own)"),
    ] = None,
    rule_values: RuleValues | None = None,
) -> None:
    """Simulate ``PLAN`` and print the prediction; ``sync`` and ``rule_values`` (the rule
    options, :class:`hetpipe._rules.with_rule_options`) re-synchronise it first."""
    from planner.sim.simulator import simulate as run_simulation

    check_number("--waves", waves, Range(2), 20)
    if overhead_ms_per_task is not None:
        check_number("--overhead-ms-per-task", overhead_ms_per_task, Range(0), 0.0)
    if baseline not in (None, "allreduce"):
        raise ConfigError(f"--baseline {baseline!r}: the only baseline is 'allreduce'")
    if gantt is not None and gantt.suffix.lower() not in (".png", ".svg"):
        raise ConfigError(f"--gantt {gantt}: use a .png or .svg file name")
    plan = _with_rule(load_plan(plan_path), sync, rule_values or {})  # validated plan
    by_type = _checked_profiles(plan, plan_path, profiles or [])
    _refuse_timeless(plan, plan_path)
    if get_rule(plan.sync).layout == "ddp":
        _show_allreduce(plan)
        return
    source = "--profiles" if by_type else ""
    if not by_type:
        by_type = _analytic_profiles(plan)
        source = "analytic profiles" if by_type else "estimated from the plan"
    any_profile = next(iter(by_type.values()), None)
    record = gantt is not None or trace is not None or actions
    res = run_simulation(plan, waves, any_profile, record, overhead_ms_per_task)
    title = (
        f"{plan.model} (batch {plan.batch_size}), policy {plan.policy}, Nm={plan.nm}, D={plan.D}, "
        f"schedule {plan.schedule}, placement {plan.placement}: {len(plan.virtual_workers)} VWs, "
        f"{waves} waves"
    )
    _show(plan, res, title)
    if actions:
        _show_actions(plan, res)
    _show_rules(plan, waves, any_profile)
    if baseline == "allreduce":
        _show_baseline(plan, res, by_type, waves, source)
    _pictures(plan, res, title, waves, gantt, trace)


def _show_actions(plan: Plan, res: SimResult, waves: int = 2) -> None:
    """Each VW's simulated task order per stage over its first ``waves`` waves, printed as the
    schedule's action lists are (:func:`planner.schedule.format_actions`)."""
    from planner.schedule import Kind, Task, format_actions

    last = waves * plan.nm
    for i, vw in enumerate(plan.virtual_workers):
        per_stage: list[list[Task]] = [[] for _ in vw.stages]
        for e in res.trace:  # in start order
            if e.vw == i and e.stage >= 0 and e.cat in ("F", "B", "FB") and e.mb <= last:
                per_stage[e.stage].append(Task(e.stage, Kind(e.cat), e.mb))
        console.print(f"VW {vw.id}, schedule {escape(plan.schedule)}, waves 0-{waves - 1}:")
        console.print(escape(format_actions(per_stage)), soft_wrap=True)


def _checked_profiles(plan: Plan, path: Path, paths: list[Path]) -> dict[str, Profile]:
    """The ``--profiles`` by GPU type, after the checks ``hetpipe run`` makes on the plan and
    its model (:func:`runtime.launch.admit.check_plan_model`): with profiles, their layers and
    bytes stand in for the model (a plan of imported profiles, whose model hetpipe cannot
    build, can be simulated); without, the model must build as it must to run."""
    from hetpipe.commands.plan import load_profiles
    from runtime.launch.admit import check_plan_model, check_static_memory

    by_type: dict[str, Profile] = {}
    for prof in load_profiles(paths, None) if paths else []:
        what = f"the --profiles profile of {prof.meta.model!r} on {prof.meta.device_type!r}"
        check_plan_layers(plan, prof.layers, str(path), what)
        by_type.setdefault(prof.meta.device_type, prof)
    if not by_type:
        check_plan_model(plan, str(path))
        return by_type
    table = next(iter(by_type.values())).table
    sizes = list(zip(table["param_bytes"].tolist(), table["buffer_bytes"].tolist(), strict=True))
    check_static_memory(plan, sizes, str(path))
    return by_type


def _refuse_timeless(plan: Plan, path: Path) -> None:
    """Refuse a VW whose every stage takes 0 ms (a plan made by hand without stage times, as the
    Python API's: ``run`` measures them, the simulator has nothing to play)."""
    for i, vw in enumerate(plan.virtual_workers):
        if all(st.fwd_ms + st.bwd_ms + st.recv_fwd_ms + st.recv_bwd_ms == 0 for st in vw.stages):
            raise ConfigError(
                f"{path}: virtual_workers[{i}].stages: every stage takes 0 ms (a plan made "
                "without stage times); simulate a plan made by 'hetpipe plan'"
            )


def _show(plan: Plan, res: SimResult, title: str) -> None:
    """The simulated VWs as a table and the totals line."""
    vt = Table(title=escape(title))
    for col in (
        "VW",
        "GPUs",
        "samples/s",
        "waiting s",
        "idle s",
        "idle/wait",
        "GPU busy",
        "max in flight",
    ):
        vt.add_column(col, justify="right" if col != "GPUs" else "left")
    for i, vw in enumerate(plan.virtual_workers):
        vt.add_row(
            str(vw.id),
            escape(vw.signature),
            f"{res.per_vw_throughput[i]:.1f}",
            f"{res.waiting_s[i]:.3f}",
            f"{res.idle_s[i]:.3f}",
            f"{res.idle_fraction[i]:.0%}",
            " ".join(f"{b:.0%}" for b in res.gpu_busy[i]),
            " ".join(str(m) for m in res.max_in_flight[i]),
        )
    console.print(vt)
    console.print(
        f"throughput: [bold]{res.throughput:.1f} samples/s[/] (simulated; plan's analytic "
        f"prediction {plan.predicted.throughput:.1f})   makespan {res.makespan_s:.3f} s   "
        f"cross-node {res.cross_node_bytes / 1e9:.3f} GB   max clock distance "
        f"{res.max_clock_distance} (bound D+1 = {plan.D + 1})   {res.events} events"
    )


def _show_baseline(
    plan: Plan, res: SimResult, by_type: dict[str, Profile], waves: int, source: str
) -> None:
    """``--baseline allreduce``: the AllReduce prediction beside HetPipe's."""
    from planner.sim.simulator import allreduce_for_plan

    ar = allreduce_for_plan(plan, by_type or None)
    samples = waves * plan.nm * plan.batch_size * len(plan.virtual_workers)
    hp_per_sample = res.cross_node_bytes / samples
    if ar.gpus == 0:
        console.print("AllReduce baseline: no GPU can hold the whole model")
        return
    console.print(
        f"AllReduce (BSP, ring) on {ar.gpus} GPUs: [bold]{ar.throughput:.1f} samples/s[/] "
        f"(step {ar.iteration_ms:.2f} ms, all-reduce {ar.allreduce_ms:.2f} ms, "
        f"{ar.cross_node_bytes_per_iter / (ar.gpus * plan.batch_size) / 1e6:.3f} MB across "
        f"nodes per sample vs HetPipe {hp_per_sample / 1e6:.3f}); HetPipe / "
        f"AllReduce = {res.throughput / ar.throughput:.2f}x"
        + f" [dim](whole-model times: {source})[/]"
    )


def _pictures(
    plan: Plan, res: SimResult, title: str, waves: int, gantt: Path | None, trace: Path | None
) -> None:
    """``--gantt`` (the first waves) and ``--trace`` (every event, for Perfetto)."""
    from planner.draw import write_chrome_trace, write_gantt

    labels = [
        [f"{vw.gpus[s.gpu].node}:{vw.gpus[s.gpu].index}" for s in vw.stages]
        for vw in plan.virtual_workers
    ]
    if gantt is not None:
        c0 = res.completions_ms[0]
        until = c0[min(len(c0), _GANTT_WAVES * plan.nm) - 1]
        shown = min(_GANTT_WAVES, waves)
        head = title.rsplit(", ", 1)[0]  # the table's title without "N waves"
        write_gantt(
            res.trace,
            gantt,
            labels,
            until_ms=until,
            title=f"{head}: waves 0-{shown - 1} of {waves} (VW 0)",
        )
        console.print(f"Gantt chart (first {shown} of {waves} waves): {gantt}")
    if trace is not None:
        write_chrome_trace(res.trace, trace, labels)
        console.print(f"Chrome trace (open in https://ui.perfetto.dev): {trace}")


def _with_rule(plan: Plan, sync: str | None, given: RuleValues) -> Plan:
    """``plan`` under rule ``sync`` (``None``: its own) with the rule options ``given`` (for
    its own rule: over the plan's values)."""
    if sync is None and not any(v is not None for v in given.values()):
        return plan
    rule = plan.sync if sync is None else sync
    params = rule_params(rule, given)
    if rule == plan.sync:
        params = {**dict(plan.sync_params), **params}
    return apply_rule(plan, rule, params)


def _show_rules(plan: Plan, waves: int, profile: Profile | None) -> None:
    """With stragglers in the cluster or a rule other than WSP: the rules played on whole waves
    (:mod:`planner.sim.waves`): WSP at D = 0 and the plan's D, and the plan's rule."""
    from planner.sim.waves import plan_slowdown, play_waves, vw_wave_ms
    from planner.sync import SyncParams
    from runtime.results.sync import describe_rule

    slow = plan_slowdown(plan)
    n = len(plan.virtual_workers)
    stragglers = any(slow(v, c) > 1 for v in range(n) for c in range(waves))
    own = get_rule(plan.sync).play is not None and plan.sync != REFERENCE
    if not stragglers and not own:
        return
    rows: list[tuple[str, str, SyncParams, int]] = [
        (describe_rule(REFERENCE, (), D), REFERENCE, (), D) for D in sorted({0, plan.D})
    ]
    if own:
        rows.append((describe_rule(plan.sync, plan.sync_params, plan.D), plan.sync,
                     plan.sync_params, plan.D))  # fmt: skip
    wave_ms = vw_wave_ms(plan, profile)
    title = f"rules on whole waves, {waves} waves{' with stragglers' if stragglers else ''}"
    table = Table(title=title)
    for col in ("rule", "applied samples/s", "dropped VW-waves", "k-th push after the first (ms)"):
        table.add_column(col, justify="left" if col == "rule" else "right")
    for name, rule, params, D in rows:
        play = play_waves(rule, wave_ms, waves, plan.nm, slow, D=D, **dict(params))
        full = [a for a in play.arrivals_ms if len(a) == n]
        kth = [sum(a[k] - a[0] for a in full) / len(full) for k in range(n)] if full else []
        table.add_row(
            escape(name),
            f"{play.throughput(plan.batch_size):.1f}",
            str(play.dropped),
            " ".join(f"{t:.1f}" for t in kth),
        )
    console.print(table)


def _show_allreduce(plan: Plan) -> None:
    """The prediction of an AllReduce plan (BSP: no pipeline, nothing to draw)."""
    from planner.sim.simulator import allreduce_for_plan

    ar = allreduce_for_plan(plan)
    table = Table(title=escape(f"{plan.model} (batch {plan.batch_size} per device): AllReduce"))
    for col in ("devices", "samples/s", "step ms", "all-reduce ms", "cross-node MB/step"):
        table.add_column(col, justify="left" if col == "devices" else "right")
    table.add_row(
        escape(" ".join(ar.labels)),
        f"{ar.throughput:.1f}",
        f"{ar.iteration_ms:.2f}",
        f"{ar.allreduce_ms:.2f}",
        f"{ar.cross_node_bytes_per_iter / 1e6:.3f}",
    )
    console.print(table)
    console.print(
        "BSP data parallelism: every step waits for the slowest device, then a ring "
        "all-reduce of the gradients (planner.predict.simulate_allreduce)"
    )


def _analytic_profiles(plan: Plan) -> dict[str, Profile]:
    """Analytic profiles of the plan's model for its cluster's GPU types, or {} if unavailable.

    They give the exact layer-to-shard split and the AllReduce baseline's whole-model times.
    """
    from profiler.analytic import analytic_profile

    types = sorted({n.gpu_type for n in plan.cluster.nodes})
    try:
        return {t: analytic_profile(plan.model, plan.batch_size, t) for t in types}
    except HetPipeError:  # not a model the analytic profiler knows: estimate from the plan
        return {}
