"""One prepared device check: everything hetpipe claims about CUDA, measured in one short run.

Run from the repository root on a machine with one CUDA GPU (``scripts/gpu_check.sh`` makes
the virtual environment first). Steps: the ``cuda``-marked tests; per-layer profiles of a
ResNet and a GPT-2-like model against a whole-model step and the analytic estimate; a small
Hugging Face GPT-2 trained in 2 and 3 stages on the one GPU (fp32 and bf16) against a plain
loop; one VW offloading each class of state against all-keep, with each stage's CUDA peak
against the runtime's byte accounting; one VW's throughput against a plain loop. Writes
``gpu_check.json`` and ``summary.txt`` under ``$OUT`` (or ``results/gpu_check/``).

Without CUDA it says so and exits 0. ``--cpu-dry-run`` runs the same steps on CPU with tiny
sizes (no pytest step), so the script itself is tested where there is no GPU.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # run from anywhere: the checkout's packages, not an install


@dataclass(frozen=True)
class Sizes:
    """How big each step is (the GPU run, or the CPU dry run)."""

    device: str  # torch device of every step
    profile_models: tuple[tuple[str, int], ...]  # (built-in model, batch size)
    repeats: int  # timed repetitions per profiled layer and per whole step
    hf_layers: int  # GPT-2 layers
    hf_embd: int  # GPT-2 width
    hf_seq: int  # tokens per sample
    hf_batch: int  # samples per minibatch
    train_steps: int  # minibatches per training run
    mlp_batch: int  # the offload check's minibatch
    throughput_steps: int  # minibatches timed for the throughput figure
    hf_runs: tuple[tuple[int, str], ...]  # (stages, precision) of each GPT-2 training run


ALL_RUNS = ((2, "fp32"), (2, "bf16"), (3, "fp32"), (3, "bf16"))
GPU = Sizes("cuda:0", (("resnet152", 16), ("transformer", 32)), 3, 4, 256, 128, 16, 12, 64, 60,
            ALL_RUNS)  # fmt: skip
DRY = Sizes("cpu", (("mlp", 4),), 1, 2, 32, 8, 4, 4, 8, 4, ((2, "fp32"), (3, "bf16")))


@dataclass
class Report:
    """What the check found: JSON sections and summary lines."""

    sizes: Sizes
    sections: dict[str, Any]
    lines: list[str]

    def add(self, name: str, data: Any, line: str) -> None:
        """Record one step's figures and its one-line summary."""
        self.sections[name] = data
        self.lines.append(f"{name}: {line}")
        print(f"[gpu_check] {name}: {line}", flush=True)


def _gpu_cluster(count: int, dry: bool) -> Any:
    """``count`` real GPUs on this host (every stage on ``cuda:0`` of a one-GPU machine);
    the dry run's CPU devices."""
    from planner.cluster import parse_cluster
    from planner.manual import cpu_cluster

    if dry:
        return cpu_cluster(count)
    return parse_cluster({"name": "gpu", "nodes": [{"name": "G", "gpu": "H100", "count": count}]})


def step_env(rep: Report) -> None:
    """Versions and the device."""
    dev = rep.sizes.device
    name = torch.cuda.get_device_name(0) if dev.startswith("cuda") else "cpu (dry run)"
    data = {"torch": torch.__version__, "cuda": torch.version.cuda, "device": name}
    rep.add("env", data, f"torch {torch.__version__}, CUDA {torch.version.cuda}, {name}")


def step_pytest(rep: Report) -> None:
    """``pytest -m cuda`` (the GPU run only: without CUDA every such test skips)."""
    if rep.sizes.device == "cpu":
        rep.add("pytest_cuda", {"skipped": "dry run"}, "skipped (dry run: they need a GPU)")
        return
    cmd = [
        sys.executable,
        "-m",
        "pytest",
        "-q",
        "-m",
        "cuda",
        "tests/cuda",
        "-p",
        "no:cacheprovider",
    ]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=240, check=False)
    tail = proc.stdout.strip().splitlines()[-1:] or ["(no output)"]
    rep.add("pytest_cuda", {"rc": proc.returncode, "tail": proc.stdout[-4000:]}, tail[0])


def _profile_one(model: str, batch: int, sizes: Sizes) -> dict[str, Any]:
    """One model's measured layers, whole step and analytic estimate, in ms."""
    from profiler.analytic import analytic_profile
    from profiler.errors import HetPipeError
    from profiler.measure import measure_profile, step_time_ms
    from profiler.models import resolve_model

    prof = measure_profile(
        resolve_model(model, batch), sizes.device, repeats=sizes.repeats, warmup=1
    )
    layers = float((prof.table["fwd_ms"] + prof.table["bwd_ms"]).sum())
    step = step_time_ms(resolve_model(model, batch), sizes.device, repeats=sizes.repeats, warmup=1)
    dtype = prof.meta.device_type
    try:
        est = analytic_profile(model, batch, dtype)
        analytic: float | str = float((est.table["fwd_ms"] + est.table["bwd_ms"]).sum())
    except HetPipeError as exc:  # a GPU the catalog does not know
        analytic = f"no estimate: {exc}"
    return {"model": model, "batch": batch, "device_type": dtype, "layers": len(prof.table),
            "sum_layers_ms": layers, "step_ms": step, "analytic_ms": analytic}  # fmt: skip


