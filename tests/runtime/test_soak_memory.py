"""Memory under churn: what the soak's sampler relies on, and how it judges growth.

A rank names itself by role (``/proc/<pid>/comm``) so that ``benchmarks/bench_soak.py`` keys
a restarted rank's new pid to the same series; the soak flags a role whose end RSS exceeds
1.10x its first-minute level.
"""

from __future__ import annotations

import doctest
import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

from runtime.launch import child
from runtime.launch.child import proc_name
from runtime.ps import outcome, peers

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_soak.py"


def _bench() -> ModuleType:
    spec = importlib.util.spec_from_file_location("bench_soak", BENCH)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("module", [child, outcome])
def test_doctests(module: ModuleType) -> None:
    assert doctest.testmod(module).failed == 0


def test_every_role_gets_its_own_short_name() -> None:
    names = [proc_name(f"shard {k} | rank {k} | node A") for k in range(12)]
    names += [
        proc_name(f"vw {v} | stage {s} | rank 9 | device G:0") for v in range(12) for s in range(4)
    ]
    assert len(set(names)) == len(names) and all(len(n.encode()) <= 15 for n in names)
    assert proc_name("vw 11 | stage 3 | rank 40 | device Q:1") == "hp vw11 s3"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc/self/comm is Linux's")
def test_the_name_is_what_proc_shows() -> None:
    comm = Path("/proc/self/comm")
    before = comm.read_text().strip()
    try:
        child._set_proc_name(proc_name("shard 2 | rank 2 | node B"))
        assert comm.read_text().strip() == "hp shard2"
    finally:
        child._set_proc_name(before)


def test_soak_flags_a_role_that_grew_past_ten_percent() -> None:
    bench = _bench()
    flat = [(float(t), 300.0 + (t % 3)) for t in range(0, 600)]
    grows = [(float(t), 300.0 + 0.1 * t) for t in range(0, 600)]  # +0.1 MB/s
    out = bench.rss_figures({"hp shard0": grows, "hp vw0 s0": flat})
    assert out["rss_grew"] == ["hp shard0"]
    assert out["rss_by_role"]["hp shard0"]["first_minute_mb"] == 306.0
    assert out["rss_by_role"]["hp vw0 s0"]["ratio"] <= 1.01


class _GlooLikeSend:
    """A gloo send: ``is_completed()`` stays ``False`` until ``wait()`` is called."""

    def __init__(self) -> None:
        self.waited = False

    def is_completed(self) -> bool:
        return self.waited

    def wait(self, timeout: object = None) -> bool:
        self.waited = True
        return True


def test_a_shards_peer_reports_do_not_pile_up(monkeypatch: pytest.MonkeyPatch) -> None:
    # restart/continue mode: a shard tells its peers its clocks after every change (every
    # wave); it kept every send's Work and tensor for the run (~1 MB/s in the soak)
    sent: list[_GlooLikeSend] = []

    def isend(*_args: object, **_kwargs: object) -> _GlooLikeSend:
        sent.append(_GlooLikeSend())
        return sent[-1]

    monkeypatch.setattr(peers.dist, "isend", isend)
    link = peers.PeerLink({1: 1, 2: 2, 3: 3}, 2, None, lambda *_: None)
    for clock in range(5_000):
        link.tell(((clock, clock + 1), (False, False), (0, 0)))
    assert len(sent) == 15_000
    assert len(link.link._sends) <= 16  # a few in flight, not the run's 15,000
    assert all(s.waited for s in sent[:-16])
