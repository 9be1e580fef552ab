"""The simulator's predictions are pinned: the optimised event loop must give the same bits.

``GOLDEN`` holds, per case, the SHA-256 of ``repr(SimResult)`` (every float, count and trace
interval) recorded with the event loop as it was before its rewrite for scale (commit
6c48df6; re-recorded when transfers began to overlap computation as the runtime's receive
threads overlap them, when each stage began to wait for its own pull alone, and when a
stage began to wait at D = 0 for the pull it folds at its update, and when only that
update, not its backward, waited for the pull). Any change
of a prediction, however small, changes the digest. If a change of the model is intended,
re-record with ``python -m tests.planner.test_simulator_golden`` and say why in the commit.
"""

from __future__ import annotations

import hashlib
import random

import pytest

from planner.sim.engine import simulate_pipelines
from planner.sim.simulator import simulate
from planner.sim.types import PipelineSpec, SimResult
from tests.planner.simplan import make_plan


def _spec(rng: random.Random, v: int, n: int, shared_nodes: bool) -> PipelineSpec:
    fwd = tuple(rng.uniform(0.5, 5.0) for _ in range(n))
    nodes = tuple(f"n{rng.randint(0, 2)}" if shared_nodes else f"v{v}" for _ in range(n))
    return PipelineSpec(
        fwd_ms=fwd,
        bwd_ms=tuple(2 * f + rng.uniform(0.0, 1.0) for f in fwd),
        recv_fwd_ms=(0.0, *(rng.uniform(0.0, 1.0) for _ in range(n - 1))),
        recv_bwd_ms=(*(rng.uniform(0.0, 1.0) for _ in range(n - 1)), 0.0),
        push_ms=tuple(rng.uniform(0.0, 2.0) for _ in range(n)),
        pull_ms=tuple(rng.uniform(0.0, 2.0) for _ in range(n)),
        cross_recv_bytes=tuple(rng.randint(0, 1000) for _ in range(n)),
        cross_sync_bytes=tuple(rng.randint(0, 1000) for _ in range(n)),
        labels=tuple(f"g{v}.{s}" for s in range(n)),
        nodes=nodes if shared_nodes or v % 2 else (),
        push_inter_ms=tuple(rng.uniform(0.0, 3.0) for _ in range(n)) if v % 3 else (),
    )


def _random_case(seed: int, nm: int, D: int, shared: bool) -> SimResult:
    rng = random.Random(seed)
    specs = [_spec(rng, v, rng.randint(1, 5), shared) for v in range(rng.randint(1, 7))]
    if seed % 2:  # a straggler
        s0 = specs[0]
        specs[0] = PipelineSpec(**{**s0.__dict__, "fwd_ms": tuple(3 * f for f in s0.fwd_ms)})
    return simulate_pipelines(specs, nm=nm, D=D, waves=6, batch_size=16, record_trace=True)


def _plan_case(nm: int, D: int, placement: str) -> SimResult:
    vws = [
        [("V", 3.0, 6.0), ("R", 2.5, 5.0), ("G", 4.0, 8.5), ("Q", 5.0, 9.0)],
        [("V", 3.1, 6.2), ("V", 2.0, 4.0), ("R", 4.4, 8.0)],
        [("Q", 9.0, 17.0), ("G", 3.0, 6.0)],
    ]
    plan = make_plan(vws, nm=nm, D=D, placement=placement)
    return simulate(plan, waves=5, record_trace=True)


def _many_case() -> SimResult:
    rng = random.Random(7)
    specs = []
    for _ in range(32):
        fwd = [rng.uniform(2.0, 6.0) for _ in range(4)]
        specs.append(
            PipelineSpec.from_times(
                fwd,
                [2 * f for f in fwd],
                [0.0] + [rng.uniform(0.2, 1.0) for _ in range(3)],
                [rng.uniform(0.2, 1.0) for _ in range(3)] + [0.0],
                push_ms=rng.uniform(1.0, 4.0),
                pull_ms=rng.uniform(1.0, 4.0),
            )
        )
    return simulate_pipelines(specs, nm=4, D=0, waves=8, batch_size=32)


CASES = {
    "random-1": lambda: _random_case(1, nm=3, D=0, shared=True),
    "random-2": lambda: _random_case(2, nm=1, D=1, shared=False),
    "random-3": lambda: _random_case(3, nm=5, D=2, shared=True),
    "random-4": lambda: _random_case(4, nm=4, D=0, shared=False),
    "random-5": lambda: _random_case(5, nm=2, D=0, shared=True),
    "plan-default": lambda: _plan_case(4, 0, "default"),
    "plan-local-d1": lambda: _plan_case(3, 1, "local"),
    "many-vws": _many_case,
}

GOLDEN = {
    "random-1": "597c47ab7ed0eed3d6652f9f4a10a4b64c2fe5e7ee54c65ccc234164163ba138",
    "random-2": "3c4a4d581556c4250e519fb168a1b3559c7aaa27ecba0e1c2884f974b09ace75",
    "random-3": "1c07623ae1b64a9b436c056a9e5beec5fca150576be7270c9387e294158e3d07",
    "random-4": "471f942aa72036736018445244528f1674e83378f4e4ad3af0dda317b519e80a",
    "random-5": "fbe9df522b31cb0b80bbb9411a388afb4696d09a36c211b4f8af818f1a62d4ba",
    "plan-default": "c5af20a1bf0e35ad6f68d99c130f16f064b9351471f31cb89c5e29238574810c",
    "plan-local-d1": "a1e1925a6915d3df0fbdfd7ea6444f20f011bc447bfe111d444e403903f7c875",
    "many-vws": "8539cfa8c75382b6dc4743fdaa2936046e63782cb00384fcbf4df26e23a10259",
}


def digest(res: SimResult) -> str:
    """SHA-256 of the result's repr (floats print exactly, so equal repr means equal bits)."""
    return hashlib.sha256(repr(res).encode()).hexdigest()


@pytest.mark.parametrize("name", sorted(CASES))
def test_predictions_are_unchanged(name: str) -> None:
    assert digest(CASES[name]()) == GOLDEN[name]


if __name__ == "__main__":
    for case, run in CASES.items():
        print(f'    "{case}": "{digest(run())}",')
