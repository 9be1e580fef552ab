"""The ``hetpipe`` command line: profile -> plan -> simulate -> run.

Each sub-command lives in ``hetpipe/commands/<name>.py`` and registers itself here.
"""

from __future__ import annotations

import typer

from hetpipe.commands import cluster as cluster_cmd
from hetpipe.commands import plan as plan_cmd
from hetpipe.commands import profile as profile_cmd
from hetpipe.commands import run as run_cmd
from hetpipe.commands import simulate as simulate_cmd
from hetpipe.commands import timeline as timeline_cmd

__all__ = ["app", "main"]

app = typer.Typer(
    name="hetpipe",
    help=(
        "Train large DNNs on heterogeneous GPU clusters (HetPipe, USENIX ATC'20): pipelined model "
        "parallelism inside virtual workers, Wave Synchronous Parallel data parallelism across them."
    ),
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
app.command("profile", help=profile_cmd.HELP)(profile_cmd.profile)
app.command("plan", help=plan_cmd.HELP)(plan_cmd.plan)
app.command("simulate", help=simulate_cmd.HELP)(simulate_cmd.simulate)
app.command("run", help=run_cmd.HELP)(run_cmd.run)
app.command("cluster", help=cluster_cmd.HELP)(cluster_cmd.cluster)
app.command("timeline", help=timeline_cmd.HELP)(timeline_cmd.timeline)


def main() -> None:
    """Console-script entry point."""
    app()