def step_profile(rep: Report) -> None:
    """Per-layer times, their sum vs a whole-model step, vs the analytic estimate."""
    rows = [_profile_one(m, b, rep.sizes) for m, b in rep.sizes.profile_models]
    text = "; ".join(
        f"{r['model']} b{r['batch']}: layers {r['sum_layers_ms']:.2f} ms, step {r['step_ms']:.2f} ms, "
        f"analytic {r['analytic_ms']:.2f} ms" if isinstance(r["analytic_ms"], float)
        else f"{r['model']}: layers {r['sum_layers_ms']:.2f} ms, step {r['step_ms']:.2f} ms"
        for r in rows
    )  # fmt: skip
    rep.add("profile", rows, text)


class _Tokens(torch.utils.data.Dataset[dict[str, torch.Tensor]]):
    """Seeded token samples ``{"input_ids", "labels"}``."""

    def __init__(self, vocab: int, seq: int, n: int) -> None:
        self.ids = torch.randint(0, vocab, (n, seq), generator=torch.Generator().manual_seed(0))

    def __len__(self) -> int:
        return int(self.ids.shape[0])

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def _gpt2(sizes: Sizes, vocab: int) -> torch.nn.Module:
    import transformers

    cfg = transformers.GPT2Config(
        n_layer=sizes.hf_layers, n_embd=sizes.hf_embd, n_head=4, vocab_size=vocab,
        n_positions=sizes.hf_seq, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
        use_cache=False, bos_token_id=0, eos_token_id=0,
    )  # fmt: skip
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(cfg)


def _first_loss(model: torch.nn.Module, data: Any, sizes: Sizes, precision: str) -> float:
    """The plain loop's first-step loss on the same device (same minibatch 1)."""
    from profiler.precision import autocast
    from runtime.data import MinibatchSource

    src = MinibatchSource(data, sizes.hf_batch, 0, (), input_names=("input_ids", "labels"))
    xs, _ = src.batch(1)
    dev = torch.device(sizes.device)
    with torch.no_grad(), autocast(dev.type, precision):
        out = model.to(dev)(input_ids=xs[0].to(dev), labels=xs[1].to(dev))
    return float(out.loss)


def step_train_hf(rep: Report) -> None:
    """A GPT-2 in 2 and 3 stages on the one GPU, fp32 and bf16: first loss vs a plain loop."""
    from hetpipe.api import train
    from runtime.config import OptimizerConfig

    sizes, vocab = rep.sizes, 512
    rows: list[dict[str, Any]] = []
    dry = sizes.device == "cpu"
    data = _Tokens(vocab, sizes.hf_seq, 8 * sizes.hf_batch)
    for stages, precision in sizes.hf_runs:
        model = _gpt2(sizes, vocab)
        want = _first_loss(copy.deepcopy(model), data, sizes, precision)
        res = train(
            model, data, cluster=_gpu_cluster(stages, dry), stages=stages, nm=1,
            batch_size=sizes.hf_batch, steps=sizes.train_steps, emulate=False,
            precision=precision, optimizer=OptimizerConfig(name="adam", lr=1e-3),
            timeout=120,
        )  # fmt: skip
        rows.append({"stages": stages, "precision": precision, "first_loss": res.losses[0],
                     "plain_first_loss": want, "last_loss": res.losses[-1],
                     "falling": res.losses[-1] < res.losses[0]})  # fmt: skip
    ok = all(r["falling"] for r in rows)
    worst = max(abs(r["first_loss"] - r["plain_first_loss"]) for r in rows)
    rep.add(
        "train_hf",
        rows,
        f"{len(rows)} runs, loss falling in all: {ok}, worst |first - plain| {worst:.2e}",
    )


PLACEMENTS = ("keep", "weights:offload", "optimizer:offload", "gradients:offload",
              "activations:offload", "activations:recompute")  # fmt: skip


def _with_memory(plan: Any, memory: str) -> Any:
    vw = plan.virtual_workers[0]
    stages = tuple(replace(s, memory=memory) for s in vw.stages)
    return replace(plan, virtual_workers=(replace(vw, stages=stages),))


