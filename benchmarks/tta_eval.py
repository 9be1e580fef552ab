"""A finished run's curve for the time-to-accuracy benchmark: every snapshot it kept, evaluated
offline, placed at its samples and its training time.

A run of ``hetpipe run --checkpoint-every K --keep 0 --out DIR`` keeps a committed snapshot
every ``K`` global clocks (WSP: a clock is a wave of ``Nm`` minibatches per VW; AllReduce: a
step). Snapshot ``c`` holds every VW's minibatches ``1 .. c x per_clock``; its **training
time** is when the last VW finished minibatch ``c x per_clock`` (``done_s`` in
``vw<k>/metrics.csv``), minus when the run's first minibatch finished: process start-up,
planning and model building (everything before the first minibatch, reported separately as
``startup_s``) are left out, so are the run's final evaluation and outputs. Each snapshot's
model (the shards' global weights, or AllReduce's VW 0 copy; batch-norm statistics merged
over the VWs as the run's own export does) is loaded into the model built once and tested on
the run's test set in this process, after the run.
"""

from __future__ import annotations

import csv
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["Point", "Timing", "evaluate_run", "run_timing", "time_to_target"]


@dataclass(frozen=True)
class Point:
    """One snapshot of a run, evaluated.

    Attributes:
        clock: its global clock.
        samples: training samples every VW together had trained on.
        train_s: training time (seconds from the first minibatch) when it was taken.
        accuracy: test accuracy (fraction; NaN for a language model).
        loss: mean test loss (nats).
    """

    clock: int
    samples: int
    train_s: float
    accuracy: float
    loss: float


@dataclass(frozen=True)
class Timing:
    """When a run's minibatches finished (``metrics.csv``, first attempt).

    Attributes:
        startup_s: seconds from the launch to the first finished minibatch.
        done_s: per VW, minibatch (1-based) -> seconds from the launch when it finished.
    """

    startup_s: float
    done_s: tuple[dict[int, float], ...]

    def train_s(self, minibatch: int) -> float | None:
        """Training time when every VW had finished ``minibatch`` (``None``: one had not)."""
        if any(minibatch not in vw for vw in self.done_s):
            return None
        return max(vw[minibatch] for vw in self.done_s) - self.startup_s


def run_timing(run_dir: Path) -> Timing:
    """The minibatch finish times of a run directory's ``vw<k>/metrics.csv`` (attempt 0,
    incarnation 0: these runs never restart).

    Raises:
        ValueError: the directory has no rows.
    """
    paths = sorted(run_dir.glob("vw*/metrics.csv"), key=lambda p: int(p.parent.name[2:]))
    return timing_of(_read_rows(p) for p in paths)


def _read_rows(path: Path) -> list[dict[str, str]]:
    with path.open(newline="", encoding="utf-8") as f:
        return list(csv.DictReader(f))


def timing_of(per_vw: Iterable[Sequence[dict[str, str]]]) -> Timing:
    """:class:`Timing` from each VW's ``metrics.csv`` rows.

    >>> t = timing_of([[{"attempt": "0", "incarnation": "0", "minibatch": "1", "done_s": "4.0"},
    ...                 {"attempt": "0", "incarnation": "0", "minibatch": "2", "done_s": "5.0"}],
    ...                [{"attempt": "0", "incarnation": "0", "minibatch": "1", "done_s": "4.5"},
    ...                 {"attempt": "0", "incarnation": "0", "minibatch": "2", "done_s": "6.0"}]])
    >>> t.startup_s, t.train_s(2), t.train_s(3)
    (4.0, 2.0, None)
    """
    done = tuple(
        {
            int(r["minibatch"]): float(r["done_s"])
            for r in rows
            if r["attempt"] == "0" and r["incarnation"] == "0"
        }
        for rows in per_vw
    )
    firsts = [vw[1] for vw in done if 1 in vw]
    if not firsts:
        raise ValueError("no VW finished a minibatch: the run trained nothing")
    return Timing(min(firsts), done)


