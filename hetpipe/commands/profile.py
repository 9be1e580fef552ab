"""`hetpipe profile`."""

from __future__ import annotations

from hetpipe._common import fail

HELP = "Not implemented yet."


def profile() -> None:
    """Not implemented yet."""
    raise fail("'hetpipe profile' is not implemented yet")
