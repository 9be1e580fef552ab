"""Which torchrun rank runs which role of a plan: each host runs the roles the plan put on it.

torchrun numbers ranks by node, in an order of its own (the rendezvous decides which host is
node 0). The plan decides where each role runs instead: a stage on the host of its GPU's
node, a parameter-server shard on the host of its node (the ``host:`` fields of the cluster
file, :mod:`planner.cluster`; a node without one is its own host). Every rank says which
host it is (``--host``, else the one plan host that is an address of this machine); the
ranks exchange that through torchrun's store and each takes, in rank order, the next role
placed on its host (:func:`assign_roles`, pure).
"""

from __future__ import annotations

import socket
from collections.abc import Sequence

from planner.plan import Plan
from profiler.errors import ConfigError

__all__ = ["assign_roles", "host_names", "local_host", "role_hosts"]


def host_names(plan: Plan) -> dict[str, str]:
    """Every name a rank may give for its host (a node's name or its ``host:``) -> the host."""
    names = {n.name: n.host for n in plan.cluster.nodes}
    return names | {n.host: n.host for n in plan.cluster.nodes}


def role_hosts(plan: Plan, nodes: Sequence[str]) -> tuple[str, ...]:
    """The host of each role, given each role's node (roles in the launcher's rank order)."""
    return tuple(plan.cluster.node(n).host for n in nodes)


def local_host(hosts: Sequence[str]) -> str | None:
    """The one of ``hosts`` that is an address of this machine (``None``: none, or several:
    the rank has to be told with ``--host``)."""
    mine = [h for h in dict.fromkeys(hosts) if _is_local(h)]
    return mine[0] if len(mine) == 1 else None


def _is_local(host: str) -> bool:
    """Whether ``host`` resolves to an address this machine can bind (in its network namespace)."""
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError):
        return False
    for family, _, _, _, addr in infos:
        with socket.socket(family, socket.SOCK_STREAM) as s:
            try:
                s.bind((addr[0], 0))
            except OSError:
                continue
            return True
    return False


def assign_roles(roles: Sequence[str], ranks: Sequence[str | None]) -> tuple[int, ...]:
    """The role of every rank: rank ``r`` on host ``h`` takes the next role placed on ``h``.

    Args:
        roles: the host of each role, in the launcher's rank order.
        ranks: the host each torchrun rank says it is (``None``: it cannot tell; if no rank can,
            roles follow rank order, as on one host).

    Returns:
        ``out[r]``: the role (launcher rank) torchrun rank ``r`` runs.

    Raises:
        ConfigError: some ranks know their host and others do not, a host is not in the plan,
            or a host runs another number of processes than the plan places on it.

    >>> assign_roles(["b", "b", "a", "a", "b"], ["a", "a", "b", "b", "b"])
    (2, 3, 0, 1, 4)
    >>> assign_roles(["x", "y"], [None, None])
    (0, 1)
    """
    if len(ranks) != len(roles):
        raise ConfigError(
            f"WORLD_SIZE={len(ranks)} but the plan has {len(roles)} processes: start "
            f"{len(roles)} in total (--nnodes x --nproc-per-node)"
        )
    if all(h is None for h in ranks):
        return tuple(range(len(roles)))
    unknown = [r for r, h in enumerate(ranks) if h is None]
    if unknown:
        raise ConfigError(
            f"rank {unknown[0]} cannot tell which host of the plan it runs on "
            f"({', '.join(sorted(set(roles)))}); start it with --host NAME"
        )
    queues: dict[str, list[int]] = {}
    for role, host in enumerate(roles):
        queues.setdefault(host, []).append(role)
    for host in sorted({h for h in ranks if h is not None}):
        have, want = sum(h == host for h in ranks), len(queues.get(host, []))
        if have != want:
            raise ConfigError(
                f"host {host} runs {have} processes but the plan places {want} on it; "
                f"start it with --nproc-per-node {want}"
            )
    return tuple(queues[h].pop(0) for h in ranks if h is not None)