def time_to_target(
    points: Sequence[Point], target: float, metric: str, axis: str = "train_s"
) -> float | None:
    """Training time (``axis="samples"``: training samples) at which the curve first reaches
    ``target`` (``metric``: ``accuracy``, higher is better, or ``loss``, lower is better),
    interpolated linearly between the snapshot before and the first one that reaches it (the
    first snapshot's own when that one does; ``None``: never reached).

    >>> pts = [Point(1, 10, 1.0, 0.5, 2.0), Point(2, 20, 3.0, 1.0, 1.0)]
    >>> time_to_target(pts, 0.75, "accuracy"), time_to_target(pts, 1.5, "loss", "samples")
    (2.0, 15.0)
    >>> time_to_target(pts, 1.01, "accuracy") is None
    True
    """
    sign = 1.0 if metric == "accuracy" else -1.0
    prev: Point | None = None
    for p in sorted(points, key=lambda q: q.clock):
        value, x = sign * getattr(p, metric), float(getattr(p, axis))
        if value >= sign * target:
            if prev is None:
                return x
            v0, x0 = sign * getattr(prev, metric), float(getattr(prev, axis))
            return x if value == v0 else x0 + (x - x0) * (sign * target - v0) / (value - v0)
        prev = p
    return None


def evaluate_run(run_dir: Path, data: str, seed: int) -> tuple[list[Point], float]:
    """Every committed snapshot of the finished run in ``run_dir`` (its ``plan.json`` and
    ``checkpoints/``), evaluated on the run's test set, and the run's start-up seconds."""
    from planner.plan_file import load_plan
    from runtime.config import ModelSource
    from runtime.data_source import named_data
    from runtime.persist.snapshot import committed_clocks, read_manifest, snapshot_dir
    from runtime.results.export import snapshot_result

    plan = load_plan(run_dir / "plan.json")
    source = ModelSource(ref=plan.model)
    dataset = named_data(data, plan.model, plan.batch_size, seed)
    if dataset is None:
        raise ValueError(f"--data {data!r}: the benchmark needs a data factory")
    _, test = dataset.split(0.2, seed)  # the run's own test set (RunSpec.data.test_fraction)
    nm = 1 if plan.sync == "allreduce" else plan.nm
    specs = _shard_specs(plan, source) if plan.sync != "allreduce" else ()
    timing = run_timing(run_dir)
    tester = _Tester(source, plan.batch_size, seed, test)
    workers = len(plan.virtual_workers)
    points = []
    folder = run_dir / "checkpoints"
    for clock in committed_clocks(folder):
        train_s = timing.train_s(clock * nm)
        if train_s is None:
            continue
        manifest = read_manifest(snapshot_dir(folder, clock))
        state = snapshot_result(manifest, plan, source, specs, nm, plan.D).state_dict()
        acc, loss = tester(state)
        samples = clock * nm * plan.batch_size * workers
        points.append(Point(clock, samples, train_s, acc, loss))
    return points, timing.startup_s


def _shard_specs(plan: Any, source: Any) -> tuple[Any, ...]:
    """The plan's parameter-server shard specs (how each shard's flat weights unflatten)."""
    from profiler.graph import ModelGraph
    from runtime.launch.wsp import shard_specs
    from runtime.stage.model import resolve_source

    spec = resolve_source(source, plan.batch_size, meta=True)
    shapes = {n: tuple(p.shape) for n, p in spec.module.named_parameters()}
    return shard_specs(plan, ModelGraph.from_spec(spec), shapes, plan.D)[0]


class _Tester:
    """The whole model built once; each call loads a state and evaluates it (as
    :func:`runtime.results.run_result.evaluate` does for a model reference)."""

    def __init__(self, source: Any, batch_size: int, seed: int, test: Any) -> None:
        from runtime.stage.model import build_stage

        self.built = build_stage(source, batch_size, (), 0, seed)
        names = {**self.built.names, **self.built.buffer_names}
        self.by_orig = {orig: n for n, orig in names.items()}
        self.batch_size, self.test = batch_size, test

    def __call__(self, state: dict[str, Any]) -> tuple[float, float]:
        from runtime.results.evaluation import evaluate_module

        mine = {self.by_orig[k]: v for k, v in state.items() if k in self.by_orig}
        self.built.module.load_state_dict(mine, strict=False)
        return evaluate_module(self.built.module, self.test, self.batch_size, self.built.loss)
