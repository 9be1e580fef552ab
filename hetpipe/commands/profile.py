"""`hetpipe profile`: measure, estimate, scale or import per-layer profiles, or profile links."""

from __future__ import annotations

import re
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from hetpipe._common import console, handle_errors
from profiler.errors import ConfigError

if TYPE_CHECKING:  # heavy (torch, pandas): imported where a command needs them
    from profiler.measure import Progress as ProgressFn
    from profiler.table import Profile

HELP = (
    "Profile a model per layer (forward/backward ms, activation, saved and parameter bytes) on "
    "this device, estimate it for a catalog GPU type (--analytic), scale a profile to another type "
    "(--scale), import a PipeDream graph.txt (--import-pipedream), or measure link latency and "
    "bandwidth (--links). Writes CSV profiles (one per model, GPU type and batch size) or links.yaml."
)


def _slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-") or "x"


def _target(output: Path, prof: Profile) -> Path:
    """``output`` itself if it names a .csv file, else a file named after the profile inside it."""
    if output.suffix.lower() == ".csv":
        return output
    m = prof.meta
    return (
        output / f"{_slug(m.model.rsplit(':', 1)[-1])}_{_slug(m.device_type)}_b{m.batch_size}.csv"
    )


@contextmanager
def _progress(label: str) -> Iterator[ProgressFn]:
    """A rich progress bar as a ``progress(done, total, name)`` callback."""
    with Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("{task.fields[layer]}"),
        TimeElapsedColumn(),
        console=console,
        transient=True,
    ) as bar:
        task = bar.add_task(label, total=None, layer="")

        def update(done: int, total: int, name: str) -> None:
            bar.update(task, completed=done, total=total, layer=name)

        yield update


def _summary(prof: Profile, path: Path) -> None:
    t = prof.table
    table = Table(
        title=f"{prof.meta.model} on {prof.meta.device_type}, batch {prof.meta.batch_size} ({prof.meta.source})"
    )
    for col in ("layers", "fwd ms", "bwd ms", "params MiB", "saved MiB", "GFLOP fwd"):
        table.add_column(col, justify="right")
    table.add_row(
        str(len(t)),
        f"{t['fwd_ms'].sum():.3f}",
        f"{t['bwd_ms'].sum():.3f}",
        f"{t['param_bytes'].sum() / 2**20:.2f}",
        f"{t['saved_bytes'].sum() / 2**20:.2f}",
        f"{t['flops'].sum() / 1e9:.3f}",
    )
    console.print(table)
    console.print(f"wrote {path}", highlight=False, soft_wrap=True)


def _one_mode(**modes: bool) -> str:
    chosen = [name for name, on in modes.items() if on]
    if len(chosen) > 1:
        raise ConfigError(f"choose one of --{', --'.join(chosen)}, not several")
    return chosen[0] if chosen else "measure"


def _check_batch(batch_size: int) -> None:
    if batch_size <= 0:
        raise ConfigError(f"--batch-size must be a positive integer, got {batch_size}")


@handle_errors
def profile(  # long only by its typer signature (the command's options); the body is ~25 lines
    output: Annotated[
        Path, typer.Option("-o", "--output", help="profile .csv, or a folder (profile set)")
    ],
    model: Annotated[
        str | None,
        typer.Option(
            "--model",
            "-m",
            help="built-in name (mlp, resnet, transformer, vgg19, resnet152) or pkg.mod:factory",
        ),
    ] = None,
    batch_size: Annotated[
        int | None,
        typer.Option(
            "--batch-size", "-b", help="minibatch size [default: 32; 64 for --import-pipedream]"
        ),
    ] = None,
    device: Annotated[
        str, typer.Option("--device", help="where to measure: cpu, cuda or cuda:N")
    ] = "cpu",
    device_type: Annotated[
        list[str] | None,
        typer.Option(
            "--device-type",
            help='GPU type(s) to record or estimate, e.g. "TITAN V" (repeatable with --analytic/--scale)',
        ),
    ] = None,
    repeats: Annotated[int, typer.Option("--repeats", help="timed passes (median kept)")] = 5,
    warmup: Annotated[int, typer.Option("--warmup", help="untimed passes before them")] = 2,
    clock: Annotated[
        str, typer.Option("--clock", help="CPU clock: wall or cpu (thread CPU time)")
    ] = "wall",
    threads: Annotated[
        int | None, typer.Option("--threads", help="torch intra-op threads on CPU")
    ] = None,
    analytic: Annotated[
        bool, typer.Option("--analytic", help="estimate with the roofline model (no GPU needed)")
    ] = False,
    calibrate_from: Annotated[
        Path | None,
        typer.Option(
            "--calibrate", help="measured profile to calibrate --analytic efficiencies on"
        ),
    ] = None,
    scale: Annotated[
        Path | None, typer.Option("--scale", help="scale this profile to --device-type")
    ] = None,
    import_pipedream_path: Annotated[
        Path | None, typer.Option("--import-pipedream", help="import a PipeDream graph.txt")
    ] = None,
    links: Annotated[
        bool, typer.Option("--links", help="measure point-to-point link latency and bandwidth")
    ] = False,
    precision: Annotated[
        str, typer.Option(help="fp32 | bf16: measure under bfloat16 autocast")
    ] = "fp32",
    peer: Annotated[
        str | None,
        typer.Option(
            "--peer",
            help="--links between two hosts: ADDR:PORT that --peer-rank 0's host serves "
            "(docs/multihost.md)",
        ),
    ] = None,
    peer_rank: Annotated[
        int, typer.Option("--peer-rank", help="with --peer: 0 on one host (writes), 1 on the other")
    ] = 0,
) -> None:
    """Write per-layer profiles (or links.yaml) to ``-o``."""
    mode = _one_mode(
        analytic=analytic,
        scale=scale is not None,
        **{"import-pipedream": import_pipedream_path is not None},
        links=links,
    )
    if threads is not None:
        if threads < 1:
            raise ConfigError(f"--threads must be >= 1, got {threads}")
        import torch

        torch.set_num_threads(threads)
    types = device_type or []
    if mode == "links":
        _links(output, repeats, warmup, peer, peer_rank)
    elif mode == "import-pipedream":
        _import(import_pipedream_path or Path(), output, batch_size, types)
    elif mode == "scale":
        _scale(scale or Path(), output, types)
    elif model is None:
        raise ConfigError("--model is required (or use --import-pipedream / --links / --scale)")
    elif mode == "analytic":
        _analytic(model, output, batch_size, types, calibrate_from)
    else:
        _measure(model, output, batch_size, types, device, repeats, warmup, clock, precision)


