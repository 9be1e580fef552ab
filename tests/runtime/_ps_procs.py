"""Process entry points for the parameter-server tests (importable by spawned children).

A shard process serves until its clients said BYE and saves its final state; a fake stage
process plays one stage of a virtual worker: it admits minibatches only when
``planner.wsp.required_global_clock`` holds (pulling when it does not), sleeps a random
delay per minibatch and pushes one integer-valued update per wave. Failures are written
next to the output file as ``<out>.err`` and the process exits with code 3.
"""

from __future__ import annotations

import datetime
import os
import random
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from planner.wsp import required_global_clock
from profiler.errors import HetPipeRuntimeError
from runtime.persist.snapshot import SnapshotSpec
from runtime.ps.client import PSClient
from runtime.ps.core import ShardCore
from runtime.ps.layout import ShardSpec
from runtime.ps.pull import PullHandle, PullResult
from runtime.ps.server import ShardServer

EXIT_FAILED = 3


@dataclass(frozen=True)
class RunConfig:
    """What every process of one test run shares."""

    store: str  # FileStore path (rendezvous)
    world: int  # shards + stages
    nm: int  # minibatches per wave
    D: int  # WSP threshold the fake stages obey
    waves: int  # waves each stage pushes (ignored when forever)
    delay_s: float = 0.0  # max random sleep per minibatch
    reorder: bool = False  # sometimes push wave c+1 before wave c (needs D >= 1)
    duplicate: bool = False  # re-send wave 1 once, bypassing the client-side check
    timeout_s: float = 20.0
    idle_timeout_s: float | None = None  # shards: longest silence of a client (hang detection)
    checkpoint_dir: str | None = None  # shards checkpoint every wave there
    forever: bool = False  # run until killed (fault tests)
    combined: bool = False  # updates written in place (update_buffers) and the next pull,
    # when one will be needed, sent inside the push (push_pull); otherwise push, then pull


def param_update(vw: int, wave: int, name: str, shape: Sequence[int]) -> torch.Tensor:
    """The update VW ``vw`` pushes for parameter ``name`` in ``wave`` (integer-valued: exact sums)."""
    g = torch.Generator().manual_seed(10_000 * vw + 10 * wave + sum(map(ord, name)))
    return torch.randint(-8, 9, tuple(shape), generator=g).float()


def _init(rank: int, cfg: RunConfig) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"file://{cfg.store}",
        rank=rank,
        world_size=cfg.world,
        timeout=datetime.timedelta(seconds=cfg.timeout_s),
    )


def _fail(out: str, exc: HetPipeRuntimeError) -> None:
    Path(out + ".err").write_text(str(exc), encoding="utf-8")
    sys.stderr.flush()
    os._exit(EXIT_FAILED)


