"""Plans made on the fly: the planner's one function for a run given a cluster, not a plan.

``hetpipe run CLUSTER.yaml`` and ``hetpipe.train`` (without ``plan=``) describe what they
want as a :class:`PlanRequest`; :func:`plan_for_run` turns it into a plan with the planner's
own defaults (the same as ``hetpipe plan``): ``make_plan`` for WSP,
:func:`planner.baseline.allreduce_plan` for the AllReduce baseline, or one VW cut by hand
(:func:`planner.manual.hand_cut_plan`) when stages or cut points are forced. Neither entry
re-derives a default.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from planner.rules import DEFAULT_RULE, layout
from profiler.errors import ConfigError

if TYPE_CHECKING:  # no torch at the CLI's start-up
    from planner.cluster import Cluster
    from planner.plan import Plan
    from profiler.graph import ModelGraph
    from profiler.table import Profile

__all__ = ["PlanRequest", "plan_for_run"]


@dataclass(frozen=True)
class PlanRequest:
    """What a run asks of the planner when it is given a cluster instead of a plan.

    Attributes:
        model: model reference (a user's module: its display name, with ``graph`` given to
            :func:`plan_for_run`).
        batch_size: samples per minibatch.
        nm: minibatches in flight (0 = the planner's choice; a hand cut: 1).
        stages: cut one VW by hand into this many stages (0 = the planner's choice).
        cuts: cut one VW by hand at these layer indices (``None`` = not forced).
        vws: virtual workers (0 = the policy's default).
        policy: ``np``, ``ed``, ``hd`` or ``auto`` (``None`` = the planner's default).
        D: WSP clock-distance threshold recorded in the plan.
        precision: ``fp32`` or ``bf16``.
        sync: a rule of the ``ddp`` layout (``allreduce``) asks for the AllReduce baseline's
            plan; any other rule a pipeline plan (the rule is applied to it afterwards).
        optimizer: the optimizer-state class memory is planned for (``sgd``, ``momentum``,
            ``adam``; the planner's default ``momentum``, as ``hetpipe plan``'s).
        remedy: the run's staleness remedy (``--remedy``): ``predict``'s extra weight copies
            are counted in the memory model (:class:`planner.planner.PlanOptions`).
    """

    model: str = "mlp"
    batch_size: int = 32
    nm: int = 0
    stages: int = 0
    cuts: tuple[int, ...] | None = None
    vws: int = 0
    policy: str | None = None
    D: int = 0
    precision: str = "fp32"
    sync: str = DEFAULT_RULE
    optimizer: str = "momentum"
    remedy: str = "none"

    @property
    def hand_cut(self) -> bool:
        """Whether one VW is cut by hand (stages or cut points forced)."""
        return bool(self.stages) or self.cuts is not None


def plan_for_run(
    cluster: Cluster | None,
    request: PlanRequest,
    graph: ModelGraph | None = None,
    profiles: Sequence[Profile] = (),
) -> Plan:
    """The plan a run of ``request`` trains on ``cluster`` (``None``: CPU devices, one per
    stage, for a hand cut).

    Args:
        cluster: the cluster to plan on.
        request: what the run asks for.
        graph: the model's graph, for a user's module (a hand cut); ``None``: built from
            ``request.model`` when needed.
        profiles: the profiles to plan on (an emulated cluster's CPU profile among them: the
            front end asks the profiler first, :func:`hetpipe.planning.plan_on_the_fly`).

    Raises:
        ConfigError: ``--stages`` with ``--vws``/``--policy``, or no cluster to plan on.
        PlanError: the model fits nowhere, more stages than layers, ...
    """
    r = request
    if layout(r.sync) == "ddp":
        from planner.baseline import allreduce_plan

        if cluster is None:
            raise ConfigError("the AllReduce baseline needs a cluster to plan on; give one")
        return allreduce_plan(cluster, r.model, r.batch_size, profiles=profiles or None,
                              optimizer=r.optimizer)  # fmt: skip
    if r.hand_cut and (r.vws > 1 or r.policy not in (None, "ed")):
        raise ConfigError("--stages hand-cuts one VW; drop --stages, or drop --vws/--policy")
    if r.hand_cut or graph is not None or cluster is None:
        from planner.manual import hand_cut_plan

        graph = graph if graph is not None else _graph(r.model, r.batch_size)
        hand = hand_cut_plan(graph, r.model, r.batch_size, r.nm, cluster, r.stages, r.cuts)
        return replace(hand, precision=r.precision)
    from planner.planner import PlanOptions, make_plan

    return make_plan(cluster, list(profiles), model=r.model, batch_size=r.batch_size,
                     nm=r.nm or None, num_vws=r.vws or None, policy=r.policy, D=r.D,
                     precision=r.precision, optimizer=r.optimizer,
                     options=PlanOptions(remedy=r.remedy))  # fmt: skip


def _graph(model: str, batch_size: int) -> ModelGraph:
    """The graph of a model reference (built on the meta device where it can be)."""
    from profiler.graph import ModelGraph
    from profiler.models import resolve_model_for_graph

    return ModelGraph.from_spec(resolve_model_for_graph(model, batch_size))
