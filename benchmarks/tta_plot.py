"""The time-to-accuracy benchmark's figure: every run's test metric against training time and
against training samples (``benchmarks/bench_tta.py`` writes it beside its JSON)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from benchmarks.tta_plans import TITLES


def plot(results: dict[str, dict[str, Any]], path: Path) -> None:
    """Per workload, the metric against training time and against samples: every seed of every
    system (the target dashed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(results), 2, figsize=(11, 4 * len(results)), squeeze=False)
    colours = {"hetpipe": "tab:blue", "ddp": "tab:orange", "hetpipe-time": "tab:green"}
    for row, (name, res) in zip(axes, results.items(), strict=True):
        w = res["workload"]
        for ax, x, xlabel in ((row[0], "train_s", "training time (s)"),
                              (row[1], "samples", "training samples")):  # fmt: skip
            for system, runs in res["runs"].items():
                for k, r in enumerate(runs):
                    ax.plot([p[x] for p in r["points"]], [p[w["metric"]] for p in r["points"]],
                            color=colours[system], alpha=0.8, lw=1.2, marker=".",
                            ls="--" if system == "hetpipe-time" else "-",
                            label=f"{TITLES[system]} (lr {r['lr']:g})" if k == 0 else None)  # fmt: skip
            ax.axhline(w["target"], color="grey", lw=0.8, ls="--")
            ax.set_xlabel(xlabel)
            ax.set_ylabel(f"test {w['metric']}")
            ax.set_title(f"{name}: {w['title']}", fontsize=10)
            ax.grid(alpha=0.3)
            ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