def step_offload(rep: Report) -> None:
    """One VW offloading each class: weights equal to all-keep; each stage's CUDA peak vs the
    runtime's byte accounting (the planner's memory rules, :mod:`planner.offload`)."""
    from planner.manual import balanced_cuts, manual_plan
    from profiler.graph import ModelGraph
    from runtime.config import ModelSource, OptimizerConfig, RunConfig
    from runtime.launch.launcher import launch
    from runtime.spec import RunSpec
    from runtime.stage.model import resolve_source

    sizes, source = rep.sizes, ModelSource(ref="mlp")
    graph = ModelGraph.from_spec(resolve_source(source, sizes.mlp_batch, meta=True))
    cluster = _gpu_cluster(2, sizes.device == "cpu")
    plan = manual_plan(graph, balanced_cuts(graph, 2), "mlp", sizes.mlp_batch, 3, cluster)
    cfg, run = (
        OptimizerConfig(name="adam", lr=1e-3),
        RunConfig(steps=sizes.train_steps, seed=3, return_state=True, timeout_s=120, emulate=False),
    )
    rows, base = [], None
    for memory in PLACEMENTS:
        res: Any = launch(_with_memory(plan, memory), source, RunSpec(run, cfg))
        state = res.state_dict()
        base = state if base is None else base
        equal = all(torch.equal(state[k], v) for k, v in base.items())
        rows.append({"memory": memory, "equal_to_keep": equal,
                     "cuda_peak_bytes": [s.cuda_peak_bytes for s in res.stages],
                     "accounted_bytes": [s.peak_bytes for s in res.stages]})  # fmt: skip
    ok = all(r["equal_to_keep"] for r in rows)
    rep.add("offload", rows, f"{len(rows)} placements, weights equal to all-keep: {ok}")


def _timed(fn: Callable[[], Any], device: str) -> float:
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    return time.perf_counter() - t0


def step_throughput(rep: Report) -> None:
    """One VW (one stage) on the GPU vs a plain single-process loop, samples per second."""
    from hetpipe.api import train
    from runtime.config import OptimizerConfig

    sizes, vocab, dry = rep.sizes, 512, rep.sizes.device == "cpu"
    data = _Tokens(vocab, sizes.hf_seq, (sizes.throughput_steps + 1) * sizes.hf_batch)
    res = train(
        _gpt2(sizes, vocab), data, cluster=_gpu_cluster(1, dry), stages=1, nm=1,
        batch_size=sizes.hf_batch, steps=sizes.throughput_steps, emulate=False,
        optimizer=OptimizerConfig(lr=0.05), timeout=120,
    )  # fmt: skip
    model = _gpt2(sizes, vocab).to(sizes.device).train()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    ids = data.ids[: sizes.hf_batch].to(sizes.device)

    def loop() -> None:
        for _ in range(sizes.throughput_steps):
            opt.zero_grad(set_to_none=True)
            model(input_ids=ids, labels=ids).loss.backward()
            opt.step()

    loop()  # warm-up (kernels, allocator, cuBLAS handles): not timed
    plain = sizes.throughput_steps * sizes.hf_batch / _timed(loop, sizes.device)
    data_out = {"vw_samples_per_s": res.throughput, "plain_samples_per_s": plain}
    rep.add(
        "throughput", data_out, f"one VW {res.throughput:.1f} samples/s, plain loop {plain:.1f}"
    )


STEPS = (step_env, step_pytest, step_profile, step_train_hf, step_offload, step_throughput)


def out_dir() -> Path:
    """``$OUT`` when set (the device machine's), else ``results/gpu_check/``."""
    return Path(os.environ["OUT"]) if os.environ.get("OUT") else REPO / "results" / "gpu_check"


def main(argv: list[str] | None = None) -> int:
    """Run every step; a failing step is recorded and the others still run (exit 1 then)."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cpu-dry-run", action="store_true", help="same steps on CPU, tiny sizes")
    args = ap.parse_args(argv)
    if not args.cpu_dry_run and not torch.cuda.is_available():
        print(
            "gpu_check: no CUDA device here (torch.cuda.is_available() is False); nothing checked"
        )
        return 0
    rep = Report(DRY if args.cpu_dry_run else GPU, {}, [])
    failed = []
    for step in STEPS:
        t0 = time.perf_counter()
        try:
            step(rep)
        except Exception as exc:
            failed.append(step.__name__)
            rep.add(step.__name__, {"error": repr(exc)}, f"FAILED: {exc!r}"[:300])
        rep.sections.setdefault("seconds", {})[step.__name__] = round(time.perf_counter() - t0, 2)
    out = out_dir()
    out.mkdir(parents=True, exist_ok=True)
    doc = {"sizes": asdict(rep.sizes), "failed": failed, **rep.sections}
    (out / "gpu_check.json").write_text(json.dumps(doc, indent=2, default=str) + "\n")
    (out / "summary.txt").write_text("\n".join(rep.lines) + "\n")
    print(f"[gpu_check] wrote {out / 'gpu_check.json'}; failed steps: {failed or 'none'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
