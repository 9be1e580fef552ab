"""The front end's planning: ask the profiler for the profile table, then hand it to the planner.

The planner never measures a model (``tests/test_layers.py``); an emulated cluster is planned
on this machine's CPU profile, so every front end gets that table from the profiler first
(:func:`profiles_for`): ``hetpipe plan``, :func:`plan` (``hetpipe.plan``) and, through
:func:`plan_on_the_fly`, ``hetpipe run CLUSTER.yaml`` and ``hetpipe.train``.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from planner.cluster import Cluster, load_cluster
from planner.plan import Plan
from planner.rules import layout
from profiler.cpu_profile import emulation_profiles
from profiler.table import Profile, load_profile_set

if TYPE_CHECKING:
    from planner.on_the_fly import PlanRequest
    from profiler.graph import ModelGraph

__all__ = ["plan", "plan_on_the_fly", "profiles_for"]


def profiles_for(
    cluster: Cluster,
    profiles: Sequence[Profile],
    model: str | None,
    batch_size: int | None,
    precision: str = "fp32",
) -> list[Profile]:
    """The profiles to plan ``cluster`` on: ``profiles`` and, for an emulated cluster, this
    machine's CPU profile of the model (:func:`profiler.cpu_profile.emulation_profiles`).

    Raises:
        ModelError: the model cannot be built.
        ProfileError: it cannot be profiled here.
    """
    given = list(profiles)
    return emulation_profiles(given, model, batch_size, precision) if cluster.emulated else given


def plan_on_the_fly(
    cluster: Cluster | None, request: PlanRequest, graph: ModelGraph | None = None
) -> Plan:
    """:func:`planner.on_the_fly.plan_for_run` on the profiles it needs: an emulated
    cluster's CPU profile (:func:`profiles_for`) when the planner partitions, none for a hand
    cut (``request.stages``/``cuts``, or a user's module given as ``graph``).

    Raises:
        ConfigError, PlanError, ProfileError, ModelError: as the profiler and the planner.
    """
    from planner.on_the_fly import plan_for_run

    allreduce = layout(request.sync) == "ddp"
    partitions = allreduce or not (request.hand_cut or graph is not None)
    profiles: list[Profile] = []
    if cluster is not None and partitions:
        precision = "fp32" if allreduce else request.precision  # what the planner prices
        profiles = profiles_for(cluster, [], request.model, request.batch_size, precision)
    return plan_for_run(cluster, request, graph, profiles)


def plan(
    cluster: Cluster | str | os.PathLike[str],
    profiles: Mapping[str, Profile]
    | Sequence[Profile]
    | Sequence[str | os.PathLike[str]]
    | None = None,
    policy: str | None = None,
    **kwargs: Any,
) -> Plan:
    """The Python API behind ``hetpipe plan``: ``plan("cluster.yaml", ["profiles/"], policy="ed")``.

    Args:
        cluster: a :class:`Cluster` or a cluster.yaml path.
        profiles: profiles, or CSV files/folders of them.
        policy: ``np``, ``ed``, ``hd`` or ``auto`` (default: ``hd`` where it applies, else ``ed``).
        **kwargs: any other :func:`planner.planner.make_plan` argument (``model``,
            ``batch_size``, ``nm``, ``D``, ``precision``, ...).
    """
    from planner.planner import make_plan

    cl = cluster if isinstance(cluster, Cluster) else load_cluster(cluster)
    if isinstance(profiles, Mapping):
        plist = list(profiles.values())
    else:
        plist = [p for p in profiles or [] if isinstance(p, Profile)]
        paths = [p for p in profiles or [] if not isinstance(p, Profile)]
        plist += load_profile_set(paths) if paths else []
    model, batch = kwargs.get("model"), kwargs.get("batch_size")
    plist = profiles_for(cl, plist, model, batch, kwargs.get("precision", "fp32"))
    return make_plan(cl, plist, policy=policy, **kwargs)
