"""The CPU profile an emulated cluster is planned on: measured here once, cached, handed to the planner.

An emulated device is a CPU process paced to its GPU type's speed, so the planner prices its
layers as this machine's CPU times divided by that speed (:mod:`planner.profiles`). The planner
never measures: the front ends (``hetpipe plan``, ``hetpipe run``, ``hetpipe.plan``,
``hetpipe.train``) call :func:`emulation_profiles` before planning and pass its table on.
A measured profile is cached (:func:`profile_cache_dir`), so that plans made on the fly for an
emulated cluster are the same from run to run on one machine: a fresh measurement moves by a
few per cent, enough to change the partition or Nm.
"""

from __future__ import annotations

import hashlib
import logging
import os
import platform
from collections.abc import Sequence
from pathlib import Path

from profiler.errors import ConfigError, ModelError, ProfileError
from profiler.table import DEFAULT_BATCH_SIZE, Profile, load_profile

__all__ = [
    "CACHE_ENV",
    "cpu_profile",
    "emulation_profiles",
    "profile_cache_dir",
]

log = logging.getLogger(__name__)

CACHE_ENV = "HETPIPE_CACHE_DIR"  # where measured CPU profiles are cached; "off" disables the cache
_MEASURE_LIMIT_BYTES = 64 * 2**20  # measure CPU profiles of models up to this many parameter bytes


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


def _cached(path: Path | None, model: str, batch: int) -> Profile | None:
    """The cached profile in ``path`` when it is one of ``model`` at ``batch``."""
    if path is None or not path.exists():
        return None
    try:
        cached = load_profile(path)
    except ProfileError as exc:
        log.warning("ignoring unreadable cached profile %s (%s)", path, exc)
        return None
    if cached.meta.model == model and cached.meta.batch_size == batch:
        log.info("using the cached CPU profile %s", path)
        return cached
    return None


def cpu_profile(model: str, batch: int, precision: str = "fp32") -> Profile:
    """A single-threaded measured CPU profile of a small model (cached), else the analytic
    estimate (its ``meta.source`` says which: ``measured`` or ``analytic``).

    Raises:
        ModelError: the model cannot be built.
        ConfigError: the model cannot be profiled on this machine.
    """
    import torch

    from profiler.analytic import analytic_profile
    from profiler.measure import measure_profile
    from profiler.models import resolve_model

    path = _cache_path(model, batch, precision)
    cached = _cached(path, model, batch)
    if cached is not None:
        return cached
    spec = resolve_model(model, batch)
    if sum(p.numel() * p.element_size() for p in spec.module.parameters()) > _MEASURE_LIMIT_BYTES:
        return analytic_profile(model, batch, "cpu")
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
    return prof


def emulation_profiles(
    profiles: Sequence[Profile], model: str | None, batch_size: int | None, precision: str = "fp32"
) -> list[Profile]:
    """``profiles`` and, when none of them is a ``cpu`` profile, this machine's
    (:func:`cpu_profile`) of the model they profile (else ``model``) at their batch size (else
    ``batch_size``, else :data:`profiler.table.DEFAULT_BATCH_SIZE`): what an emulated cluster is planned on.

    Without profiles or a model it adds nothing (the planner then asks for ``--model``).

    Raises:
        ModelError: the model cannot be built (profiling would not help).
        ProfileError: it cannot be profiled here; says to run ``hetpipe profile``.
    """
    given = list(profiles)
    if any(p.meta.device_type.strip().lower() == "cpu" for p in given):
        return given
    name = given[0].meta.model if given else model
    if name is None:
        return given
    batch = given[0].meta.batch_size if given else batch_size or DEFAULT_BATCH_SIZE
    try:
        return [*given, cpu_profile(name, batch, precision)]
    except ModelError:
        raise
    except ConfigError as exc:
        raise ProfileError(
            f"emulated cluster needs a cpu profile of {name!r} ({exc}); run 'hetpipe profile'"
        ) from None
