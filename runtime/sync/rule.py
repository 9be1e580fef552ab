"""The synchronisation rule across virtual workers: one plug-in, the same launcher for every rule.

Today's rules: ``wsp`` (Wave Synchronous Parallel through parameter-server shards, with D;
:class:`runtime.sync.wave.WaveSync`), ``backup`` (synchronous SGD with backup VWs;
:mod:`runtime.sync.backup`), ``easgd`` (elastic averaging;
:class:`runtime.sync.elastic.ElasticSync`), ``allreduce`` (BSP data parallelism: gradients
averaged over the VWs every minibatch; :class:`runtime.sync.allreduce.AllReduceSync`) and
``local`` (one VW alone; :class:`LocalSync`).

How to add a rule: one vertical slice, no edit anywhere else.

1. **Pure logic** -- a module of plain functions over plain data in ``planner/`` (like
   :mod:`planner.wsp`, :mod:`planner.backup`), unit-tested without processes, imported by the
   simulator to predict and by your runtime class to execute: never two copies.
2. **Process side** -- ``runtime/sync/<name>.py``: a subclass of :class:`StageSync`
   overriding the hooks it needs, with a ``create(spec, view)`` factory; when the shards must
   treat a wave differently (how a complete wave's update folds into the global weights), a
   :class:`WaveFold`.
3. **Register** it: one :class:`planner.rules.SyncRule` in :data:`planner.rules.BUILTIN` (its
   name, parameters with ranges, defaults and help -- the CLI makes ``--<param>`` of each for
   ``hetpipe plan``, ``simulate`` and ``run`` --, its check against a plan, its wave player,
   whether it keeps ``D``, what each VW trains on, how the launcher lays it out) and one
   :class:`runtime.sync.registry.RuleParts` in :data:`runtime.sync.registry.BUILTIN`. A plan
   names it in ``sync`` and sets the parameters in ``sync_params`` (plan file: ``sync: easgd``,
   ``sync_params: {alpha: 0.5}``); the plan loader checks both. They reach every process in
   the frozen :class:`SyncSpec` of its job (``spec.rule``, ``spec.params``; read one with
   :func:`planner.sync.param`). A rule kept outside the repository: a module named by
   ``$HETPIPE_RULES`` that defines ``RULE`` and ``PARTS`` (``tests/toy_rule.py``).

Who calls what (nothing else in the launcher or the worker knows the rule):

- the launcher (:mod:`runtime.launch`) puts one :class:`SyncSpec` into every process's job
  and starts shard processes when the rule's ``uses_shards``;
- the stage worker's constructor calls the rule's ``create(spec, view)`` once, after its
  module is built and the process group is up: the place to make shard clients or the rule's
  own process groups (every stage process calls it once; ``spec.groups`` lists the ranks of
  each stage position; a rule with shards that needs new groups must create them in the shard
  processes too, in the same order);
- the worker calls the :class:`StageSync` hooks: ``start`` once after the start barrier;
  ``before_forward(mb)`` before each forward of minibatch ``mb``; ``reduce_grads(mb, grads)``
  after each backward, before the update (returns the gradients to apply);
  ``before_update(mb)`` / ``after_update(mb)`` around each local update -- a *wave boundary*
  is ``mb % nm == 0``; ``update_may_wait(mb)`` says whether ``before_update`` may block --, then ``post_update(mb)`` to send what ``after_update`` prepared
  (after the update's paced window on an emulated device, as a GPU sends after its step); stage 0 asks ``rule_total(total, admitted)`` how many minibatches
  the rule runs in all (backup workers: fewer for a VW that skipped waves) and, under a time
  limit, ``agreed_total(admitted, time_up)``; ``close()`` after the last task;
- a shard process folds each complete wave with the rule's :class:`WaveFold` (``None``: the
  plain sum, optionally with server momentum: :class:`runtime.ps.core.ShardCore`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from planner.rules import Layout, get_rule, plugin_modules
from planner.sync import SyncParams
from runtime.defaults import TIMEOUT_S
from runtime.link_pacing import NO_LINKS, StageLinks

if TYPE_CHECKING:
    from torch import Tensor, nn

    from runtime.persist.snapshot import SnapshotSpec
    from runtime.ps.layout import ShardSpec
    from runtime.results.metrics import StageResult
    from runtime.send_queues import SendQueues
    from runtime.stage.tied import TiedGrads
    from runtime.stage.weights import VersionedWeights

__all__ = ["Grads", "LocalSync", "StageSync", "StageView", "SyncSpec", "WaveFold"]

Grads = dict[str, "Tensor | None"]


@dataclass(frozen=True)
class SyncSpec:
    """The rule part of a process's job (frozen; the same for every process of a run).

    Attributes:
        rule: the rule's name (:func:`planner.rules.rules`).
        params: its parameters (``Plan.sync_params``).
        D: WSP clock-distance threshold.
        shards: every parameter-server shard's spec (empty: no shards).
        snapshots: the run's snapshots (``None``: none).
        first_wave: the wave this run starts at (a resumed run's snapshot clock).
        overlap_pulls: WSP: keep running tasks while a pull is in flight.
        timeout_s: timeout of the rule's own waits (pushes, pulls, collectives).
        groups: the global ranks of each stage position over the VWs (``groups[s]``: every
            VW's stage ``s``), for rules that reduce across VWs.
        last_wave: the global clock the run ends at (backup workers: a VW that skipped waves
            stops there too, :mod:`runtime.sync.backup`).
        rejoined: a restarted VW's new incarnation (``--on-failure restart``), starting at
            ``first_wave`` from the global weights: its optimizer state comes from the newest
            committed snapshot at or below that clock that holds its part (none: fresh).
        plugins: the rule plug-in modules of ``$HETPIPE_RULES`` where the spec was made (a
            forkserver child does not see the launcher's environment, a job does).
    """

    rule: str = "local"
    params: SyncParams = ()
    D: int = 0
    shards: tuple[ShardSpec, ...] = ()
    snapshots: SnapshotSpec | None = None
    first_wave: int = 0
    overlap_pulls: bool = True
    timeout_s: float = TIMEOUT_S
    groups: tuple[tuple[int, ...], ...] = ()
    rejoined: bool = False
    last_wave: int = 0
    plugins: tuple[str, ...] = field(default_factory=plugin_modules)

    @property
    def layout(self) -> Layout:
        """How the launcher lays the rule out (:attr:`planner.rules.SyncRule.layout`)."""
        return get_rule(self.rule, self.plugins).layout

    @property
    def first_clock(self) -> int:
        """The shards' clock at the start (a resumed run's snapshot clock): ``first_wave`` over
        the waves one tick covers (:attr:`planner.rules.SyncRule.waves_per_clock`: ``easgd``,
        whose shards count exchanges, ``tau``)."""
        return self.first_wave // get_rule(self.rule, self.plugins).waves_per_clock(
            dict(self.params)
        )


@dataclass(frozen=True)
class StageView:
    """What a rule sees of its stage when the worker creates it.

    Attributes:
        rank, vw, stage: the stage's global rank and place.
        nm: minibatches per wave.
        where: the stage's snapshot part name and log label (``vw0-stage1``).
        params: ``(global name, master parameter)`` in the stage's order.
        weights: the stage's weight versions and optimizer.
        result: the stage's result (wait time, clock trace and timeline go there).
        tied: the stage's tied parameters (held by several stages of its VW), if any.
        init_method: the process group's rendezvous (a rule's own store can live beside it:
            :func:`runtime.sync.stop.stop_store`).
        group: the group of the stage's parameter-server and pipeline messages, numbered
            like the world (a restarted VW's, :mod:`runtime.ps.rejoin`; ``None``: default).
        buffers: ``(original name, buffer)`` of the stage's module (a snapshot holds them).
        links: the emulated links the rule's transfers are paced to (:mod:`runtime.link_pacing`).
        last: the pipeline's last stage (its tasks forward and update minibatches in order).
        queues: the stage's sender-side link queues its pushes are charged on (``None``: each
            push paced on its own, :mod:`runtime.send_queues`).
    """

    rank: int
    vw: int
    stage: int
    nm: int
    where: str
    params: tuple[tuple[str, nn.Parameter], ...]
    weights: VersionedWeights
    result: StageResult
    tied: TiedGrads | None = None
    init_method: str = "env://"
    group: Any = None
    buffers: tuple[tuple[str, Tensor], ...] = ()
    links: StageLinks = NO_LINKS
    last: bool = False
    queues: SendQueues | None = None


class StageSync:
    """A stage's side of a synchronisation rule: the hooks the stage worker calls.

    This base class is the ``local`` rule (one VW alone: nothing to synchronise); a rule
    subclasses it and overrides only the hooks it needs, so a hook added later (with a
    default here) breaks no rule.
    """

    def start(self, first_wave: int) -> None:
        """Once, after the start barrier, before the first task (WSP: pull the weights)."""

    def before_forward(self, mb: int) -> None:
        """Before the forward of minibatch ``mb`` (1-based, this run's numbering)."""

    def reduce_grads(self, mb: int, grads: Grads) -> Grads:
        """After the backward of ``mb``: the gradients to apply (AllReduce: the mean)."""
        return grads

    def before_update(self, mb: int) -> None:
        """Before the local update of ``mb``."""

    def update_may_wait(self, mb: int) -> bool:
        """Whether :meth:`before_update` of ``mb`` may block (WSP, D = 0: on a pull in flight
        that it folds in): an emulated device then sends ``mb``'s gradients first."""
        return False

    def after_update(self, mb: int) -> None:
        """After the local update of ``mb`` (a wave ends when ``mb % nm == 0``)."""

    def post_update(self, mb: int) -> None:
        """After :meth:`after_update` of ``mb``, once the update is over on the device (an
        emulated device: when its paced window ends; a real one: right away): send the
        messages :meth:`after_update` prepared (WSP: the wave's push). A rule that sends
        nothing does nothing here."""

    def agreed_total(self, admitted: int, time_up: bool) -> int | None:
        """Stage 0 under a time limit, between tasks: the minibatches this VW runs in all, or
        ``None`` while the run goes on. Alone, a VW stops admitting when its own time is up;
        several VWs must agree on one end (WSP: a wave through a store; AllReduce: a flag in
        the step's collective), or one would wait forever for another.

        Args:
            admitted: minibatches this stage 0 admitted so far.
            time_up: whether this VW's own time limit has passed.
        """
        return admitted if time_up else None

    def rule_total(self, total: int, admitted: int) -> int:
        """Stage 0, between tasks: the minibatches this VW runs in all by the rule's own end
        (``total`` asked; backup workers: fewer for a VW that skipped waves). Never fewer
        than ``admitted``, rounded up to a whole wave."""
        return total

    def close(self) -> None:
        """After the last task: flush, write the final snapshot part, say goodbye."""


class WaveFold(Protocol):
    """What a shard does with a complete wave (a rule whose shards differ from WSP's sum)."""

    def fold(self, weights: Tensor, update: Tensor, state: dict[str, Tensor]) -> None:
        """Fold the wave's summed update (the shard's flat layout) into ``weights`` in place;
        ``state`` is the shard's checkpointed optimizer state (tensors it may update)."""


class LocalSync(StageSync):
    """The ``local`` rule: one VW alone, nothing to synchronise (the base class's hooks)."""

    @classmethod
    def create(cls, spec: SyncSpec, view: StageView) -> LocalSync:
        """The rule's factory (see the module doc)."""
        return cls()