def _quick_exit() -> None:
    """Skip interpreter teardown (about 1 s per process with torch loaded on a busy machine)."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def shard_main(spec: ShardSpec, init: torch.Tensor, cfg: RunConfig, out: str) -> None:
    """Serve one shard; save ``{weights, clock, ledger, trace, rejected}`` to ``out``."""
    _init(spec.rank, cfg)
    try:
        core = ShardCore(spec, init)
        snaps = None
        if cfg.checkpoint_dir:  # one snapshot part per shard (the fault tests run one shard)
            snaps = SnapshotSpec(
                Path(cfg.checkpoint_dir), "test", "a", (f"shard-{spec.id}",), (), 1
            )
        server = ShardServer(
            core, timeout_s=cfg.timeout_s, snapshots=snaps, idle_timeout_s=cfg.idle_timeout_s
        )
        state = server.serve()
        torch.save(
            {
                "weights": state.weights,
                "clock": state.clock,
                "ledger": [[e.vw, e.stage, e.wave] for e in state.ledger],
                "trace": [[*e.local, e.global_clock] for e in core.trace],
                "rejected": [[v, s, w, int(st)] for v, s, w, st in core.rejected],
            },
            out,
        )
    except HetPipeRuntimeError as exc:
        _fail(out, exc)
    finally:
        dist.destroy_process_group()
    _quick_exit()


def init_value(spec: ShardSpec, name: str) -> torch.Tensor:
    """Initial value of parameter ``name``: its slice of ``arange(numel) * 0.5`` (the tests' init)."""
    slot = spec.slot(name)
    return (torch.arange(spec.numel, dtype=torch.float32) * 0.5)[
        slot.offset : slot.offset + slot.numel
    ].view(slot.shape)


def _wrong_version(
    vw: int,
    params: Sequence[tuple[str, tuple[int, ...]]],
    specs: Sequence[ShardSpec],
    client: PSClient,
    res: PullResult,
    pushed: set[int],
) -> int:
    """How many pulled tensors differ from the exact expected version: init, plus every VW's
    updates of the waves below the shard's clock, plus this VW's own pushed later waves."""
    clock_of = {spec.id: c for spec, c in zip(client.shards, res.clocks, strict=True)}
    wrong = 0
    for (name, shape), got in zip(params, res.tensors, strict=True):
        spec = next(s for s in specs if name in {p.name for p in s.params})
        g = clock_of[spec.id]
        want = init_value(spec, name).clone()
        for v in spec.vws:
            for w in range(g):
                want += param_update(v, w, name, shape)
        for w in sorted(pushed):
            if w >= g:
                want += param_update(vw, w, name, shape)
        wrong += int(not torch.equal(got, want))
    return wrong


def stage_main(
    vw: int,
    stage: int,
    rank: int,
    params: Sequence[tuple[str, tuple[int, ...]]],
    specs: Sequence[ShardSpec],
    cfg: RunConfig,
    out: str,
) -> None:
    """One fake stage: obey WSP admission, push per wave; save its pull records to ``out``."""
    _init(rank, cfg)
    rng = random.Random(rank)
    try:
        client = PSClient(
            vw, stage, params, specs, timeout_s=cfg.timeout_s, pull_timeout_s=cfg.timeout_s
        )
        known, held, bad, duplicated = 0, None, 0, False
        pushed: set[int] = set()
        pulls: list[tuple[int, int, int]] = []
        rejections: list[str] = []
        p = 0
        pending: tuple[PullHandle, int] | None = None  # a pull sent inside a push
        carried = 0  # pulls answered through push_pull
        while cfg.forever or p < cfg.waves * cfg.nm:
            p += 1
            need = required_global_clock(p, cfg.nm, cfg.D)
            if need > known:
                if pending is not None and pending[1] >= need:
                    res, pending = pending[0].wait(), None
                    carried += 1
                else:
                    res = client.pull(need)
                known = res.clock
                pulls.append((p, need, known))
                bad += _wrong_version(vw, params, specs, client, res, pushed)
            time.sleep(rng.random() * cfg.delay_s)
            if p % cfg.nm:
                continue
            wave = p // cfg.nm - 1
            upd = [param_update(vw, wave, n, s) for n, s in params]
            last = not cfg.forever and wave == cfg.waves - 1
            if cfg.reorder and held is None and not last and rng.random() < 0.5:
                held = (wave, upd)  # pushed after the next wave: the shard must buffer it
                continue
            nxt = required_global_clock(p + cfg.nm, cfg.nm, cfg.D)  # the next wave's need
            if cfg.combined:
                bufs = client.update_buffers()
                for b, u in zip(bufs, upd, strict=True):
                    b.copy_(u)
                upd = bufs
            if cfg.combined and held is None and pending is None and nxt > known and not last:
                pending = (client.push_pull(wave, upd, nxt), nxt)
            else:
                client.push(wave, upd)
            pushed.add(wave)
            if held is not None:
                client.push(*held)
                pushed.add(held[0])
                held = None
            if cfg.duplicate and not duplicated and 1 in pushed:  # re-send wave 1 once
                duplicated = True
                link = client._links[0]
                again = [param_update(vw, 1, n, s) for n, s in params]
                client._send_push(0, 1, torch.cat([again[i].reshape(-1) for i in link.order]))
                try:
                    client.flush()
                except HetPipeRuntimeError as exc:
                    rejections.append(str(exc))
        if pending is not None:
            pending[0].wait()
        client.close()
        torch.save(
            {"pulls": pulls, "rejections": rejections, "wrong_versions": bad, "carried": carried},
            out,
        )
    except HetPipeRuntimeError as exc:
        _fail(out, exc)
    finally:
        dist.destroy_process_group()
    _quick_exit()


def tiny_model() -> torch.nn.Module:
    """The model of the SGD test: 4 -> 8 -> 2 MLP, same seed everywhere."""
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))


