"""Shared CLI helpers: error handling (one red line, exit code 2) and the rich console."""

from __future__ import annotations

import functools
import logging
import re
from collections.abc import Callable
from typing import ParamSpec, TypeVar

import typer
from rich.console import Console
from rich.markup import escape

from profiler.errors import HetPipeError

__all__ = [
    "EXIT_USAGE",
    "console",
    "err_console",
    "fail",
    "handle_errors",
    "one_line",
    "setup_logging",
]

EXIT_USAGE = 2
MAX_MESSAGE_CHARS = 1000  # an error line longer than this is cut
_BREAKS = re.compile(r"\s*[\r\n\u2028\u2029]+\s*")  # line breaks and the blanks around them
_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f]")
console = Console()
err_console = Console(stderr=True)

P = ParamSpec("P")
R = TypeVar("R")


def one_line(message: str, limit: int = MAX_MESSAGE_CHARS) -> str:
    """``message`` made safe to print as one terminal line: line breaks joined with `` | ``,
    other control characters (terminal escapes) shown as ``\\xNN``, cut to ``limit`` characters.

    >>> one_line("rank 1 failed:\\n  \\x1b[31mboom\\n")
    'rank 1 failed: | \\\\x1b[31mboom'
    """
    text = _BREAKS.sub(" | ", message.strip())
    text = _CONTROL.sub(lambda m: f"\\x{ord(m.group()):02x}", text)
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"


def fail(message: str) -> typer.Exit:
    """Print ``message`` as one red line on stderr and return the exit-2 exception to raise.

    The message is printed literally: rich markup in it (``[/path:553]`` in a gloo error) is
    escaped, emoji codes are not (``--data five:ten: ...`` names a factory, not an emoji), and
    :func:`one_line` keeps it one line without terminal escapes.
    """
    err_console.print(
        f"[bold red]error:[/] {escape(one_line(message))}",
        highlight=False,
        soft_wrap=True,
        emoji=False,
    )
    return typer.Exit(EXIT_USAGE)


def handle_errors(fn: Callable[P, R]) -> Callable[P, R]:
    """Turn :class:`HetPipeError` (and an ``OSError`` on a file the loaders did not catch, such
    as an output folder that cannot be written) into one red line and exit code 2, never a
    traceback."""

    @functools.wraps(fn)
    def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
        try:
            return fn(*args, **kwargs)
        except HetPipeError as exc:
            raise fail(str(exc)) from None
        except OSError as exc:
            if exc.filename is None:  # not about a file: a real failure, keep its traceback
                raise
            raise fail(f"{exc.filename}: {exc.strerror or exc}") from None

    return wrapper


def setup_logging(verbose: bool) -> None:
    """Log to stderr at INFO (or DEBUG with ``--verbose``)."""
    logging.basicConfig(
        level=logging.DEBUG if verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
