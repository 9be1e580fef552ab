"""Per-GPU-type profile lookup for the planner: given profiles, then analytic or scaled fill-ins.

Every GPU type of the cluster needs a profile of the same model and batch size. Given profiles
are matched to types by their ``device_type`` (catalog names, case-insensitive). A type
without one is filled with ``profiler.analytic.analytic_profile`` when the model is a built-in
or importable model with the same layers, else by scaling a given profile with
``profiler.analytic.scale_profile`` (roofline ratios). An imported profile from unknown
hardware (PipeDream's ``unknown GPU``) is taken as measured on ``reference_type``
(default :data:`DEFAULT_REFERENCE_TYPE`, the GPU PipeDream's authors used). An emulated
cluster's types are the given ``cpu`` profile divided by each node's speed; nothing here runs a
model: the front end measures that profile first (:mod:`profiler.cpu_profile`).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence

from planner.cluster import Cluster
from profiler.catalog import lookup_gpu
from profiler.errors import ConfigError, ModelError, ProfileError
from profiler.table import DEFAULT_BATCH_SIZE, Profile

__all__ = ["DEFAULT_REFERENCE_TYPE", "resolve_profiles"]

log = logging.getLogger(__name__)

DEFAULT_REFERENCE_TYPE = "V100"


def _canonical_type(name: str) -> str | None:
    try:
        return lookup_gpu(name).name
    except ConfigError:
        return "cpu" if name.strip().lower() == "cpu" else None


def _check_same(
    profiles: Sequence[Profile], model: str | None, batch_size: int | None
) -> tuple[str, int]:
    first = profiles[0].meta
    for p in profiles:
        where = p.meta.extra.get("file", f"profile of {p.meta.model!r} on {p.meta.device_type!r}")
        if model is not None and p.meta.model != model:
            raise ProfileError(
                f"{where}: profile is for model {p.meta.model!r}, not {model!r}; profile {model} or drop --model"
            )
        if p.meta.model != first.model:
            raise ProfileError(
                f"{where}: profiles mix models {first.model!r} and {p.meta.model!r}; give one model's profiles"
            )
        if batch_size is not None and p.meta.batch_size != batch_size:
            raise ProfileError(
                f"{where}: profile is for batch size {p.meta.batch_size}, not {batch_size}; re-profile with -b {batch_size}"
            )
        if p.meta.batch_size != first.batch_size:
            raise ProfileError(
                f"{where}: profiles mix batch sizes {first.batch_size} and {p.meta.batch_size}"
            )
    return first.model, first.batch_size


def _fill(
    model: str, batch: int, gpu_type: str, given: Mapping[str, Profile], ref_type: str
) -> tuple[Profile, str]:
    from profiler.analytic import analytic_profile, scale_profile

    base = next(iter(given.values()), None)
    try:
        prof = analytic_profile(model, batch, gpu_type)
        if base is None or prof.layers == base.layers:
            return prof, "analytic (no profile for this type)"
    except (ModelError, ConfigError) as exc:
        if base is None:
            raise ProfileError(
                f"GPU type {gpu_type!r} has no profile and model {model!r} cannot be profiled analytically ({exc})"
            ) from None
    if base is None:  # analytic profile's layers cannot mismatch without a base; keep mypy informed
        raise ProfileError(f"GPU type {gpu_type!r} has no profile")
    src = next(iter(given))
    from_type = ref_type if src == "?" else src
    try:
        return scale_profile(
            base, gpu_type, from_type=from_type
        ), f"scaled from {from_type} ({base.meta.source})"
    except ConfigError as exc:
        raise ProfileError(
            f"GPU type {gpu_type!r} has no profile and cannot be scaled to ({exc}); profile it with 'hetpipe profile'"
        ) from None


def _emulated(
    cluster: Cluster, given: Mapping[str, Profile], model: str
) -> tuple[dict[str, Profile], dict[str, str]]:
    """Profiles of an emulated cluster: a layer takes its CPU time divided by the node's speed.

    The CPU profile is the given ``cpu`` one: the front end measures it before planning
    (:func:`profiler.cpu_profile.emulation_profiles`); the planner never runs a model.

    Raises:
        ProfileError: no ``cpu`` profile was given.
    """
    if "cpu" not in given:
        raise ProfileError(
            f"emulated cluster {cluster.name!r} is planned on a cpu profile of {model!r} and none "
            "was given; pass profiler.cpu_profile.emulation_profiles(...) to the planner (the "
            "hetpipe commands and API do), or --profiles with a cpu profile ('hetpipe profile')"
        )
    base, src = given["cpu"], f"cpu {given['cpu'].meta.source}"
    by_type: dict[str, Profile] = {}
    provenance: dict[str, str] = {}
    for node in cluster.nodes:
        if node.emulation is None or node.gpu_type in by_type:
            continue
        speed = node.emulation.speed
        table = base.table.copy()
        table["fwd_ms"] = table["fwd_ms"] / speed
        table["bwd_ms"] = table["bwd_ms"] / speed
        by_type[node.gpu_type] = base.with_table(
            table, device_type=node.gpu_type, source="emulated"
        )
        provenance[node.gpu_type] = f"emulated: {src} / speed {speed:g}"
    return by_type, provenance


def resolve_profiles(
    cluster: Cluster,
    profiles: Mapping[str, Profile] | Sequence[Profile] | None,
    model: str | None,
    batch_size: int | None,
    reference_type: str | None = None,
) -> tuple[dict[str, Profile], dict[str, str], str, int]:
    """One profile per GPU type of ``cluster``: the given ones, then analytic or scaled fill-ins;
    an emulated cluster's from the given ``cpu`` profile (the caller converts them to its
    precision, :meth:`Profile.at_precision`).

    Returns:
        ``(profile by type, provenance by type, model name, batch size)``.

    Raises:
        ProfileError: profiles of another model/batch size, mixed profiles, a type that can be
            neither profiled analytically nor scaled to, or an emulated cluster without a
            ``cpu`` profile.
        ConfigError: neither profiles nor a model were given.
    """
    plist = list(profiles.values()) if isinstance(profiles, Mapping) else list(profiles or [])
    ref_type = reference_type or DEFAULT_REFERENCE_TYPE
    if plist:
        model_name, batch = _check_same(plist, model, batch_size)
    elif model is None:
        raise ConfigError(
            "give --model (a built-in or package.module:factory model) or --profiles DIR"
        )
    else:
        model_name, batch = model, batch_size or DEFAULT_BATCH_SIZE
    given: dict[str, Profile] = {}
    for p in plist:
        t = _canonical_type(p.meta.device_type)
        given.setdefault(t if t is not None else "?", p)
    if "?" in given and _canonical_type(ref_type) is None:
        raise ConfigError(f"reference GPU type {ref_type!r} is not in the catalog")
    if cluster.emulated:
        return (*_emulated(cluster, given, model_name), model_name, batch)
    by_type: dict[str, Profile] = {}
    provenance: dict[str, str] = {}
    for gpu_type in dict.fromkeys(d.type for d in cluster.devices):
        if gpu_type in given:
            by_type[gpu_type] = given[gpu_type]
            provenance[gpu_type] = given[gpu_type].meta.source
            continue
        if given and "?" in given and _canonical_type(ref_type) == gpu_type:
            by_type[gpu_type] = given["?"]
            provenance[gpu_type] = f"{given['?'].meta.source} (assumed measured on {ref_type})"
            continue
        by_type[gpu_type], provenance[gpu_type] = _fill(
            model_name, batch, gpu_type, given, ref_type
        )
        log.info("no profile for %s: using %s", gpu_type, provenance[gpu_type])
    return by_type, provenance, model_name, batch
