"""The user's ``__main__`` and the worker processes: a guard check, and shipping by value
when ``__main__`` has no file.

A script's children import it again (as ``__mp_main__``): a call of ``hetpipe.train`` at its
top level would run again in each, so it is refused before any process starts.

A script fed on standard input (``python - < train.py``), a REPL or a notebook defines its
model, data set and loss classes in a ``__main__`` that a child process cannot import: pickle
stores them by reference and the child fails to find them. There, every job travels as a
``cloudpickle`` blob (classes and functions of ``__main__`` by value); a script with a file
keeps plain pickling (its children import it as ``__mp_main__``).
"""

from __future__ import annotations

import ast
import contextlib
import importlib
import os
import pickle
import sys
from collections.abc import Iterator
from types import ModuleType
from typing import Any

from profiler.errors import ConfigError

__all__ = [
    "ByValue",
    "check_guarded",
    "fileless_main_hidden",
    "main_has_file",
    "pickler",
    "shipped",
]


def main_has_file() -> bool:
    """Whether ``__main__`` is a file a child process can import again (``python - <`` names
    it ``<stdin>``, a REPL or a notebook names none)."""
    main = sys.modules.get("__main__")
    path = getattr(main, "__file__", None)
    return main is None or (isinstance(path, str) and os.path.isfile(path))


@contextlib.contextmanager
def fileless_main_hidden() -> Iterator[None]:
    """While child processes start: hide a ``__main__.__file__`` that names no file
    (``<stdin>``), which ``multiprocessing`` would try to run again in each child."""
    main = sys.modules.get("__main__")
    path = getattr(main, "__file__", None)
    if main is None or path is None or main_has_file():
        yield
        return
    del main.__file__
    try:
        yield
    finally:
        main.__file__ = path


def check_guarded() -> None:
    """Refuse a call from the top level of a ``__main__`` file outside an
    ``if __name__ == "__main__":`` block (a call from a function called there is judged by
    that call's line).

    Raises:
        ConfigError: the call is unguarded (naming the file, the line and the fix).
    """
    main = sys.modules.get("__main__")
    if main is None or not main_has_file():
        return
    frame, line = sys._getframe(1), 0
    while frame is not None:  # the outermost line of __main__'s own code in the stack
        if frame.f_globals is vars(main) and frame.f_code.co_name == "<module>":
            line = frame.f_lineno
        frame = frame.f_back  # type: ignore[assignment]
    path = str(main.__file__)
    if not line or _guarded(path, line):
        return
    raise ConfigError(
        f"{path}:{line} starts hetpipe.train when the script is imported, and each worker "
        'process imports it again: put that call under `if __name__ == "__main__":`'
    )


def _guarded(path: str, line: int) -> bool:
    """Whether ``line`` of the file lies in a top-level ``if __name__ == "__main__":`` block
    (``True`` when the file cannot be read or parsed: no verdict)."""
    try:
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read())
    except (OSError, SyntaxError, ValueError):
        return True
    for node in tree.body:
        if isinstance(node, ast.If) and "__name__" in ast.unparse(node.test):
            end = node.end_lineno or node.lineno
            if node.lineno <= line <= end:
                return True
    return False


def pickler() -> ModuleType:
    """``pickle``, or ``cloudpickle`` when ``__main__`` has no file.

    Raises:
        ConfigError: ``__main__`` has no file and cloudpickle is not installed.
    """
    if main_has_file():
        return pickle
    try:
        return importlib.import_module("cloudpickle")
    except ImportError:
        raise ConfigError(
            "classes defined on standard input, in a REPL or a notebook reach the worker "
            "processes only by value: pip install cloudpickle, or move them into a .py file"
        ) from None


class ByValue:
    """``obj`` pickled with :func:`pickler` now; unpickles as ``obj`` itself in the child."""

    def __init__(self, obj: Any) -> None:
        self.payload = pickler().dumps(obj)

    def __reduce__(self) -> tuple[Any, tuple[bytes]]:
        return pickle.loads, (self.payload,)


def shipped(obj: Any) -> Any:
    """``obj`` as a process argument: itself, or :class:`ByValue` when ``__main__`` has no file."""
    return obj if main_has_file() else ByValue(obj)
