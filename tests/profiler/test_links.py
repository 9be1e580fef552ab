"""Link profiles: the latency + bandwidth fit, links.yaml, and a real gloo ping-pong."""

from __future__ import annotations

from pathlib import Path

import pytest

from planner.costmodel import load_links
from profiler.errors import ConfigError, ProfileError
from profiler.links import LinkFit, fit_link, measure_link_to, measure_links, save_links


def test_fit_recovers_latency_and_bandwidth() -> None:
    latency, bandwidth = 50e-6, 2e9
    samples = [(n, latency + n / bandwidth) for n in (1024, 65536, 1 << 20, 16 << 20)]
    fit = fit_link(samples)
    assert fit.latency_s == pytest.approx(latency, rel=1e-6)
    assert fit.bandwidth_bps == pytest.approx(bandwidth, rel=1e-6)
    assert fit.r2 == pytest.approx(1.0)
    assert fit.time_s(1e6) == pytest.approx(latency + 1e6 / bandwidth)


def test_negative_intercept_is_clamped() -> None:
    fit = fit_link([(1000, 1e-7), (2000, 1e-3), (3000, 2e-3)])
    assert fit.latency_s >= 0


def test_fit_rejects_degenerate_samples() -> None:
    with pytest.raises(ProfileError):
        fit_link([(1024, 1e-4), (1024, 2e-4)])
    with pytest.raises(ProfileError, match="does not grow"):
        fit_link([(1024, 2e-3), (1 << 20, 1e-3)])


def test_links_yaml_is_read_by_the_planner(tmp_path: Path) -> None:
    fit = LinkFit("intra_node", 4e-5, 3e9, 0.99, ((1024, 4.1e-5), (1 << 20, 3.9e-4)), "gloo")
    path = save_links([fit], tmp_path / "profiles" / "links.yaml")
    links = load_links(path)
    assert links["intra_node"].latency_s == pytest.approx(4e-5)
    assert links["intra_node"].bandwidth_bps == pytest.approx(3e9)
    assert "inter_node" not in links  # the planner falls back to cluster.yaml


def test_bad_link_arguments() -> None:
    with pytest.raises(ConfigError):
        measure_links(sizes=(1024,))
    with pytest.raises(ConfigError):
        measure_links(backend="nccl")  # no GPUs here


def test_gloo_ping_pong_between_two_processes() -> None:
    sizes = (1024, 1 << 20, 1 << 23, 1 << 25)  # up to 32 MB: ~10 ms, well above scheduler noise
    fit = measure_links(sizes=sizes, repeats=5, warmup=1, timeout_s=60)
    assert fit.backend == "gloo" and fit.link_class == "intra_node"
    assert [s for s, _ in fit.samples] == list(sizes)
    assert all(t > 0 for _, t in fit.samples)
    assert fit.bandwidth_bps > 1e6 and fit.latency_s >= 0


def _peer(rank: int, peer: str, out: str) -> None:
    """One host of :func:`test_two_hosts_measure_the_inter_node_link` (module-level for spawn)."""
    # sizes far apart: on a loaded machine close ones can time in the wrong order
    fit = measure_link_to(peer, rank, (1024, 32 << 20), repeats=3, warmup=1, timeout_s=60)
    Path(out, f"rank{rank}").write_text("none" if fit is None else fit.link_class)


def test_two_hosts_measure_the_inter_node_link(tmp_path: Path) -> None:
    """``--links --peer``: one process per host, meeting at rank 0's ADDR:PORT (here two
    processes on loopback); rank 0 gets the ``inter_node`` fit, rank 1 only echoes."""
    import socket

    from torch.multiprocessing import spawn

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    spawn(_peer, args=(f"127.0.0.1:{port}", str(tmp_path)), nprocs=2, join=True)
    assert (tmp_path / "rank0").read_text() == "inter_node"
    assert (tmp_path / "rank1").read_text() == "none"
    with pytest.raises(ConfigError, match="give ADDR:PORT"):
        measure_link_to("127.0.0.1", 0)
