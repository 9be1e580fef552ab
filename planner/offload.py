"""Where each class of a stage's data lives: kept on the device, offloaded to host memory, or
recomputed (GeePS, Cui et al. EuroSys'16, Sec. 3.3-3.4; activation checkpointing).

One source of truth, like :mod:`planner.schedule`: the planner's memory and cost models, the
simulator and the stage runtime all evaluate these pure functions. A stage's data falls in
four classes, each with a :class:`Place`:

========================  ======================================  =====================
class                     bytes                                   places
========================  ======================================  =====================
``weights``               the ``Nm - 1`` stashed weight versions   keep, offload
``activations``           saved activations + received inputs of   keep, offload,
                          the ``k`` minibatches in flight          recompute
``optimizer``             optimizer state (``o * P``)              keep, offload
``gradients``             the gradient buffer (``P``)              keep, offload
========================  ======================================  =====================

The master weights (``P``) and buffers always stay on the device: every task reads them.
With ``P`` parameter bytes, ``S`` saved bytes, ``C`` bytes received at the stage's first cut,
``k`` minibatches in flight (:meth:`planner.schedule.Schedule.in_flight_bound`) and ``v = Nm - 1``
stashed versions, the device holds::

    device = P + buffers + g * P + o_dev * P + min(v, V_dev) * P + acts
    acts   = k * (S + C)           keep
           = min(k, 2) * (S + C)   offload  (double buffering: the running task's and the
                                             prefetched minibatch's; GeePS Sec. 3.4)
           = k * C + S             recompute (inputs kept, one minibatch's activations rebuilt
                                              during its backward)

where ``g = 1`` / ``o_dev = o`` / ``V_dev = v`` when the class is kept and ``0`` / ``0`` / ``2``
when offloaded (a stashed version is needed only by its minibatch's backward: the one running
and the one prefetched). Offloaded bytes live in host memory; per minibatch the host link moves
(both directions summed, :func:`transfer_bytes`)::

    weights      2 * P            when v > 2 (a version goes down once and comes back once)
    activations  2 * (S + C)      when k > 2
    gradients    2 * P            (down as produced, back up for the update)
    optimizer    2 * o * P        (the state comes up for the update and goes down again)

The update always runs on the device, so results stay bit-equal to all-keep
(:mod:`runtime.stage.moves` executes these moves).

Overlap rule (:func:`exposed_ms`): the schedule fixes every stage's task order in advance
(:mod:`planner.schedule`), so each transfer is issued one task ahead of its use on a side
stream (GeePS's background prefetch) and a minibatch's transfers overlap the stage's compute
of that minibatch; only the excess ``max(0, transfer_ms - compute_ms)`` delays the backward.
Recompute adds the stage's forward time to its backward and cannot be hidden. A stage's busy
time per minibatch is therefore (:func:`busy_ms`)::

    busy = max(fwd + bwd + recompute, host_ms),   host_ms = host-link time of transfer_bytes

The planner's cost model charges it while the partitioners choose the cuts, the plan records
the exposed part in ``bwd_ms`` (which the simulator times and an emulated device paces).

Host side (:class:`HostShare`): the GPUs of one node share its host memory equally
(``host_memory / count`` each) and one host link (PCIe). The pipelines keep every GPU of a
node busy at once, so when they offload they move bytes at the same time: each gets an equal
share of the link's bandwidth (``bandwidth / count``; the latency stays). A GPU whose stage
moves nothing frees no share for the others -- a conservative, simple model
(:func:`host_link_ms`).

Example:
    >>> b = StageBytes(param=100, buffer=0, saved=40, cut=10)
    >>> device_bytes(b, KEEP_ALL, nm=4, in_flight=4, optimizer_factor=1.0)
    800
    >>> lean = MemoryPlacement.parse("weights:offload,activations:recompute")
    >>> device_bytes(b, lean, nm=4, in_flight=4, optimizer_factor=1.0)
    580
    >>> str(lean), lean.code
    ('weights:offload,activations:recompute', 'ORKK')
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from enum import Enum
from itertools import product
from typing import TYPE_CHECKING, TypeVar

import numpy as np

if TYPE_CHECKING:
    from planner.cluster import Link

__all__ = [
    "CANDIDATES",
    "CLASSES",
    "KEEP_ALL",
    "LADDER",
    "Coefficients",
    "HostShare",
    "MemoryPlacement",
    "Place",
    "StageBytes",
    "busy_ms",
    "coefficients",
    "device_bytes",
    "effective",
    "exposed_ms",
    "host_bytes",
    "host_coefficients",
    "host_link_ms",
    "recompute_factor",
    "recompute_ms",
    "transfer_bytes",
    "transfer_coefficients",
]

ACTIVATION_BUFFERS = 2  # minibatches of offloaded activations on the device (double buffering)
VERSION_BUFFERS = 2  # offloaded stashed versions on the device (running + prefetched backward)


class Place(str, Enum):
    """Where one class of data lives."""

    KEEP = "keep"
    OFFLOAD = "offload"
    RECOMPUTE = "recompute"


CLASSES = ("weights", "activations", "optimizer", "gradients")
"""The data classes, in :attr:`MemoryPlacement.code` order."""


@dataclass(frozen=True, slots=True)
class MemoryPlacement:
    """The place of each data class of one stage (``recompute`` only for activations).

    Attributes:
        weights: stashed weight versions.
        activations: saved activations and received inputs.
        optimizer: optimizer state.
        gradients: the gradient buffer.

    Raises:
        ValueError: a class other than activations set to ``recompute``.
    """

    weights: Place = Place.KEEP
    activations: Place = Place.KEEP
    optimizer: Place = Place.KEEP
    gradients: Place = Place.KEEP

    def __post_init__(self) -> None:
        for f in fields(self):
            place = Place(getattr(self, f.name))
            object.__setattr__(self, f.name, place)
            if place is Place.RECOMPUTE and f.name != "activations":
                raise ValueError(f"{f.name} cannot be recomputed (keep or offload it)")

    @property
    def kept(self) -> bool:
        """Whether every class stays on the device (the plan before memory management)."""
        return all(getattr(self, c) is Place.KEEP for c in CLASSES)

    @property
    def code(self) -> str:
        """Four letters K/O/R for weights, activations, optimizer, gradients (``KRKK``)."""
        return "".join(getattr(self, c).value[0].upper() for c in CLASSES)

    def __str__(self) -> str:
        """``keep`` or the non-kept classes, e.g. ``weights:offload,activations:recompute``."""
        moved = [
            f"{c}:{getattr(self, c).value}" for c in CLASSES if getattr(self, c) is not Place.KEEP
        ]
        return ",".join(moved) or "keep"

    @classmethod
    def parse(cls, text: str) -> MemoryPlacement:
        """Inverse of :func:`str` (also accepts the four-letter :attr:`code`).

        Raises:
            ValueError: unknown class or place (the message lists the valid ones).
        """
        text = text.strip()
        if len(text) == 4 and set(text) <= {"K", "O", "R"}:
            by_letter = {p.value[0].upper(): p for p in Place}
            return cls(*(by_letter[ch] for ch in text))
        if text in ("", "keep"):
            return cls()
        kw: dict[str, Place] = {}
        for item in text.split(","):
            name, _, place = item.partition(":")
            if name.strip() not in CLASSES or place.strip() not in {p.value for p in Place}:
                raise ValueError(
                    f"{item.strip()[:40]!r} is not a placement; write class:place with class in "
                    f"{', '.join(CLASSES)} and place keep, offload or recompute"
                )
            kw[name.strip()] = Place(place.strip())
        return cls(**kw)


KEEP_ALL = MemoryPlacement()

CANDIDATES: tuple[MemoryPlacement, ...] = tuple(
    MemoryPlacement(w, a, o, g)
    for w, a, o, g in product(
        (Place.KEEP, Place.OFFLOAD),
        (Place.KEEP, Place.OFFLOAD, Place.RECOMPUTE),
        (Place.KEEP, Place.OFFLOAD),
        (Place.KEEP, Place.OFFLOAD),
    )
)
"""Every placement of one stage (24), all-keep first."""

LADDER: tuple[MemoryPlacement, ...] = (
    KEEP_ALL,
    MemoryPlacement(optimizer=Place.OFFLOAD, gradients=Place.OFFLOAD),
    MemoryPlacement(Place.OFFLOAD, Place.KEEP, Place.OFFLOAD, Place.OFFLOAD),
    MemoryPlacement(Place.OFFLOAD, Place.OFFLOAD, Place.OFFLOAD, Place.OFFLOAD),
    MemoryPlacement(Place.OFFLOAD, Place.RECOMPUTE, Place.OFFLOAD, Place.OFFLOAD),
)
"""Uniform placements the partitioner tries, from no overhead to the least device memory."""


@dataclass(frozen=True, slots=True)
class StageBytes:
    """The byte sizes of one stage's data (the profile summed over its layers).

    Attributes:
        param: parameter bytes ``P``.
        buffer: buffer bytes (batch-norm statistics).
        saved: bytes autograd saves for backward per minibatch ``S``.
        cut: bytes received at the stage's first cut per minibatch ``C`` (0 on stage 0's
            model inputs are counted here too).
    """

    param: float
    buffer: float
    saved: float
    cut: float


@dataclass(frozen=True, slots=True)
class Coefficients:
    """Device bytes of a stage as ``param * P + buffers + saved * S + cut * C``.

    The partitioners keep their prefix-sum form: a placement only changes the multipliers.
    """

    param: float
    saved: float
    cut: float

    @property
    def zero(self) -> bool:
        """Whether every multiplier is 0 (nothing counted)."""
        return self.param == 0 and self.saved == 0 and self.cut == 0


def coefficients(
    pl: MemoryPlacement,
    nm: int,
    in_flight: int,
    optimizer_factor: float,
    extra_copies: float = 0.0,
) -> Coefficients:
    """The multipliers of :func:`device_bytes` for a stage holding ``in_flight`` minibatches
    (``extra_copies``: parameter-sized copies a staleness remedy keeps on the device,
    :func:`planner.staleness.remedy_weight_copies`)."""
    versions = nm - 1
    if pl.weights is Place.OFFLOAD:
        versions = min(versions, VERSION_BUFFERS)
    param = 1.0 + versions + extra_copies
    param += 0.0 if pl.gradients is Place.OFFLOAD else 1.0
    param += 0.0 if pl.optimizer is Place.OFFLOAD else optimizer_factor
    k = in_flight
    if pl.activations is Place.OFFLOAD:
        k = min(k, ACTIVATION_BUFFERS)
        return Coefficients(param, float(k), float(k))
    if pl.activations is Place.RECOMPUTE:
        return Coefficients(param, float(min(k, 1)), float(k))
    return Coefficients(param, float(k), float(k))


def device_bytes(
    b: StageBytes,
    pl: MemoryPlacement,
    nm: int,
    in_flight: int,
    optimizer_factor: float,
    extra_copies: float = 0.0,
) -> int:
    """Peak device bytes of a stage (the module docstring's formula; ``extra_copies`` as for
    :func:`coefficients`)."""
    c = coefficients(pl, nm, in_flight, optimizer_factor, extra_copies)
    return round(c.param * b.param + b.buffer + c.saved * b.saved + c.cut * b.cut)


def host_coefficients(
    pl: MemoryPlacement, nm: int, in_flight: int, optimizer_factor: float
) -> Coefficients:
    """The multipliers of :func:`host_bytes` (host bytes are ``param * P + saved * S + cut * C``)."""
    param = 0.0
    if pl.weights is Place.OFFLOAD:
        param += max(0, nm - 1 - VERSION_BUFFERS)
    if pl.optimizer is Place.OFFLOAD:
        param += optimizer_factor
    if pl.gradients is Place.OFFLOAD:
        param += 1.0
    act = float(max(0, in_flight - ACTIVATION_BUFFERS)) if pl.activations is Place.OFFLOAD else 0.0
    return Coefficients(param, act, act)


def host_bytes(
    b: StageBytes, pl: MemoryPlacement, nm: int, in_flight: int, optimizer_factor: float
) -> int:
    """Host bytes the stage's offloaded classes occupy (the bytes not on the device)."""
    c = host_coefficients(pl, nm, in_flight, optimizer_factor)
    return round(c.param * b.param + c.saved * b.saved + c.cut * b.cut)


