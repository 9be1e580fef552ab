"""`hetpipe cluster`: validate a cluster.yaml and show its devices and links."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.markup import escape
from rich.table import Table

from hetpipe._common import console, handle_errors
from planner.cluster import load_cluster

HELP = "Validate a cluster.yaml and show its nodes, GPUs (catalog specs) and links."


@handle_errors
def cluster(
    path: Annotated[Path, typer.Argument(help="cluster.yaml to check", show_default=False)],
) -> None:
    """Validate ``path`` and print a table of its nodes."""
    spec = load_cluster(path)
    # names are user text: escaped, so '[/x]' in one is shown, not read as rich markup
    table = Table(title=escape(f"cluster {spec.name!r} ({len(spec.devices)} GPUs)"))
    for col in ("node", "host", "GPU type", "count", "memory", "emulated speed", "emulated memory"):
        table.add_column(col)
    for n in spec.nodes:
        emu = n.emulation
        table.add_row(
            escape(n.name),
            escape(n.host),
            escape(f"{n.gpu_type} ({n.letter})"),
            str(n.count),
            f"{n.memory_bytes / 2**30:.1f} GiB",
            f"{emu.speed:g}" if emu else "-",
            f"{emu.memory_bytes / 2**20:.1f} MiB" if emu else "-",
        )
    console.print(table)
    for name, link in (("intra-node", spec.intra_node), ("inter-node", spec.inter_node)):
        console.print(
            f"{name}: {link.bandwidth_bps / 1e9:.2f} GB/s, latency {link.latency_s * 1e6:.1f} us"
        )
    if spec.emulated:  # hetpipe run paces every transfer to these links, times the scale
        console.print(f"emulated links: every transfer paced, x{spec.link_scale:g} (links.scale)")
