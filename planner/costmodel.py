"""The planner's cost model: stage time and stage memory of a pipeline partition (paper Sec. 4, 7).

A partition of a virtual worker (VW) with GPUs ``g_0 .. g_{K-1}`` in pipeline order is a list
of cut points; stage ``j`` runs layers ``[a, b)`` on ``g_j``. Its time per minibatch is::

    time_ms = fwd_ms + bwd_ms                       (its layers on g_j's GPU type)
            + link(g_{j-1}, g_j).time(cut_bytes[a])   (receive activations, forward)
            + link(g_j, g_{j+1}).time(cut_bytes[b])   (receive gradients, backward)

where ``cut_bytes[k]`` counts every tensor crossing cut ``k`` (skip connections included).
Its memory with ``Nm`` minibatches in flight (the shared memory model of the project)::

    static = param_bytes * (2 + optimizer_state_factor) + buffer_bytes + (Nm - 1) * param_bytes
             + remedy_copies * param_bytes      (--remedy predict: planner.staleness)
    memory = static + in_flight(j, K, Nm) * (saved_bytes + cut_bytes[a])

with ``in_flight`` the bound of the cost model's pipeline schedule
(:meth:`planner.schedule.Schedule.in_flight_bound`, :meth:`CostModel.in_flight`).

That is the all-keep case of :mod:`planner.offload`: a cost model carries one uniform memory
placement (:meth:`CostModel.with_placement`) that changes the multipliers of the same prefix
sums, so every partitioner sees it. The partitioners charge each stage its busy time
(:meth:`CostModel.busy_ms`, :func:`planner.offload.busy_ms`): compute plus recompute, or the
host-link time of its offloaded bytes on its GPU's share of the node's link when that is
longer; they check host memory (the GPU's share of its node's) beside device memory
(:meth:`CostModel.fits_matrix`). :meth:`CostModel.stage_memory` (:mod:`planner.stagecost`)
evaluates any placement of one stage exactly (device, host and host-link bytes, recompute and
exposed transfer time, both charged to ``bwd_ms``), with the same functions.

Candidate cuts: every cut ``1 .. L-1`` by default (the partitioners are then exact). Given a
``max_cuts``, graphs with more cut points (e.g. resnet152's 563 fx layers) are *coarsened* to
the cuts crossed by exactly one tensor (block boundaries): an approximation (``hetpipe plan
--max-cuts``), whose plan records a proven lower bound on the exact optimum. The DP, the search
and the MILP use the same candidate set, so their optima stay comparable. The arrays below are indexed by *position* ``p`` in the candidate set
``pos = [0, c_1, ..., L]``; a stage is a position range ``[p, q)``.
"""

from __future__ import annotations

import copy
import logging
import os
from collections import Counter
from collections.abc import Callable, Mapping, Sequence

import numpy as np

from planner.cluster import PCIE, Device, Link, parse_links
from planner.offload import (
    KEEP_ALL,
    Coefficients,
    HostShare,
    MemoryPlacement,
    busy_ms,
    coefficients,
    host_coefficients,
    host_link_ms,
    recompute_factor,
    transfer_coefficients,
)
from planner.schedule import HETPIPE, Schedule
from planner.stagecost import StageCosts
from planner.staleness import check_remedy
from profiler.crossing import crossing_sets
from profiler.errors import ConfigError, ProfileError
from profiler.inputs import load_document
from profiler.table import Profile

__all__ = [
    "CostModel",
    "LinkFn",
    "candidate_cuts",
    "load_links",
    "optimizer_factor",
]

log = logging.getLogger(__name__)

LinkFn = Callable[[Device, Device], Link]
"""The link between two devices (``Cluster.link`` or a measured override)."""

_OPTIMIZERS = {"sgd": 0.0, "momentum": 1.0, "sgd-momentum": 1.0, "adam": 2.0, "adamw": 2.0}


def optimizer_factor(name: str) -> float:
    """Optimizer state per parameter byte: 0 for plain SGD, 1 for SGD momentum, 2 for Adam.

    Raises:
        ConfigError: unknown optimizer name.
    """
    try:
        return _OPTIMIZERS[name.lower()]
    except KeyError:
        raise ConfigError(
            f"unknown optimizer {name!r}; use one of {', '.join(_OPTIMIZERS)}"
        ) from None


