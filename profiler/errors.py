"""The one exception hierarchy of hetpipe.

It lives in the lowest package (``profiler``) so that planner, runtime and the
``hetpipe`` front end can all raise and catch it without an import cycle.
Every message names the file or object, the field, the bad value and the fix;
the CLI prints it as one red line and exits with code 2.
"""

from __future__ import annotations

import reprlib

__all__ = [
    "ConfigError",
    "HetPipeError",
    "HetPipeRuntimeError",
    "ModelError",
    "PlanError",
    "ProfileError",
    "shown",
]

ECHO_CHARS = 80  # longest user value an error message repeats
_REPR = reprlib.Repr()  # bounded repr of containers (Python 3.11 has no keyword arguments)
_REPR.maxlevel, _REPR.maxdict, _REPR.maxlist, _REPR.maxtuple = 3, 4, 6, 6
_REPR.maxstring = _REPR.maxother = 40


def shown(value: object, limit: int = ECHO_CHARS) -> str:
    """A user-supplied value as an error message may repeat it: its ``repr`` (so control
    characters and terminal escapes come out escaped), cut to about ``limit`` characters.

    >>> print(shown("V\\n\\x1b[31m"))
    'V\\n\\x1b[31m'
    >>> print(shown("x" * 1000, limit=5))
    'xxxxx'... (1000 characters)
    """
    if isinstance(value, str):
        if len(value) > limit:
            return f"{value[:limit]!r}... ({len(value)} characters)"
        return repr(value)
    text = _REPR.repr(value)  # containers: never render a multi-megabyte structure whole
    return text if len(text) <= limit else f"{text[:limit]}..."


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
