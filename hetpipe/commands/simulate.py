"""`hetpipe simulate`."""

from __future__ import annotations

from hetpipe._common import fail

HELP = "Not implemented yet."


def simulate() -> None:
    """Not implemented yet."""
    raise fail("'hetpipe simulate' is not implemented yet")
