"""Roles follow the plan's hosts under torchrun, whatever order torchrun numbers ranks in."""

from __future__ import annotations

import random

import pytest
from hypothesis import given
from hypothesis import strategies as st

from profiler.errors import ConfigError
from runtime.launch.hosts import assign_roles, local_host
from tests.runtime._two_hosts import two_host_plan


class _Store:
    """torchrun's store, as one rank sees it once every other rank has said its host."""

    def __init__(self, others: dict[int, str]) -> None:
        self.kv = {f"host/{r}": h.encode() for r, h in others.items()}

    def set(self, key: str, value: str) -> None:
        self.kv[key] = value.encode()

    def get(self, key: str) -> bytes:
        return self.kv[key]


def _role(rank: int, me: str | None, others: dict[int, str]) -> int:
    from runtime.__main__ import _args, _prepared, _role

    plan = two_host_plan(hosts=("hostA", "hostB"))  # roles: shard A, shard B, then A B, A B
    args = _args(["plan.json", "--steps", "2", "--no-emulate", *(["--host", me] if me else [])])
    setup = _prepared(args, plan, rank, 0)
    assert setup is not None
    return _role(args, plan, setup.prep, rank, 6, _Store(others))


def test_each_rank_runs_a_role_the_plan_places_on_its_host() -> None:
    # torchrun put host B's agent first: ranks 0-2 on B, 3-5 on A
    hosts = {0: "hostB", 1: "hostB", 2: "hostB", 3: "hostA", 4: "hostA", 5: "hostA"}
    roles = [_role(r, hosts[r], hosts) for r in range(6)]
    assert roles == [1, 3, 5, 0, 2, 4]  # B: its shard and every VW's stage 1
    # a node's name names its host too
    assert _role(3, "A", hosts) == 0


def test_a_host_outside_the_cluster_is_one_clear_error() -> None:
    with pytest.raises(ConfigError, match=r"--host hostC: .* use one of hostA, hostB"):
        _role(0, "hostC", {})


def test_more_processes_on_a_host_than_the_plan_places_there_is_one_error() -> None:
    hosts = {0: "hostA", 1: "hostA", 2: "hostA", 3: "hostA", 4: "hostB", 5: "hostB"}
    with pytest.raises(ConfigError, match="host hostA runs 4 processes but the plan places 3"):
        _role(0, "hostA", hosts)


def test_ranks_that_cannot_tell_their_host_keep_rank_order_or_are_told_to() -> None:
    assert assign_roles(["a", "b", "a"], [None, None, None]) == (0, 1, 2)
    with pytest.raises(ConfigError, match=r"rank 1 cannot tell .*--host NAME"):
        assign_roles(["a", "b"], ["a", None])
    with pytest.raises(ConfigError, match="WORLD_SIZE=3 but the plan has 2 processes"):
        assign_roles(["a", "b"], ["a", "b", "b"])


def test_the_local_host_is_the_one_plan_address_this_machine_can_bind() -> None:
    assert local_host(["127.0.0.1", "198.18.0.254"]) == "127.0.0.1"
    assert local_host(["198.18.0.254", "no-such-host.invalid"]) is None
    assert local_host(["127.0.0.1", "localhost"]) is None  # both: ambiguous, needs --host


@given(st.lists(st.sampled_from("abc"), min_size=1, max_size=12), st.randoms())
def test_any_numbering_gives_every_role_once_on_its_own_host(
    roles: list[str], rnd: random.Random
) -> None:
    ranks: list[str | None] = list(roles)
    rnd.shuffle(ranks)
    out = assign_roles(roles, ranks)
    assert sorted(out) == list(range(len(roles)))
    assert [roles[k] for k in out] == ranks
