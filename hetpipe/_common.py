"""Shared CLI helpers: error handling (one red line, exit code 2) and the rich console."""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import ParamSpec, TypeVar

import typer
from rich.console import Console

from profiler.errors import HetPipeError

__all__ = ["EXIT_USAGE", "console", "err_console", "fail", "handle_errors", "setup_logging"]

EXIT_USAGE = 2
console = Console()
err_console = Console(stderr=True)

P = ParamSpec("P")
R = TypeVar("R")


def fail(message: str) -> typer.Exit:
    """Print ``message`` as one red line on stderr and return the exit-2 exception to raise."""
    err_console.print(f"[bold red]error:[/] {message}", highlight=False, soft_wrap=True)
    return typer.Exit(EXIT_USAGE)


def handle_errors(fn: Callable[P, R]) -> Callable[P, R]:
    """Turn :class:`HetPipeError` into one red line and exit code 2, never a traceback."""

    @functools.wraps(fn)
    def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
        try:
            return fn(*args, **kwargs)
        except HetPipeError as exc:
            raise fail(str(exc)) from None

    return wrapper


def setup_logging(verbose: bool) -> None:
    """Log to stderr at INFO (or DEBUG with ``--verbose``)."""
    logging.basicConfig(
        level=logging.DEBUG if verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
