"""Link profiles: point-to-point transfer time vs message size, fitted as latency + bandwidth.

As in the paper, a link class is modelled as ``t(n) = latency_s + n / bandwidth`` and the two
figures come from a linear regression over measured transfers of growing size. Two
processes are spawned on this machine and play ping-pong through ``torch.distributed``
(gloo between CPU processes; NCCL between two GPUs when at least two are present); the
one-way time is half the round trip. That measures the ``intra_node`` class; the
``inter_node`` one takes a process on each of two hosts (:func:`measure_link_to`,
``hetpipe profile --links --peer``). The planner falls back to ``cluster.yaml`` for
classes a ``links.yaml`` lacks.

``links.yaml`` (beside the layer profiles) has the shape ``planner.costmodel.load_links``
reads::

    links:
      intra_node: {bandwidth: 2.1e9, latency: 4.2e-05}   # bytes/s, seconds
    measured:
      intra_node: {backend: gloo, r2: 0.999, samples: [[1024, 5.1e-05], ...]}
"""

from __future__ import annotations

import json
import logging
import os
import platform
import socket
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import yaml
from torch.multiprocessing.spawn import ProcessExitedException, ProcessRaisedException, spawn

from profiler.errors import ConfigError, ProfileError
from profiler.files import atomic_write_text

__all__ = ["DEFAULT_SIZES", "LinkFit", "fit_link", "measure_link_to", "measure_links", "save_links"]

log = logging.getLogger(__name__)

DEFAULT_SIZES: tuple[int, ...] = tuple(4**k * 1024 for k in range(9))  # 1 KiB .. 64 MiB


@dataclass(frozen=True)
class LinkFit:
    """A fitted link class.

    Attributes:
        link_class: ``intra_node`` or ``inter_node``.
        latency_s: fixed cost per message, seconds.
        bandwidth_bps: bytes per second.
        r2: coefficient of determination of the linear fit.
        samples: ``(bytes, seconds)`` one-way times the fit is over (fastest round trip / 2).
        backend: ``gloo`` or ``nccl``.
    """

    link_class: str
    latency_s: float
    bandwidth_bps: float
    r2: float
    samples: tuple[tuple[int, float], ...]
    backend: str

    def time_s(self, nbytes: float) -> float:
        """Predicted one-way time of an ``nbytes`` message, seconds."""
        return self.latency_s + nbytes / self.bandwidth_bps


def fit_link(
    samples: Sequence[tuple[int, float]], link_class: str = "intra_node", backend: str = "gloo"
) -> LinkFit:
    """Least-squares fit of ``seconds = latency + bytes / bandwidth``.

    A negative intercept (noise at tiny sizes) is clamped to the smallest measured time's
    share not explained by bandwidth, never below 0.

    Raises:
        ProfileError: fewer than two distinct sizes, or a non-increasing time (no bandwidth).
    """
    x = np.array([float(b) for b, _ in samples])
    y = np.array([float(s) for _, s in samples])
    if len(set(x.tolist())) < 2:
        raise ProfileError(
            f"link fit needs at least two message sizes, got {sorted(set(x.tolist()))}"
        )
    slope, intercept = np.polyfit(x, y, 1)
    if slope <= 0:
        raise ProfileError(
            f"link {link_class}: transfer time does not grow with size (slope {slope:.3g} s/byte); "
            "measure larger messages"
        )
    latency = float(intercept) if intercept > 0 else max(0.0, float(np.min(y - slope * x)))
    pred = intercept + slope * x
    ss_res = float(np.sum((y - pred) ** 2))
    ss_tot = float(np.sum((y - y.mean()) ** 2)) or 1.0
    pairs = tuple((int(b), float(s)) for b, s in samples)
    return LinkFit(link_class, latency, float(1.0 / slope), 1.0 - ss_res / ss_tot, pairs, backend)


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _pingpong_worker(
    rank: int,
    init_method: str,
    out_file: str,
    sizes: Sequence[int],
    repeats: int,
    warmup: int,
    backend: str,
    timeout_s: float,
) -> None:
    """One of the two spawned ranks: rank 0 times round trips, rank 1 echoes (module-level for spawn)."""
    torch.set_num_threads(1)
    device = torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")
    if backend == "nccl":
        torch.cuda.set_device(device)
    dist.init_process_group(
        backend,
        init_method=init_method,
        rank=rank,
        world_size=2,
        timeout=timedelta(seconds=timeout_s),
    )
    try:
        results: list[tuple[int, float]] = []
        for size in sizes:
            buf = torch.zeros(size, dtype=torch.uint8, device=device)
            times = []
            for r in range(warmup + repeats):
                if rank == 0:
                    t0 = time.perf_counter()
                    dist.send(buf, 1)
                    dist.recv(buf, 1)
                    if backend == "nccl":
                        torch.cuda.synchronize(device)
                    if r >= warmup:
                        times.append((time.perf_counter() - t0) / 2)
                else:
                    dist.recv(buf, 0)
                    dist.send(buf, 0)
            if rank == 0:
                # the fastest round trip: scheduling noise on a shared machine only adds time
                results.append((size, min(times)))
        if rank == 0:
            Path(out_file).write_text(json.dumps(results), encoding="utf-8")
    finally:
        dist.destroy_process_group()


