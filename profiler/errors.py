"""The one exception hierarchy of hetpipe.

It lives in the lowest package (``profiler``) so that planner, runtime and the
``hetpipe`` front end can all raise and catch it without an import cycle.
Every message names the file or object, the field, the bad value and the fix;
the CLI prints it as one red line and exits with code 2.
"""

from __future__ import annotations

__all__ = [
    "ConfigError",
    "HetPipeError",
    "HetPipeRuntimeError",
    "ModelError",
    "PlanError",
    "ProfileError",
]


class HetPipeError(Exception):
    """Base class of every error hetpipe raises on purpose."""


class ConfigError(HetPipeError):
    """A cluster.yaml, CLI option or other user input is invalid."""


class ModelError(HetPipeError):
    """A model cannot be built, traced or split."""


class ProfileError(HetPipeError):
    """A profile table or imported profile is missing, malformed or mismatched."""


class PlanError(HetPipeError):
    """No valid plan exists, or a plan file is malformed."""


class HetPipeRuntimeError(HetPipeError):
    """A training run failed (a rank died, timed out or ran out of memory)."""