def transfer_coefficients(
    pl: MemoryPlacement, nm: int, in_flight: int, optimizer_factor: float
) -> Coefficients:
    """The multipliers of :func:`transfer_bytes` (``param * P + saved * S + cut * C``)."""
    param = 0.0
    if pl.weights is Place.OFFLOAD and nm - 1 > VERSION_BUFFERS:
        param += 2.0
    if pl.gradients is Place.OFFLOAD:
        param += 2.0
    if pl.optimizer is Place.OFFLOAD:
        param += 2.0 * optimizer_factor
    moved = pl.activations is Place.OFFLOAD and in_flight > ACTIVATION_BUFFERS
    act = 2.0 if moved else 0.0
    return Coefficients(param, act, act)


def transfer_bytes(
    b: StageBytes, pl: MemoryPlacement, nm: int, in_flight: int, optimizer_factor: float
) -> int:
    """Host-link bytes per minibatch, both directions summed (module docstring)."""
    c = transfer_coefficients(pl, nm, in_flight, optimizer_factor)
    return round(c.param * b.param + c.saved * b.saved + c.cut * b.cut)


def effective(pl: MemoryPlacement, nm: int, in_flight: int) -> MemoryPlacement:
    """``pl`` with every move that saves no device bytes at this ``nm`` and ``in_flight`` undone.

    Offloading the stashed versions saves nothing while ``Nm - 1 <= 2`` (both fit the device
    buffers), offloading activations nothing while ``in_flight <= 2``, recomputing nothing
    while ``in_flight <= 1``: those classes are kept, so the plan records what really moves.
    """
    w, a = pl.weights, pl.activations
    if w is Place.OFFLOAD and nm - 1 <= VERSION_BUFFERS:
        w = Place.KEEP
    if a is Place.OFFLOAD and in_flight <= ACTIVATION_BUFFERS:
        a = Place.KEEP
    if a is Place.RECOMPUTE and in_flight <= 1:
        a = Place.KEEP
    return MemoryPlacement(w, a, pl.optimizer, pl.gradients)


