"""Per-GPU-type profile lookup for the planner: given profiles, then analytic or scaled fill-ins.

Every GPU type of the cluster needs a profile of the same model and batch size. Given profiles
are matched to types by their ``device_type`` (catalog names, case-insensitive). A type
without one is filled with ``profiler.analytic.analytic_profile`` when the model is a built-in
or importable model with the same layers, else by scaling a given profile with
``profiler.analytic.scale_profile`` (roofline ratios). An imported profile from unknown
hardware (PipeDream's ``unknown GPU``) is taken as measured on ``reference_type``
(default :data:`DEFAULT_REFERENCE_TYPE`, the GPU PipeDream's authors used).
"""

from __future__ import annotations

import hashlib
import logging
import os
import platform
from collections.abc import Mapping, Sequence
from pathlib import Path

from planner.cluster import Cluster
from profiler.catalog import lookup_gpu
from profiler.errors import ConfigError, ModelError, ProfileError
from profiler.table import Profile, load_profile

__all__ = [
    "CACHE_ENV",
    "DEFAULT_BATCH_SIZE",
    "DEFAULT_REFERENCE_TYPE",
    "profile_cache_dir",
    "resolve_profiles",
]

log = logging.getLogger(__name__)

DEFAULT_REFERENCE_TYPE = "V100"
DEFAULT_BATCH_SIZE = 32


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
    cluster: Cluster, given: Mapping[str, Profile], model: str, batch: int, precision: str = "fp32"
) -> tuple[dict[str, Profile], dict[str, str]]:
    """Profiles of an emulated cluster: a layer takes its CPU time divided by the node's speed.

    The CPU profile is a given ``cpu`` profile, else one measured here on one thread (emulated
    clusters run small models, so this takes about a second), else the analytic CPU estimate
    for models too large to measure quickly.
    """
    if "cpu" in given:
        base, src = given["cpu"], f"cpu {given['cpu'].meta.source}"
    else:
        try:
            base, src = _cpu_profile(model, batch, precision)
        except ModelError:  # the model itself cannot be built: profiling would not help
            raise
        except ConfigError as exc:
            raise ProfileError(
                f"emulated cluster needs a cpu profile of {model!r} ({exc}); run 'hetpipe profile'"
            ) from None
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


_MEASURE_LIMIT_BYTES = 64 * 2**20  # measure CPU profiles of models up to this many parameter bytes
CACHE_ENV = "HETPIPE_CACHE_DIR"  # where measured CPU profiles are cached; "off" disables the cache


def profile_cache_dir() -> Path | None:
    """Folder of cached measured CPU profiles (``None`` when caching is off).

    ``$HETPIPE_CACHE_DIR`` if set (``off`` disables caching), else ``$XDG_CACHE_HOME/hetpipe``
    (``~/.cache/hetpipe``). Delete a file there to measure that model again.
    """
    env = os.environ.get(CACHE_ENV)
    if env is not None:
        return None if env.strip().lower() in ("", "off", "0", "none") else Path(env)
    xdg = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(xdg) / "hetpipe"


def _cache_path(model: str, batch: int, precision: str = "fp32") -> Path | None:
    """Cache file of the measured CPU profile of ``model`` at ``batch`` on this machine.

    The key covers the model's graph (:func:`profiler.measure.profile_key`), not only its name.
    """
    import torch

    from profiler.measure import profile_key

    root = profile_cache_dir()
    if root is None:
        return None
    host = f"{platform.machine()}|{platform.processor()}|{os.cpu_count()}|{torch.__version__}"
    key = profile_key(model, batch, "cpu", precision)
    digest = hashlib.sha256(f"{model}|{batch}|{key}|{host}".encode()).hexdigest()[:16]
    safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in model)[:40]
    tag = "" if precision == "fp32" else f"-{precision}"
    return root / "profiles" / f"cpu-{safe}-b{batch}{tag}-{digest}.csv"


def _cpu_profile(model: str, batch: int, precision: str = "fp32") -> tuple[Profile, str]:
    """A single-threaded measured CPU profile of a small model, else the analytic estimate.

    Measured profiles are cached (:func:`profile_cache_dir`), so that plans made on the fly for
    an emulated cluster are the same from run to run on one machine: a fresh measurement moves
    by a few per cent, enough to change the partition or Nm.
    """
    import torch

    from profiler.analytic import analytic_profile
    from profiler.measure import measure_profile
    from profiler.models import resolve_model

    path = _cache_path(model, batch, precision)
    if path is not None and path.exists():
        try:
            cached = load_profile(path)
        except ProfileError as exc:
            log.warning("ignoring unreadable cached profile %s (%s)", path, exc)
        else:
            if cached.meta.model == model and cached.meta.batch_size == batch:
                log.info("using the cached CPU profile %s", path)
                return cached, "cpu measured"
    spec = resolve_model(model, batch)
    if sum(p.numel() * p.element_size() for p in spec.module.parameters()) > _MEASURE_LIMIT_BYTES:
        return analytic_profile(model, batch, "cpu"), "cpu analytic"
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # emulated devices are single-threaded processes
    try:
        prof = measure_profile(spec, "cpu", repeats=5, warmup=2, clock="cpu", precision=precision)
    finally:
        torch.set_num_threads(threads)
    if path is not None:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            prof.save(path)
        except OSError as exc:  # a read-only home must not stop planning
            log.warning("could not cache the measured profile in %s (%s)", path, exc)
    return prof, "cpu measured"


def resolve_profiles(
    cluster: Cluster,
    profiles: Mapping[str, Profile] | Sequence[Profile] | None,
    model: str | None,
    batch_size: int | None,
    reference_type: str | None = None,
    precision: str = "fp32",
) -> tuple[dict[str, Profile], dict[str, str], str, int]:
    """One profile per GPU type of ``cluster`` (an emulated cluster's CPU profile is measured
    at ``precision``; others are converted by the caller, :meth:`Profile.at_precision`).

    Returns:
        ``(profile by type, provenance by type, model name, batch size)``.

    Raises:
        ProfileError: profiles of another model/batch size, mixed profiles, or a type that can be
            neither profiled analytically nor scaled to.
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
        return (*_emulated(cluster, given, model_name, batch, precision), model_name, batch)
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
