"""`hetpipe plan`."""

from __future__ import annotations

from hetpipe._common import fail

HELP = "Not implemented yet."


def plan() -> None:
    """Not implemented yet."""
    raise fail("'hetpipe plan' is not implemented yet")