def vw_batches(vw: int, steps: int, batch: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    """VW ``vw``'s own (disjoint) data: ``x`` (steps, batch, 4), ``y`` (steps, batch, 2)."""
    g = torch.Generator().manual_seed(100 + vw)
    x = torch.randn(steps, batch, 4, generator=g)
    return x, torch.sin(x[..., :2]) + 0.1 * torch.randn(steps, batch, 2, generator=g)


def sgd_step_update(
    model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, lr: float
) -> list[torch.Tensor]:
    """``-lr * grad`` of the MSE loss on one minibatch, one tensor per parameter."""
    model.zero_grad()
    torch.nn.functional.mse_loss(model(x), y).backward()
    return [-lr * p.grad for p in model.parameters() if p.grad is not None]


def sgd_vw_main(
    vw: int, rank: int, specs: Sequence[ShardSpec], cfg: RunConfig, lr: float, out: str
) -> None:
    """A one-stage VW training :func:`tiny_model` through the shards (Nm = 1, D = 0 admission)."""
    _init(rank, cfg)
    try:
        model = tiny_model()
        named = list(model.named_parameters())
        client = PSClient(
            vw, 0, [(n, tuple(p.shape)) for n, p in named], specs, timeout_s=cfg.timeout_s
        )
        xs, ys = vw_batches(vw, cfg.waves)
        known = -1
        for p in range(1, cfg.waves + 1):
            need = required_global_clock(p, cfg.nm, cfg.D)
            if need > known:
                known = client.pull(need, out=[param for _, param in named]).clock  # in place
            else:
                raise HetPipeRuntimeError(
                    f"vw {vw}: minibatch {p} admitted without a pull (Nm=1, D=0 pulls every step)"
                )
            client.push(p - 1, sgd_step_update(model, xs[p - 1], ys[p - 1], lr))
        final = client.pull(cfg.waves)
        client.close()
        torch.save({"weights": list(final.tensors), "clock": final.clock}, out)
    except HetPipeRuntimeError as exc:
        _fail(out, exc)
    finally:
        dist.destroy_process_group()
    _quick_exit()


def protocol_main(rank: int, store: str, out: str) -> None:
    """Ranks 0 (one shard, served twice in a row), 1 and 2 (VW 0 and VW 1, one stage each, both
    holding the whole flat parameter ``w`` of 8 elements). Rank 1 saves what it saw to ``out``.

    Round 1: VW 0 writes its wave-0 update in place (``update_buffers``) and sends the pull of
    clock 1 inside the push (``push_pull``), then asks a standalone pull of clock 0. Neither can
    be answered before VW 1 pushes wave 0 (after a barrier), and the replies must come in VW 0's
    order. Round 2: a second server on the same process group must see none of the first one's
    messages; VW 0 pulls straight into views of one flat buffer.
    """
    cfg = RunConfig(store=store, world=3, nm=1, D=0, waves=1, timeout_s=20.0)
    _init(rank, cfg)
    pair = dist.new_group([1, 2])
    from runtime.ps.layout import make_shard_specs

    (spec,) = make_shard_specs({"w": (8,)}, {"w": 0}, [0], [(0, 0, 1, ["w"]), (1, 0, 2, ["w"])])
    seen: dict[str, object] = {}
    try:
        for round_ in (1, 2):
            if rank == 0:
                ShardServer(ShardCore(spec, torch.zeros(8)), timeout_s=cfg.timeout_s).serve()
                continue
            client = PSClient(rank - 1, 0, [("w", (8,))], [spec], timeout_s=cfg.timeout_s)
            mine = torch.full((8,), float(rank * round_))
            if round_ == 1 and rank == 1:
                (buf,) = client.update_buffers()
                buf.copy_(mine)
                first = client.push_pull(0, [buf], 1)
                second = client.pull_async(0)
                dist.barrier(group=pair)  # VW 1 pushes only now
                a, b = first.wait(), second.wait()
                seen["round1"] = [a.clock, b.clock, a.tensors[0].clone(), b.tensors[0].clone()]
            elif round_ == 1:
                dist.barrier(group=pair)
                client.push(0, [mine])
            else:
                client.push(0, [mine])
                flat = torch.zeros(8)
                views = [flat[:8].view(8)]
                res = client.pull(1, out=views)
                seen["round2"] = [
                    res.clock,
                    flat.clone(),
                    res.tensors[0].data_ptr() == flat.data_ptr(),
                ]
            client.close()
        if rank == 1:
            torch.save(seen, out)
    except HetPipeRuntimeError as exc:
        _fail(out, exc)
    finally:
        dist.destroy_process_group()
    _quick_exit()
