"""One stage's side of elastic averaging SGD (``--sync easgd``, :mod:`planner.easgd`).

Each VW trains its own replica with its own optimizer and exact local staleness
(:class:`runtime.stage.weights.VersionedWeights`). After the update that ends wave ``c`` with
``exchanges_after(c, tau)`` (exchange ``k``), :class:`ElasticSync`:

1. pulls the centre ``c_k`` (one flat message per shard; the shards answer once every VW made
   exchange ``k - 1``: a WSP pull of global clock ``k``, without any own update added);
2. computes the elastic difference ``d = alpha (w - c_k)`` of its master weights, subtracts it
   in place (the master *is* version ``mb`` at this point: no stashed version holds it yet, so
   every later minibatch sees the exchanged weights and no earlier one does);
3. pushes ``d`` as its update of wave ``k``; the shards add the VWs' ``d`` in ``(vw, stage)``
   order once all arrived (the WSP shard rule at ``D = 0``): the centre ``c_{k+1}``.

The centre is the model the run exports and evaluates. The stage of a VW exchange
independently (each holds its own parameters); they agree because they all exchange after the
same minibatch.

Snapshots: the shards' clock counts exchanges, so a snapshot at clock ``k`` holds the centre
``c_k`` (the shards' parts) and, from every stage, its own weights right after its elastic
update of exchange ``k - 1``, its optimizer and RNG state, buffers and data position
(:func:`planner.easgd.waves_at` ``(k, tau)`` waves). A resumed run starts at that wave from
those weights. With ``Nm = 1`` it equals the uninterrupted run; with ``Nm > 1`` the stashed
weight versions of the minibatches in flight are not in the part (as with WSP,
``docs/fault_tolerance.md``), so the first ``Nm - 1`` minibatches after the resume run on the
exchanged weights instead.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence

import torch
from torch import nn

from planner.easgd import (
    elastic_difference,
    exchange_index,
    exchanges_after,
    stop_waves,
    waves_at,
)
from planner.sync import param
from profiler.errors import ConfigError, HetPipeRuntimeError
from runtime.defaults import vw_wait_s
from runtime.persist.snapshot import (
    SnapshotSpec,
    load_part,
    read_manifest,
    snapshot_dir,
    write_part,
)
from runtime.persist.stage_part import restore_buffers
from runtime.ps.client import PSClient
from runtime.results.metrics import StageResult
from runtime.sync.rule import Grads, StageSync, StageView, SyncSpec
from runtime.sync.stop import LazyStop

__all__ = ["ElasticSync"]

log = logging.getLogger(__name__)


class ElasticSync(StageSync):
    """Exchanges a stage's weights with the centre every ``tau`` waves.

    Args:
        client: the stage's parameter-server client (its parameter order = ``params``).
        params: the stage's master parameters, in the client's order.
        nm: minibatches per wave.
        tau: waves between exchanges.
        alpha: the moving rate.
        result: the stage's result accumulator (waiting time and exchanges go there).
        stop: stage 0 under a time limit: where the VWs agree on the last wave (``None``:
            this VW stops alone).
        first_wave: the wave this run starts at (a resumed run: ``waves_at(clock, tau)``).
        snapshots: the run's snapshots (``None``: none): before pushing exchange ``k - 1`` the
            stage writes its part of the snapshot at centre clock ``k`` when ``k`` is a
            multiple of ``snapshots.every``: its own weights (they differ from the centre),
            optimizer state, data position and RNG state.
        where: ``vw<k>-stage<s>``, the stage's part name.
        optimizer: the stage's local optimizer (its state is in the part).
        buffers: the stage's buffers by original name (in the part too).
    """

    def __init__(
        self,
        client: PSClient,
        params: Sequence[nn.Parameter],
        nm: int,
        tau: int,
        alpha: float,
        result: StageResult,
        stop: LazyStop | None = None,
        first_wave: int = 0,
        snapshots: SnapshotSpec | None = None,
        where: str = "stage",
        optimizer: torch.optim.Optimizer | None = None,
        buffers: dict[str, torch.Tensor] | None = None,
    ) -> None:
        self.client, self.params = client, list(params)
        self.buffers = buffers or {}
        self._stop = stop
        self.nm, self.tau, self.alpha = nm, tau, alpha
        self.result = result
        self.exchanges = 0
        self.first_wave, self.snapshots, self.where = first_wave, snapshots, where
        self.optimizer = optimizer
        self._written = first_wave // tau  # the centre clock of the last part written
        self._waves = first_wave  # waves done (global numbering)
        self._prepared: tuple[int, list[torch.Tensor], float] | None = None  # to push

    @classmethod
    def create(cls, spec: SyncSpec, view: StageView) -> ElasticSync:
        """The ``easgd`` rule's factory (:mod:`runtime.sync.rule`): the stage's shard client
        and hooks (``spec.params``: ``tau``, ``alpha``); a resumed run starts at
        ``spec.first_wave`` (a whole number of exchanges)."""
        client = PSClient(
            view.vw,
            view.stage,
            [(name, tuple(p.shape)) for name, p in view.params],
            spec.shards,
            timeout_s=vw_wait_s(spec.timeout_s),  # a live shard may be busy (a lost VW's
            pull_timeout_s=vw_wait_s(spec.timeout_s),  # connections, a snapshot): not a hang
            paced=view.links,
            queues=view.queues,
        )
        tau, alpha = int(param(spec.params, "tau", 1.0)), param(spec.params, "alpha")
        if spec.first_wave % tau:
            raise ConfigError(
                f"--sync easgd resumes at an exchange: wave {spec.first_wave} is not a multiple "
                f"of tau {tau}; resume from a snapshot of this run"
            )
        nm = view.nm  # every VW stops at one agreed wave, on an exchange
        stop = LazyStop(view.init_method, nm, 0, waves=lambda a: stop_waves(a, nm, tau))
        params = [p for _, p in view.params]
        return cls(client, params, view.nm, tau, alpha, view.result, stop, spec.first_wave,
                   spec.snapshots, view.where, view.weights.optimizer,
                   dict(view.buffers))  # fmt: skip

    def agreed_total(self, admitted: int, time_up: bool) -> int | None:
        """Every VW runs the same waves (the centre waits for every VW's exchange)."""
        if self._stop is None:
            return super().agreed_total(admitted, time_up)
        return self._stop.total(admitted, time_up)

    def reduce_grads(self, mb: int, grads: Grads) -> Grads:
        """Each VW applies its own gradients."""
        return grads

    def start(self, first_wave: int = 0) -> None:
        """Start from the centre (the shards' initial weights, the same model init); a resumed
        run from this stage's own weights, optimizer and RNG state in the snapshot."""
        if self.first_wave == 0 or self.snapshots is None:
            self._wait_pull(0, into_params=True)
            return
        clock = self.first_wave // self.tau
        manifest = read_manifest(snapshot_dir(self.snapshots.directory, clock))
        part = load_part(manifest, self.where)
        where = manifest.path / f"{self.where}.pt"
        if not isinstance(part, dict) or part.get("kind") != "hetpipe-elastic-stage":
            raise HetPipeRuntimeError(f"{where}: not a hetpipe EASGD stage part")
        if int(part["data_position"]) != self.first_wave * self.nm:
            raise HetPipeRuntimeError(
                f"{where}: data position {part['data_position']}, expected "
                f"{self.first_wave * self.nm} (a snapshot of another Nm or tau)"
            )
        with torch.no_grad():
            for p, w in zip(self.params, part["weights"], strict=True):
                p.copy_(w)
        if self.optimizer is not None:
            self.optimizer.load_state_dict(part["optimizer"])
        torch.set_rng_state(part["rng"])
        if "buffers" in part:  # a part written before buffers were: the initial ones
            restore_buffers(self.buffers, part["buffers"], where)

    def _checkpoint(self, clock: int) -> None:
        """Write this stage's part of the snapshot at centre clock ``clock`` (its state now:
        right after the elastic update of exchange ``clock - 1``)."""
        snaps = self.snapshots
        if snaps is None or snaps.every <= 0 or clock <= self._written:
            return
        payload = {
            "kind": "hetpipe-elastic-stage",
            "clock": clock,
            "data_position": waves_at(clock, self.tau) * self.nm,
            "weights": [p.detach().clone() for p in self.params],
            "optimizer": self.optimizer.state_dict() if self.optimizer is not None else {},
            "rng": torch.get_rng_state(),
            "buffers": {n: b.detach().clone() for n, b in self.buffers.items()},
        }
        write_part(snaps, clock, self.where, payload)
        self._written = clock

    def _wait_pull(self, clock: int, into_params: bool = False) -> list[torch.Tensor]:
        t0 = time.perf_counter()
        res = self.client.pull(clock, include_own=False, out=self.params if into_params else None)
        waited = time.perf_counter() - t0
        if waited > 1e-4:
            end = time.time()
            self.result.log_interval("wait", clock, end - waited, end)
        self.result.wait_s += waited
        self.result.busy_s -= waited  # the hook runs inside a timed task: waiting is not work
        self.result.clocks.append((clock, res.clock))
        return list(res.tensors)

    def after_update(self, mb: int) -> None:
        """Call after the update of minibatch ``mb`` (1-based, this run's numbering): at an
        exchange, pull the centre and move the weights; :meth:`post_update` pushes."""
        if mb % self.nm:
            return
        wave = self.first_wave + mb // self.nm - 1
        self._waves = wave + 1
        if not exchanges_after(wave, self.tau):
            return
        k = exchange_index(wave, self.tau)
        centre = self._wait_pull(k)
        t_push = time.time()
        self.result.pushes.append((k, t_push))
        with torch.no_grad():
            diffs = [
                elastic_difference(p.detach(), c.to(p.device), self.alpha)  # pull: host
                for p, c in zip(self.params, centre, strict=True)
            ]
            for p, d in zip(self.params, diffs, strict=True):
                p.sub_(d)
        if self.snapshots is not None and (k + 1) % max(1, self.snapshots.every) == 0:
            self._checkpoint(k + 1)  # before the push: an exchange the shards hold has its part
        self._prepared = (k, diffs, t_push)
        self.exchanges += 1
        log.debug("exchange %d after minibatch %d", k, mb)

    def post_update(self, mb: int) -> None:
        """Push the exchange's difference :meth:`after_update` computed (none: nothing)."""
        if self._prepared is None:
            return
        k, diffs, t_push = self._prepared
        self._prepared = None
        self.client.push(k, diffs)
        self.result.log_interval("push", k, t_push, time.time())

    def before_forward(self, mb: int) -> None:
        """Nothing to wait for: the exchange happens inside :meth:`after_update`."""

    def before_update(self, mb: int) -> None:
        """Nothing to fold: the exchange happens inside :meth:`after_update`."""

    def close(self) -> None:
        """Flush the pushes, write the final part (when the run ended on an exchange: the
        shards write theirs at their final clock) and say goodbye to the shards."""
        t0 = time.perf_counter()
        if self._waves % self.tau == 0 and self._waves > self.first_wave:
            self._checkpoint(self._waves // self.tau)
        self.client.close()
        self.result.wait_s += time.perf_counter() - t0
