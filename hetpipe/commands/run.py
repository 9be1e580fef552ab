"""`hetpipe run`."""

from __future__ import annotations

from hetpipe._common import fail

HELP = "Not implemented yet."


def run() -> None:
    """Not implemented yet."""
    raise fail("'hetpipe run' is not implemented yet")
