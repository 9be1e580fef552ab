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
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence

import torch
from torch import nn

from planner.easgd import elastic_difference, exchange_index, exchanges_after
from planner.sync import param
from profiler.errors import ConfigError
from runtime.launch.stop import LazyStop
from runtime.ps.client import PSClient
from runtime.results.metrics import StageResult
from runtime.sync.rule import Grads, StageSync, StageView, SyncSpec

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
    ) -> None:
        self.client, self.params = client, list(params)
        self._stop = stop
        self.nm, self.tau, self.alpha = nm, tau, alpha
        self.result = result
        self.exchanges = 0

    @classmethod
    def create(cls, spec: SyncSpec, view: StageView) -> ElasticSync:
        """The ``easgd`` rule's factory (:mod:`runtime.sync.rule`): the stage's shard client
        and hooks (``spec.params``: ``tau``, ``alpha``).

        Raises:
            ConfigError: a resumed run or snapshots (not supported by this rule yet).
        """
        if spec.first_wave or spec.snapshots is not None:
            raise ConfigError(
                "--sync easgd does not write or resume snapshots yet; drop --checkpoint-every "
                "and --resume (or use --sync wsp)"
            )
        client = PSClient(
            view.vw,
            view.stage,
            [(name, tuple(p.shape)) for name, p in view.params],
            spec.shards,
            timeout_s=spec.timeout_s,
            pull_timeout_s=2 * spec.timeout_s,
        )
        tau, alpha = int(param(spec.params, "tau", 1.0)), param(spec.params, "alpha")
        stop = LazyStop(view.init_method, view.nm, 0)  # every VW stops at one agreed wave
        return cls(client, [p for _, p in view.params], view.nm, tau, alpha, view.result, stop)

    def agreed_total(self, admitted: int, time_up: bool) -> int | None:
        """Every VW runs the same waves (the centre waits for every VW's exchange)."""
        if self._stop is None:
            return super().agreed_total(admitted, time_up)
        return self._stop.total(admitted, time_up)

    def reduce_grads(self, mb: int, grads: Grads) -> Grads:
        """Each VW applies its own gradients."""
        return grads

    def start(self, first_wave: int = 0) -> None:
        """Start from the centre (the shards' initial weights, the same model init)."""
        self._wait_pull(0, into_params=True)

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
        """Call after the update of minibatch ``mb`` (1-based)."""
        if mb % self.nm or not exchanges_after(mb // self.nm - 1, self.tau):
            return
        k = exchange_index(mb // self.nm - 1, self.tau)
        centre = self._wait_pull(k)
        t_push = time.time()
        self.result.pushes.append((k, t_push))
        with torch.no_grad():
            diffs = [
                elastic_difference(p.detach(), c, self.alpha)
                for p, c in zip(self.params, centre, strict=True)
            ]
            for p, d in zip(self.params, diffs, strict=True):
                p.sub_(d)
        self.client.push(k, diffs)
        self.result.log_interval("push", k, t_push, time.time())
        self.exchanges += 1
        log.debug("exchange %d after minibatch %d", k, mb)

    def before_forward(self, mb: int) -> None:
        """Nothing to wait for: the exchange happens inside :meth:`after_update`."""

    def before_update(self, mb: int) -> None:
        """Nothing to fold: the exchange happens inside :meth:`after_update`."""

    def close(self) -> None:
        """Flush the pushes and say goodbye to the shards."""
        t0 = time.perf_counter()
        self.client.close()
        self.result.wait_s += time.perf_counter() - t0
