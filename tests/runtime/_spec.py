"""Tests' constructor of a :class:`runtime.spec.RunSpec` from flat keywords, each routed to
the section that owns it (``checkpoint_every`` -> ``checkpoints.every``, ``stage_fault`` ->
``faults``, ...)."""

from __future__ import annotations

from dataclasses import fields, replace
from typing import Any

from runtime.config import OptimizerConfig, RunConfig
from runtime.spec import (
    CheckpointConfig,
    DataConfig,
    FailurePolicy,
    RunSpec,
    SyncConfig,
    TestHooks,
)

_RENAMED = {"checkpoint_every": "every", "checkpoint_dir": "dir"}
_SECTIONS = {
    "data": DataConfig,
    "sync": SyncConfig,
    "checkpoints": CheckpointConfig,
    "failure": FailurePolicy,
    "faults": TestHooks,
}


def spec(
    optimizer: OptimizerConfig | None = None, run: RunConfig | None = None, **flat: Any
) -> RunSpec:
    """A spec with ``optimizer``, ``run`` and every keyword of ``flat`` in its section
    (``vw`` at the top).

    Raises:
        TypeError: a keyword no section has.
    """
    made = RunSpec(run or RunConfig(), optimizer or OptimizerConfig(), vw=flat.pop("vw", -1))
    for key, value in flat.items():
        name = _RENAMED.get(key, key)
        section = next((s for s, cls in _SECTIONS.items() if name in _names(cls)), None)
        if section is None:
            raise TypeError(f"no section of RunSpec has {key!r}")
        made = replace(made, **{section: replace(getattr(made, section), **{name: value})})
    return made


def _names(cls: type) -> set[str]:
    return {f.name for f in fields(cls)}
