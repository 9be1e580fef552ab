"""Parameter-server push/pull bandwidth vs raw gloo point-to-point for the same bytes.

Two processes on this machine (gloo over loopback TCP, one thread each): a shard and one
stage. For each message size the stage does ``reps`` rounds of

- **raw**: ``send(x)`` then ``recv(y)`` with plain ``dist.send``/``dist.recv`` (``x``, ``y``
  of the size), the shard doing the mirror image: the floor any protocol pays;
- **ps**: ``push(wave, [x])`` then ``pull(wave + 1, out=[w])`` through :class:`runtime.ps_client.PSClient`
  and :class:`runtime.ps.ShardServer`, which also moves small headers and acknowledgements,
  applies the update to the global weights, keeps the ledger and copies the reply slice.

Both move the same payload bytes per round; raw and ps rounds alternate in blocks so machine
load affects both alike. Prints MB/s of each and ``ps / raw`` (issue 7's target: >= 0.8), and
writes ``benchmarks/results/parameter_server.json``.

Usage: ``python benchmarks/bench_ps.py [--sizes-mb 1 8 32] [--reps 8] [--blocks 3]``
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import socket
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.multiprocessing.spawn import spawn

from runtime.ps import ShardCore, ShardServer, make_shard_specs
from runtime.ps_client import PSClient

RESULTS = Path(__file__).resolve().parent / "results" / "parameter_server.json"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _raw_rounds(rank: int, numel: int, reps: int) -> float:
    x = torch.ones(numel)
    y = torch.empty(numel)
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(reps):
        if rank == 1:
            dist.send(x, dst=0)
            dist.recv(y, src=0)
        else:
            dist.recv(y, src=1)
            dist.send(x, dst=1)
    return time.perf_counter() - t0


def _ps_rounds(rank: int, numel: int, reps: int) -> float:
    (spec,) = make_shard_specs({"w": (numel,)}, {"w": 0}, [0], [(0, 0, 1, ["w"])])
    dist.barrier()
    t0 = time.perf_counter()
    if rank == 0:
        ShardServer(ShardCore(spec, torch.zeros(numel)), timeout_s=60.0).serve()
    else:
        client = PSClient(0, 0, [("w", (numel,))], [spec], timeout_s=60.0)
        x, w = torch.full((numel,), 1e-3), torch.empty(numel)
        for wave in range(reps):
            client.push(wave, [x])
            client.pull(wave + 1, out=[w])
        client.close()
    return time.perf_counter() - t0


def _worker(rank: int, port: int, sizes_mb: list[float], reps: int, blocks: int, out: str) -> None:
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
            _raw_rounds(rank, numel, 1)  # warm the connection and allocator
            raw = ps = 0.0
            for _ in range(blocks):
                raw += _raw_rounds(rank, numel, reps)
                ps += _ps_rounds(rank, numel, reps)
            moved = 2 * numel * 4 * reps * blocks  # payload bytes per direction pair
            rows.append(
                {
                    "mb": mb,
                    "raw_mb_s": moved / raw / 2**20,
                    "ps_mb_s": moved / ps / 2**20,
                    "ratio": raw / ps,
                }
            )
        if rank == 1:
            Path(out).write_text(json.dumps(rows), encoding="utf-8")
    finally:
        dist.destroy_process_group()


def main() -> None:
    """Run both processes and print the table."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes-mb", type=float, nargs="+", default=[1.0, 8.0, 32.0])
    ap.add_argument("--reps", type=int, default=8, help="rounds per block")
    ap.add_argument("--blocks", type=int, default=3, help="alternating raw/ps blocks per size")
    args = ap.parse_args()
    tmp = RESULTS.parent / f".bench_ps.{os.getpid()}.json"
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    spawn(
        _worker,
        args=(_free_port(), args.sizes_mb, args.reps, args.blocks, str(tmp)),
        nprocs=2,
        join=True,
    )
    rows = json.loads(tmp.read_text(encoding="utf-8"))
    tmp.unlink()
    print(f"{'payload MB':>10} {'raw MB/s':>10} {'ps MB/s':>10} {'ps/raw':>7}")
    for r in rows:
        print(f"{r['mb']:>10.1f} {r['raw_mb_s']:>10.0f} {r['ps_mb_s']:>10.0f} {r['ratio']:>7.2f}")
    RESULTS.write_text(
        json.dumps({"rows": rows, "reps": args.reps, "blocks": args.blocks}, indent=2) + "\n",
        encoding="utf-8",
    )
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
