"""`hetpipe timeline`: redraw a finished run's measured pipeline for any time window."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.markup import escape

from hetpipe._common import console, handle_errors

HELP = (
    "Redraw the measured timeline of a run from the trace.json it wrote into --out: any time "
    "window (seconds from the run's first task), compute rows, pushes and WSP waits."
)


@handle_errors
def timeline(
    run_dir: Annotated[
        Path,
        typer.Argument(metavar="RUN_DIR", help="the run's --out directory (or its trace.json)"),
    ],
    window: Annotated[
        str, typer.Option("--window", help="START:END seconds, e.g. 2:2.5 ('2:' = to the end)")
    ] = "0:",
    out: Annotated[
        Path | None,
        typer.Option("-o", "--out", help="picture (.png/.svg); default RUN_DIR/timeline-A-Bs.png"),
    ] = None,
) -> None:
    """Draw ``RUN_DIR``'s timeline for ``--window``."""
    from runtime.results.timeline import draw_window, parse_window

    path = draw_window(run_dir, parse_window(window), out)
    console.print(f"timeline: {escape(str(path))}")
