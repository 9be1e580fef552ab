"""Parameter-server push/pull bandwidth vs raw gloo point-to-point for the same bytes.

Two processes on this machine (gloo over loopback TCP, one thread each plus the shard's
reader threads): a shard and one stage. For each message size the stage does ``reps`` rounds of

- **raw**: ``send(x)`` then ``recv(y)`` with plain ``dist.send``/``dist.recv`` (``x``, ``y``
  of the size), the shard doing the mirror image: the floor any protocol pays;
- **ps**, two client modes:
  - *push, pull (packed)*: ``push(wave, [x])`` then ``pull(wave + 1, out=[y])``: the push packs
    ``x`` into its message (a copy) and the pull is a second request;
  - *push_pull, in place*: the update is written straight into the push message
    (``update_buffers``, as :class:`runtime.sync.wave.WaveSync` computes its wave delta there)
    and the pull request rides in the push (``push_pull``), as WaveSync does.
  Either way the shard applies the update to the global weights, keeps the ledger, sends an
  acknowledgement and replies; the reply lands straight in ``y`` (one flat tensor).

Both move the same payload bytes per round. Raw and ps blocks alternate against one shard
that serves for the whole size, so machine load affects both alike; the table gives the
median over blocks of MB/s and of ``ps / raw`` (with quartiles; issue 7's target: >= 0.8)
and ``benchmarks/results/parameter_server.json`` records them.

Usage: ``python benchmarks/bench_ps.py [--sizes-mb 0.25 1 8 32] [--reps 8] [--blocks 9]``
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import socket
import statistics
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.multiprocessing.spawn import spawn

from runtime.ps.client import PSClient
from runtime.ps.core import ShardCore
from runtime.ps.layout import make_shard_specs
from runtime.ps.server import ShardServer

RESULTS = Path(__file__).resolve().parent / "results" / "parameter_server.json"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _raw_rounds(rank: int, x: torch.Tensor, y: torch.Tensor, reps: int) -> float:
    t0 = time.perf_counter()
    for _ in range(reps):
        if rank == 1:
            dist.send(x, dst=0)
            dist.recv(y, src=0)
        else:
            dist.recv(y, src=1)
            dist.send(x, dst=1)
    return time.perf_counter() - t0


def _size(
    rank: int, numel: int, reps: int, blocks: int, combined: bool, in_place: bool
) -> list[tuple[float, float]]:
    """``blocks`` pairs of (raw seconds, ps seconds) for ``reps`` rounds each, alternating.

    One shard serves for the whole size (its thread waits while raw blocks run), so neither
    side pays for starting threads or first-touch allocations inside a timed block.
    """
    (spec,) = make_shard_specs({"w": (numel,)}, {"w": 0}, [0], [(0, 0, 1, ["w"])])
    x, y = torch.full((numel,), 1e-3), torch.empty(numel)
    server = client = None
    if rank == 0:
        server = threading.Thread(
            target=ShardServer(ShardCore(spec, torch.zeros(numel)), timeout_s=60.0).serve
        )
        server.start()
    else:
        client = PSClient(0, 0, [("w", (numel,))], [spec], timeout_s=60.0)
    wave = 0
    times = []
    for block in range(blocks + 1):  # block 0 warms both paths up and is not reported
        dist.barrier()
        raw = _raw_rounds(rank, x, y, reps)
        dist.barrier()
        t0 = time.perf_counter()
        if client is not None:
            for _ in range(reps):
                upd = [x]
                if in_place:  # the update is computed straight into the message (WaveSync does)
                    upd = client.update_buffers()
                    if wave < 4:  # first use of each recycled message: put the update there
                        upd[0].copy_(x)
                if combined:
                    client.push_pull(wave, upd, wave + 1, out=[y]).wait()
                else:
                    client.push(wave, upd)
                    client.pull(wave + 1, out=[y])
                wave += 1
        ps = time.perf_counter() - t0
        dist.barrier()
        if block:
            times.append((raw, ps))
    if client is not None:
        client.close()
    if server is not None:
        server.join()
    return times


def _worker(
    rank: int,
    port: int,
    sizes_mb: list[float],
    reps: int,
    blocks: int,
    combined: bool,
    in_place: bool,
    out: str,
) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=2,
        timeout=datetime.timedelta(seconds=120),
    )
    try:
        rows = []
        for mb in sizes_mb:
            numel = int(mb * 2**20) // 4
            times = _size(rank, numel, reps, blocks, combined, in_place)
            moved = 2 * numel * 4 * reps  # payload bytes of one block (both directions)
            raw = statistics.median(moved / r / 2**20 for r, _ in times)
            ps = statistics.median(moved / p / 2**20 for _, p in times)
            ratios = sorted(r / p for r, p in times)
            rows.append(
                {
                    "mb": mb,
                    "raw_mb_s": raw,
                    "ps_mb_s": ps,
                    "ratio": statistics.median(ratios),
                    "ratio_q1": ratios[len(ratios) // 4],
                    "ratio_q3": ratios[(3 * len(ratios)) // 4],
                }
            )
        if rank == 1:
            Path(out).write_text(json.dumps(rows), encoding="utf-8")
    finally:
        dist.destroy_process_group()


MODES = {  # name -> (pull inside the push, update written in place)
    "push, pull (packed)": (False, False),
    "push_pull, in place": (True, True),
}


def main() -> None:
    """Run both processes for each client mode and print the table."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes-mb", type=float, nargs="+", default=[0.25, 1.0, 8.0, 32.0])
    ap.add_argument("--reps", type=int, default=8, help="rounds per block")
    ap.add_argument("--blocks", type=int, default=9, help="alternating raw/ps blocks per size")
    args = ap.parse_args()
    tmp = RESULTS.parent / f".bench_ps.{os.getpid()}.json"
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    rows = []
    for mode, (combined, in_place) in MODES.items():
        spawn(
            _worker,
            args=(
                _free_port(),
                args.sizes_mb,
                args.reps,
                args.blocks,
                combined,
                in_place,
                str(tmp),
            ),
            nprocs=2,
            join=True,
        )
        rows += [{"mode": mode, **r} for r in json.loads(tmp.read_text(encoding="utf-8"))]
        tmp.unlink()
    print(
        f"{'client':<20} {'payload MB':>10} {'raw MB/s':>10} {'ps MB/s':>10} {'ps/raw':>7} "
        f"{'(quartiles)':>14}"
    )
    for r in rows:
        print(
            f"{r['mode']:<20} {r['mb']:>10.2f} {r['raw_mb_s']:>10.0f} {r['ps_mb_s']:>10.0f} "
            f"{r['ratio']:>7.2f}   ({r['ratio_q1']:.2f}-{r['ratio_q3']:.2f})"
        )
    RESULTS.write_text(
        json.dumps({"rows": rows, "reps": args.reps, "blocks": args.blocks}, indent=2) + "\n",
        encoding="utf-8",
    )
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