def _checked_backend(sizes: Sequence[int], repeats: int, warmup: int, backend: str | None) -> str:
    """The backend to measure with, after checking the arguments (see :func:`measure_links`)."""
    if len(set(sizes)) < 2 or min(sizes) <= 0:
        raise ConfigError(
            f"link sizes must hold at least two distinct positive byte counts, got {list(sizes)}"
        )
    if repeats < 1 or warmup < 0:
        raise ConfigError(f"--repeats must be >= 1 and --warmup >= 0, got {repeats} and {warmup}")
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    backend = backend or ("nccl" if gpus >= 2 else "gloo")
    if backend == "nccl" and gpus < 2:
        raise ConfigError(
            f"the nccl link profile needs two GPUs, this machine has {gpus}; use gloo"
        )
    if backend not in ("gloo", "nccl"):
        raise ConfigError(f"link backend {backend!r} is unknown; use gloo or nccl")
    return backend


def _run_pair(args: tuple[Any, ...], timeout_s: float) -> None:
    """Run the two ping-pong ranks to completion within ``timeout_s``; never leave one behind."""
    ctx = spawn(_pingpong_worker, args=args, nprocs=2, join=False)
    deadline = time.monotonic() + timeout_s
    try:
        while not ctx.join(timeout=0.5):
            if time.monotonic() > deadline:
                raise ProfileError(f"link measurement did not finish within {timeout_s:.0f} s")
    except ProcessRaisedException as exc:
        raise ProfileError(
            f"link measurement failed in a spawned rank: {str(exc).strip().splitlines()[-1]}"
        ) from exc
    except ProcessExitedException as exc:
        raise ProfileError(f"link measurement rank exited unexpectedly ({exc})") from exc
    finally:
        for proc in ctx.processes:
            if proc.is_alive():
                proc.terminate()
                proc.join(5)


def measure_links(
    sizes: Sequence[int] = DEFAULT_SIZES,
    repeats: int = 5,
    warmup: int = 2,
    backend: str | None = None,
    timeout_s: float = 60.0,
) -> LinkFit:
    """Measure this machine's ``intra_node`` link between two spawned processes.

    Args:
        sizes: message sizes, bytes (at least two distinct).
        repeats: timed round trips per size (the fastest is kept: noise only adds time).
        warmup: untimed round trips per size.
        backend: ``gloo`` or ``nccl``; default NCCL with two or more GPUs, else gloo.
        timeout_s: process-group timeout and overall deadline, seconds.

    Raises:
        ConfigError: bad sizes/counts or NCCL without two GPUs.
        ProfileError: a rank failed or the measurement timed out.
    """
    backend = _checked_backend(sizes, repeats, warmup, backend)
    with tempfile.TemporaryDirectory(prefix="hetpipe-links-") as tmp:
        init_file = os.path.join(tmp, "rendezvous")
        out_file = os.path.join(tmp, "result.json")
        args = (f"file://{init_file}", out_file, list(sizes), repeats, warmup, backend, timeout_s)
        _run_pair(args, timeout_s)
        samples = [
            (int(b), float(s)) for b, s in json.loads(Path(out_file).read_text(encoding="utf-8"))
        ]
    fit = fit_link(samples, "intra_node", backend)
    log.info(
        "intra_node link: latency %.1f us, bandwidth %.2f GB/s",
        fit.latency_s * 1e6,
        fit.bandwidth_bps / 1e9,
    )
    return fit


def measure_link_to(
    peer: str,
    rank: int,
    sizes: Sequence[int] = DEFAULT_SIZES,
    repeats: int = 5,
    warmup: int = 2,
    timeout_s: float = 60.0,
) -> LinkFit | None:
    """Measure the ``inter_node`` link to another host: this process plays ping-pong (gloo)
    with the same call on the other host, meeting at ``peer`` (``ADDR:PORT``, which rank 0's
    host serves; ``GLOO_SOCKET_IFNAME`` picks the interface).

    Returns:
        Rank 0: the fit; rank 1 (it only echoes): ``None``.

    Raises:
        ConfigError: ``peer`` is not ``ADDR:PORT``, ``rank`` not 0 or 1, bad sizes/counts.
        ProfileError: the peer did not come, or the measurement failed.
    """
    _checked_backend(sizes, repeats, warmup, "gloo")
    addr, _, port = peer.rpartition(":")
    if not addr or not port.isdigit() or rank not in (0, 1):
        raise ConfigError(
            f"--peer {peer} --peer-rank {rank}: give ADDR:PORT (served by rank 0's host) "
            "and rank 0 on one host, 1 on the other"
        )
    with tempfile.TemporaryDirectory(prefix="hetpipe-links-") as tmp:
        out_file = os.path.join(tmp, "result.json")
        try:
            _pingpong_worker(rank, f"tcp://{peer}", out_file, list(sizes), repeats, warmup,
                             "gloo", timeout_s)  # fmt: skip
        except (RuntimeError, dist.DistError) as exc:
            raise ProfileError(f"link to {peer} failed: {str(exc).splitlines()[0]}") from exc
        if rank == 1:
            return None
        samples = json.loads(Path(out_file).read_text(encoding="utf-8"))
    return fit_link([(int(b), float(t)) for b, t in samples], "inter_node", "gloo")


def save_links(fits: Sequence[LinkFit], path: str | os.PathLike[str]) -> Path:
    """Write fitted links as ``links.yaml`` (atomically), readable by ``planner.costmodel.load_links``."""
    doc = {
        "links": {
            f.link_class: {"bandwidth": f.bandwidth_bps, "latency": f.latency_s} for f in fits
        },
        "measured": {
            f.link_class: {
                "backend": f.backend,
                "r2": f.r2,
                "samples": [list(s) for s in f.samples],
            }
            for f in fits
        },
        "host": platform.node(),
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
    }
    return atomic_write_text(Path(path), yaml.safe_dump(doc, sort_keys=False))