def recompute_factor(pl: MemoryPlacement, in_flight: int) -> float:
    """1 when the stage runs its forward again before each backward, else 0.

    A stage holding one minibatch (the last stage's fused task) keeps its activations anyway.
    """
    return 1.0 if pl.activations is Place.RECOMPUTE and in_flight > 1 else 0.0


def recompute_ms(pl: MemoryPlacement, fwd_ms: float, in_flight: int) -> float:
    """Extra milliseconds per minibatch: the forward again before the backward (recompute)."""
    return recompute_factor(pl, in_flight) * fwd_ms


@dataclass(frozen=True, slots=True)
class HostShare:
    """One GPU's share of its node's host side (module docstring, "Host side").

    Attributes:
        sharers: GPUs of the node sharing its host link (each gets ``1 / sharers`` of it).
        memory_bytes: host memory this GPU may offload to (0: unbounded).
    """

    sharers: int = 1
    memory_bytes: int = 0


_A = TypeVar("_A", float, np.ndarray)


def host_link_ms(nbytes: _A, link: Link, sharers: int = 1) -> _A:
    """Milliseconds to move ``nbytes`` over one GPU's share of its node's host link
    (0 bytes: 0 ms); floats or numpy arrays elementwise."""
    share = link.bandwidth_bps / max(1, sharers)
    out = np.where(np.asarray(nbytes) > 0, (link.latency_s + np.asarray(nbytes) / share) * 1e3, 0.0)
    return float(out) if isinstance(nbytes, float | int) else out


def exposed_ms(transfer_ms: _A, compute_ms: _A) -> _A:
    """The overlap rule: transfer time per minibatch not hidden behind its compute (ms)."""
    out = np.maximum(0.0, np.asarray(transfer_ms) - np.asarray(compute_ms))
    return float(out) if isinstance(transfer_ms, float | int) else out


def busy_ms(compute_ms: _A, transfer_ms: _A) -> _A:
    """A stage's time per minibatch on its device: compute (recompute included) plus the
    exposed transfer, i.e. ``max(compute_ms, transfer_ms)`` (floats or arrays)."""
    return compute_ms + exposed_ms(transfer_ms, compute_ms)