def _links(output: Path, repeats: int, warmup: int, peer: str | None, peer_rank: int) -> None:
    """``--links``: measure this host's point-to-point latency and bandwidth (``peer``: the
    link to another host, ``inter_node``)."""
    from rich.markup import escape

    from profiler.links import DEFAULT_SIZES, measure_link_to, measure_links, save_links

    target = output if output.suffix.lower() in (".yaml", ".yml") else output / "links.yaml"
    if peer is not None:
        with console.status(f"measuring the link to {escape(peer)} (ping-pong, rank {peer_rank})"):
            got = measure_link_to(peer, peer_rank, DEFAULT_SIZES, max(repeats, 1), warmup)
        if got is None:
            console.print(f"echoed for rank 0 at {peer}; its host writes links.yaml", markup=False)
            return
        fit = got
    else:
        with console.status("measuring links (2 processes, ping-pong)"):
            fit = measure_links(DEFAULT_SIZES, repeats=max(repeats, 1), warmup=warmup)
    save_links([fit], target)
    console.print(
        f"{fit.link_class} ({fit.backend}): latency {fit.latency_s * 1e6:.1f} us, bandwidth "
        f"{fit.bandwidth_bps / 1e9:.3f} GB/s (r2 {fit.r2:.3f}) -> {target}"
    )


def _import(path: Path, output: Path, batch_size: int | None, types: list[str]) -> None:
    """``--import-pipedream``: a PipeDream graph.txt as a profile (batch 64 by default)."""
    from profiler.pipedream import import_pipedream

    bs = 64 if batch_size is None else batch_size
    _check_batch(bs)
    prof = import_pipedream(path, batch_size=bs, device_type=types[0] if types else "unknown GPU")
    _summary(prof, prof.save(_target(output, prof)))


def _scale(source: Path, output: Path, types: list[str]) -> None:
    """``--scale``: a profile scaled to each ``--device-type``."""
    from profiler.analytic import scale_profile
    from profiler.table import load_profile

    if not types:
        raise ConfigError("--scale needs --device-type (the GPU type(s) to scale to)")
    src = load_profile(source)
    for t in types:
        prof = scale_profile(src, t)
        _summary(prof, prof.save(_target(output, prof)))


def _analytic(
    model: str, output: Path, batch_size: int | None, types: list[str], calibrate_from: Path | None
) -> None:
    """``--analytic``: roofline estimates for each ``--device-type`` (all estimated before
    any file is written)."""
    from profiler.analytic import analytic_profile, calibrate
    from profiler.table import load_profile

    bs = 32 if batch_size is None else batch_size
    _check_batch(bs)
    if not types:
        raise ConfigError('--analytic needs --device-type, e.g. --device-type "TITAN V"')
    cal = calibrate(load_profile(calibrate_from)) if calibrate_from is not None else None
    profiles = [analytic_profile(model, bs, t, cal) for t in types]
    for prof in profiles:
        _summary(prof, prof.save(_target(output, prof)))


def _measure(
    model: str,
    output: Path,
    batch_size: int | None,
    types: list[str],
    device: str,
    repeats: int,
    warmup: int,
    clock: str,
    precision: str,
) -> None:
    """Measure ``model`` layer by layer on ``device`` (``precision``: fp32 or bf16 autocast)."""
    from profiler.measure import measure_profile, parse_device
    from profiler.models import resolve_model

    bs = 32 if batch_size is None else batch_size
    _check_batch(bs)
    if len(types) > 1:
        raise ConfigError(f"a measured profile has one --device-type, got {len(types)}")
    dev = parse_device(device)
    spec = resolve_model(model, bs)
    with _progress(f"profiling {model} (batch {bs}) on {dev}") as update:
        prof = measure_profile(
            spec, dev, types[0] if types else None, repeats, warmup, update, clock, precision
        )
    _summary(prof, prof.save(_target(output, prof)))