def candidate_cuts(profile: Profile, max_cuts: int | None = None) -> list[int]:
    """Cut points the partitioners may use, as layer indices ``0 < k < L``.

    Args:
        profile: any profile of the model (the graph is the same for every GPU type).
        max_cuts: keep every cut when there are at most this many; otherwise keep only the
            cuts crossed by exactly one tensor besides those that cross more than half of all
            cuts (block boundaries; the labels and attention mask of a language model cross
            everywhere). ``None`` keeps every cut.

    Returns:
        Sorted layer indices.
    """
    n = len(profile.table)
    every = list(range(1, n))
    if max_cuts is None or len(every) <= max_cuts:
        return every
    cross = crossing_sets(profile.input_indices())
    # tensors live across most of the model (a language model's labels and attention mask)
    # cross every block boundary: they do not count, so the boundaries stay candidates
    span = Counter(i for c in cross for i in c)
    ambient = {i for i, n in span.items() if n > len(every) // 2}
    single = [k for k in every if len(set(cross[k]) - ambient) == 1]
    log.info("coarsened %d cut points to %d single-tensor cuts", len(every), len(single))
    return single


def load_links(path: str | os.PathLike[str]) -> dict[str, Link]:
    """Read measured links (``intra_node``/``inter_node`` with ``bandwidth`` and ``latency``).

    The file is a YAML mapping like ``cluster.yaml``'s ``links:`` section (``hetpipe profile
    --links`` writes one); a top-level ``links:`` key is accepted too.

    Raises:
        ConfigError: unreadable file or a missing/invalid field.
    """
    return parse_links(load_document(path, "links file", ConfigError), os.fspath(path))


class CostModel(StageCosts):
    """Prefix-summed per-layer costs of one model for every GPU type of a cluster.

    Args:
        profiles: one profile per GPU type (same layers in the same order).
        link: the link between two devices.
        optimizer_state_factor: optimizer state bytes per parameter byte.
        max_cuts: see :func:`candidate_cuts`.
        memory_type: GPU type whose profile gives the memory columns (paper Sec. 7 measures
            memory on one type); default the first profile.
        host_link: the GPU <-> host-memory link of a node (offloaded bytes cross it).
        hosts: each node's :class:`~planner.offload.HostShare` (GPUs sharing the host link,
            host memory per GPU), by node name; a node not listed: one GPU, unbounded memory.
        remedy: the run's staleness remedy (:data:`planner.staleness.REMEDIES`): ``predict``
            keeps more weight copies (:func:`planner.staleness.remedy_weight_copies`).
        schedule: the pipeline schedule whose in-flight bound sizes every stage's memory.

    Raises:
        ProfileError: profiles disagree on the layers.
    """

    def __init__(
        self,
        profiles: Mapping[str, Profile],
        link: LinkFn,
        optimizer_state_factor: float = 1.0,
        max_cuts: int | None = None,
        memory_type: str | None = None,
        host_link: Link = PCIE,
        hosts: Mapping[str, HostShare] | None = None,
        remedy: str = "none",
        schedule: Schedule = HETPIPE,
    ) -> None:
        if not profiles:
            raise ProfileError("no profiles given to the cost model")
        ref_type = memory_type if memory_type is not None else next(iter(profiles))
        ref = profiles[ref_type]
        names = ref.layers
        for t, prof in profiles.items():
            if prof.layers != names:
                raise ProfileError(
                    f"profile for {t!r} ({prof.meta.model}) has different layers than the one for "
                    f"{ref_type!r} ({ref.meta.model}); profile both with the same model"
                )
        self.layer_names: tuple[str, ...] = tuple(names)
        self.link = link
        self.schedule = schedule
        self.optimizer_state_factor = float(optimizer_state_factor)
        self.remedy = check_remedy(remedy)
        self.host_link = host_link
        self.hosts: dict[str, HostShare] = dict(hosts or {})
        self.placement: MemoryPlacement = KEEP_ALL
        cuts = candidate_cuts(ref, max_cuts)
        self.positions: np.ndarray = np.array([0, *cuts, len(names)], dtype=np.int64)
        table = ref.table
        self.layer_cut_bytes: np.ndarray = np.array(ref.cut_bytes(), dtype=np.int64)
        """Bytes crossing every layer cut ``k = 0..L`` (not only the candidates)."""
        self.layer_param_bytes: np.ndarray = table["param_bytes"].to_numpy(np.int64)
        """Parameter bytes of every layer."""
        self.cut_bytes: np.ndarray = self.layer_cut_bytes[self.positions]
        self.param_prefix = self._prefix(table["param_bytes"].to_numpy(np.int64))
        self.buffer_prefix = self._prefix(table["buffer_bytes"].to_numpy(np.int64))
        self.saved_prefix = self._prefix(table["saved_bytes"].to_numpy(np.int64))
        self._comp: dict[str, np.ndarray] = {}  # compute_ms per type (cached)
        self.fwd_prefix: dict[str, np.ndarray] = {}
        self.bwd_prefix: dict[str, np.ndarray] = {}
        for t, prof in profiles.items():
            self.fwd_prefix[t] = self._prefix(prof.table["fwd_ms"].to_numpy(np.float64))
            self.bwd_prefix[t] = self._prefix(prof.table["bwd_ms"].to_numpy(np.float64))

    def _prefix(self, values: np.ndarray) -> np.ndarray:
        full = np.concatenate([[0], np.cumsum(values)])
        return full[self.positions]

    # ------------------------------------------------------------ sizes

    @property
    def num_layers(self) -> int:
        """Layers of the model graph (placeholders and output included)."""
        return len(self.layer_names)

    @property
    def num_segments(self) -> int:
        """Segments between consecutive candidate cuts (``C``; positions are ``0..C``)."""
        return len(self.positions) - 1

    @property
    def types(self) -> tuple[str, ...]:
        """GPU types with a profile."""
        return tuple(self.fwd_prefix)

    def total_param_bytes(self) -> int:
        """Bytes of all parameters."""
        return int(self.param_prefix[-1])

    def compute_ms(self, gpu_type: str) -> np.ndarray:
        """Prefix sums over positions of fwd+bwd ms on ``gpu_type`` (a lower bound on a stage's
        busy time under any placement, :meth:`busy_ms`).

        Raises:
            ProfileError: no profile for that type.
        """
        try:
            fwd, bwd = self.fwd_prefix[gpu_type], self.bwd_prefix[gpu_type]
        except KeyError:
            raise ProfileError(
                f"no profile for GPU type {gpu_type!r} (have: {', '.join(self.types)})"
            ) from None
        return fwd + bwd

    def comm_ms(self, link: Link) -> np.ndarray:
        """Milliseconds to move the tensors crossing each position over ``link`` (0 at the ends)."""
        return np.array([link.time_s(float(b)) * 1e3 for b in self.cut_bytes])

    def with_placement(self, placement: MemoryPlacement) -> CostModel:
        """This cost model with every stage under ``placement`` (shares the prefix arrays)."""
        other = copy.copy(self)
        other.placement = placement
        return other

    def coefficients(self, in_flight: int, nm: int) -> Coefficients:
        """Device-memory multipliers of params, saved and cut bytes (:mod:`planner.offload`)."""
        return coefficients(
            self.placement, nm, in_flight, self.optimizer_state_factor, self.remedy_copies(nm)
        )

    def static_factor(self, nm: int) -> float:
        """Param-byte multiplier of the static memory: weights, grads, optimizer, ``Nm-1`` versions
        (those the placement keeps on the device)."""
        return self.coefficients(1, nm).param

    def same_times(self, n_stages: int, nm_a: int, nm_b: int) -> bool:
        """Whether every stage of ``n_stages`` takes the same time at ``nm_a`` and ``nm_b`` in
        flight (the placement recomputes and moves the same classes at both)."""

        def rule(nm: int) -> list[tuple[float, Coefficients]]:
            o = self.optimizer_state_factor
            ks = [self.in_flight(j, n_stages, nm) for j in range(n_stages)]
            pl = self.placement
            return [(recompute_factor(pl, k), transfer_coefficients(pl, nm, k, o)) for k in ks]

        return rule(nm_a) == rule(nm_b)

    # ------------------------------------------------------------ matrices for the DP

    def busy_ms(
        self, gpu: Device, in_flight: int, nm: int, p: np.ndarray, q: np.ndarray
    ) -> np.ndarray:
        """Busy ms on ``gpu`` of a stage over positions ``[p, q)`` (arrays, broadcast) holding
        ``in_flight`` minibatches, under the cost model's placement: fwd + bwd + recompute, or
        the host-link time of its offloaded bytes when longer (:func:`planner.offload.busy_ms`).
        Entries with ``q <= p`` are meaningless."""
        t, k = gpu.type, in_flight
        if t not in self._comp:
            self._comp[t] = self.compute_ms(t)
        rf = recompute_factor(self.placement, k)
        tc = transfer_coefficients(self.placement, nm, k, self.optimizer_state_factor)
        comp = self._comp[t][q] - self._comp[t][p]
        if rf:
            comp = comp + rf * (self.fwd_prefix[t][q] - self.fwd_prefix[t][p])
        if tc.zero:
            return np.asarray(comp)
        moved = (
            tc.param * (self.param_prefix[q] - self.param_prefix[p])
            + tc.saved * (self.saved_prefix[q] - self.saved_prefix[p])
            + tc.cut * self.cut_bytes[p]
        )
        host = host_link_ms(
            np.asarray(moved, dtype=np.float64), self.host_link, self.host_share(gpu).sharers
        )
        return busy_ms(np.asarray(comp, dtype=np.float64), host)

    def time_matrix(self, gpus: Sequence[Device], j: int, nm: int = 1) -> np.ndarray:
        """``M[p, q]``: time in ms of stage ``j`` over positions ``[p, q)`` with ``nm`` in flight
        (``inf`` if ``q <= p``)."""
        pos = np.arange(self.num_segments + 1)
        k = self.in_flight(j, len(gpus), nm)
        busy = self.busy_ms(gpus[j], k, nm, pos[:, None], pos[None, :])
        comp = np.zeros(len(pos))
        recv = self.comm_ms(self.link(gpus[j - 1], gpus[j])) if j > 0 else np.zeros(len(comp))
        send = (
            self.comm_ms(self.link(gpus[j], gpus[j + 1]))
            if j + 1 < len(gpus)
            else np.zeros(len(comp))
        )
        m = busy + recv[:, None] + send[None, :]
        return np.where(np.triu(np.ones_like(m, dtype=bool), 1), m, np.inf)

    def memory_matrix(self, n_stages: int, j: int, nm: int) -> np.ndarray:
        """``M[p, q]``: device bytes stage ``j`` of ``n_stages`` needs over ``[p, q)`` with ``nm``
        in flight."""
        c = self.coefficients(self.in_flight(j, n_stages, nm), nm)
        par = self.param_prefix[None, :] - self.param_prefix[:, None]
        buf = self.buffer_prefix[None, :] - self.buffer_prefix[:, None]
        sav = self.saved_prefix[None, :] - self.saved_prefix[:, None]
        mem = c.param * par + buf + c.saved * sav + c.cut * self.cut_bytes[:, None]
        return np.where(np.triu(np.ones_like(mem, dtype=bool), 1), mem, np.inf)

    def host_matrix(self, n_stages: int, j: int, nm: int) -> np.ndarray:
        """``M[p, q]``: host bytes stage ``j`` of ``n_stages`` offloads over ``[p, q)``."""
        k = self.in_flight(j, n_stages, nm)
        c = host_coefficients(self.placement, nm, k, self.optimizer_state_factor)
        par = self.param_prefix[None, :] - self.param_prefix[:, None]
        sav = self.saved_prefix[None, :] - self.saved_prefix[:, None]
        host: np.ndarray = c.param * par + c.saved * sav + c.cut * self.cut_bytes[:, None]
        return host

    def fits_matrix(self, gpus: Sequence[Device], j: int, nm: int) -> np.ndarray:
        """``M[p, q]``: stage ``j`` over ``[p, q)`` fits its GPU's memory and its host share."""
        fits: np.ndarray = self.memory_matrix(len(gpus), j, nm) <= gpus[j].memory_bytes
        cap = self.host_share(gpus[j]).memory_bytes
        if cap:
            fits &= self.host_matrix(len(gpus), j, nm) <= cap
        return fits

    def model_memory_bytes(self, nm: int = 1) -> int:
        """Bytes to hold the whole model on one GPU (one stage, ``nm`` = 1: data parallelism)."""
        c = self.num_segments
        mem = (
            self.static_factor(nm) * float(self.param_prefix[c])
            + float(self.buffer_prefix[c])
            + self.in_flight(0, 1, nm) * (float(self.saved_prefix[c]) + float(self.cut_bytes[0]))
        )
        return round(mem)
