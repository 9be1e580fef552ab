"""GPT-2 (Hugging Face, random init) tokens/s: hetpipe vs a plain loop vs torch.distributed.pipelining.

One run measures, side by side on this machine (CPU, gloo, one thread per process):
- ``plain``: one process, ``model(**batch).loss.backward()`` and SGD, the whole model;
- ``hetpipe``: ``hetpipe.train`` with the same model split into ``--stages`` stages, Nm = 2,
  no emulation (real CPU speed);
- ``pipelining``: ``torch.distributed.pipelining`` ``Schedule1F1B`` on the same stage modules
  (``ModelGraph.build_stages`` at the same cut), 4 microbatches of ``batch / 4``.
The ratios are printed and written to ``benchmarks/results/gpt2.json`` with the load average.

The stages take int labels and a bool mask across the cut: Schedule1F1B needs static
metadata whose float examples ask for gradients (see ``_pp_rank``). ``--rounds R`` repeats the
whole alternation and keeps medians.

``python benchmarks/bench_gpt2.py --steps 10 --rounds 2`` (about 6 minutes on 2 cores).
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import Tensor, nn
from torch.utils.data import Dataset

ROOT = Path(__file__).resolve().parents[1]
SEQ = 64


class Tokens(Dataset[dict[str, Tensor]]):
    """Seeded token samples ``{"input_ids", "labels"}`` (ids below 10, as the example factory)."""

    def __init__(self, n: int = 512) -> None:
        self.ids = torch.randint(0, 10, (n, SEQ), generator=torch.Generator().manual_seed(0))

    def __len__(self) -> int:
        return int(self.ids.shape[0])

    def __getitem__(self, i: int) -> dict[str, Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def model() -> nn.Module:
    from examples.gpt2_lm import small

    torch.manual_seed(0)
    return small(8)[0]


def plain(m: nn.Module, batch: int, steps: int) -> float:
    """Tokens/s of a plain single-process loop."""
    torch.set_num_threads(1)
    data = Tokens()
    opt = torch.optim.SGD(m.parameters(), lr=0.01)
    t0 = 0.0
    for s in range(steps + 2):
        if s == 2:
            t0 = time.perf_counter()
        ids = data.ids[(s * batch) % len(data) :][:batch]
        loss = m(input_ids=ids, labels=ids).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    return steps * batch * SEQ / (time.perf_counter() - t0)


def hetpipe_run(m: nn.Module, batch: int, steps: int, stages: int) -> float:
    """Tokens/s of ``hetpipe.train`` (one VW, Nm = 2, not emulated)."""
    import hetpipe

    res = hetpipe.train(m, Tokens(), stages=stages, nm=2, batch_size=batch, steps=steps,
                        emulate=False, return_state=False, timeout=120)  # fmt: skip
    return float(res.throughput) * SEQ


def _pp_rank(rank: int, world: int, path: str, batch: int, steps: int, out: str) -> None:
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    from planner.manual import balanced_cuts

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{path}", rank=rank, world_size=world)
    try:
        from profiler.graph import ModelGraph

        m = model()
        ids = Tokens().ids[: batch // 4]
        names = ("input_ids", "labels")
        g = ModelGraph.from_module(m, (ids, ids), input_names=names)
        stages = g.build_stages(balanced_cuts(g, world))
        with torch.no_grad():  # example tensors: no shape inference on uninitialised buffers
            acts: Any = (ids, ids)
            ins = []
            for st in stages[:-1]:
                ins.append(acts)
                acts = st(*acts)
            ins.append(acts)
        mine = stages[rank]
        last = rank == world - 1

        class Stage(nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.inner = mine

            def forward(self, *xs: Tensor) -> Any:
                y = self.inner(*xs)
                return y.loss.reshape(1) if last else y  # (1,): the schedule cats outputs

        # Static metadata takes requires_grad from the examples: float activations crossing a
        # cut must say they need gradients (examples made under no_grad do not, and the stage
        # backward then fails with "Failed to run stage backward", output gradients None);
        # int labels and bool masks cross as they are, without gradients.
        mine_in = tuple(
            x.detach().requires_grad_() if x.is_floating_point() else x for x in ins[rank]
        )
        outs = (Stage()(*mine_in),) if last else Stage()(*mine_in)  # with grad, for the flags
        outs = tuple(o.detach().requires_grad_(o.requires_grad) for o in outs)
        stage = PipelineStage(Stage(), rank, world, torch.device("cpu"),
                              input_args=mine_in, output_args=outs)  # fmt: skip
        sched = Schedule1F1B(stage, n_microbatches=4, loss_fn=lambda y, _t: y.sum())
        data = Tokens()
        t0 = 0.0
        for s in range(steps + 2):
            if s == 2:
                t0 = time.perf_counter()
            x = data.ids[(s * batch) % len(data) :][:batch]
            if rank == 0:
                sched.step(x, x)
            elif last:
                sched.step(target=x)
            else:
                sched.step()
        if rank == 0:
            Path(out).write_text(json.dumps(steps * batch * SEQ / (time.perf_counter() - t0)))
    except Exception as exc:
        if not os.path.exists(out):  # the first failing rank says why
            first = str(exc).strip().splitlines()[0][:300] if str(exc).strip() else ""
            Path(out).write_text(json.dumps(f"rank {rank}: {type(exc).__name__}: {first}"))
        raise
    finally:
        dist.destroy_process_group()


def pipelining(batch: int, steps: int, stages: int) -> float | str:
    """Tokens/s of Schedule1F1B on the same stages, or the error it stopped with."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "out.json")
        try:
            mp.spawn(_pp_rank, (stages, os.path.join(tmp, "rdv"), batch, steps, out), nprocs=stages)
        except Exception as exc:  # report what stopped it (the figure is then missing)
            if not os.path.exists(out):
                return f"{type(exc).__name__}: {str(exc).strip().splitlines()[-1][:300]}"
        value = json.loads(Path(out).read_text())
        return value if isinstance(value, float) else str(value)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--stages", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--rounds", type=int, default=1, help="repeat the alternation; medians")
    a = ap.parse_args()
    load0 = os.getloadavg()[0]
    base = model()
    runs: dict[str, list[Any]] = {}
    for _ in range(a.rounds):  # every system once per round: the same load for all
        runs.setdefault("plain_tokens_s", []).append(plain(copy.deepcopy(base), a.batch, a.steps))
        for k in a.stages:
            runs.setdefault(f"hetpipe_{k}_tokens_s", []).append(
                hetpipe_run(copy.deepcopy(base), a.batch, a.steps, k)
            )
            runs.setdefault(f"pipelining_{k}_tokens_s", []).append(pipelining(a.batch, a.steps, k))
    rows: dict[str, Any] = {
        key: statistics.median(v) if all(isinstance(x, float) for x in v) else v[0]
        for key, v in runs.items()
    }
    rows["runs"] = runs
    for k in a.stages:
        h, p = rows[f"hetpipe_{k}_tokens_s"], rows[f"pipelining_{k}_tokens_s"]
        rows[f"hetpipe_{k}_vs_plain"] = h / rows["plain_tokens_s"]
        rows[f"hetpipe_{k}_vs_pipelining"] = h / p if isinstance(p, float) else None
    rows["load_average"] = [load0, os.getloadavg()[0]]
    rows["model"] = "examples.gpt2_lm:small (6 x 256, seq 64)"
    rows["batch"], rows["steps"], rows["rounds"] = a.batch, a.steps, a.rounds
    out = ROOT / "benchmarks" / "results" / "gpt2.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(rows, indent=1))
    print(json.dumps(rows, indent=1))


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    main()
