"""Reading input files safely: any bytes give either a document or one :class:`HetPipeError` line.

Every loader of a user file (cluster.yaml, plan, profile CSV, PipeDream graph, links.yaml) reads
it through :func:`read_text` (size cap, strict UTF-8, one-line ``OSError``) and, for YAML/JSON,
:func:`load_document`, which also refuses documents nested too deeply or blown up by YAML
aliases (``&a [*b, *b, ...]``) before any validator walks them, and a key written twice in one
mapping (YAML and JSON parsers silently keep the last one: a typo'd cluster would plan on the
wrong numbers).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
from collections.abc import Iterable
from pathlib import Path

import yaml

from profiler.errors import HetPipeError, shown

__all__ = [
    "MAX_DEPTH",
    "MAX_FILE_BYTES",
    "MAX_VALUES",
    "DuplicateKey",
    "UniqueKeyLoader",
    "load_document",
    "read_text",
    "text_problem",
]

MAX_FILE_BYTES = 64 * 2**20  # a plan of 10,000 GPUs is ~5 MB; larger input is not ours
MAX_VALUES = 2_000_000  # values in a document with every YAML alias expanded
MAX_DEPTH = 32  # nesting of mappings and lists (our files use at most 6)

_BASE_LOADER: type[yaml.SafeLoader] = getattr(yaml, "CSafeLoader", yaml.SafeLoader)  # libyaml
_MERGE = "tag:yaml.org,2002:merge"  # ``<<: *base``: merged keys may be overridden, not duplicated


class DuplicateKey(yaml.YAMLError):
    """A mapping of the document names ``key`` twice; ``line`` is the second one (1-based)."""

    def __init__(self, key: object, line: int) -> None:
        super().__init__(f"duplicate key {key!r} at line {line}")
        self.key, self.line = key, line


class UniqueKeyLoader(_BASE_LOADER):  # type: ignore[valid-type,misc]
    """The safe YAML loader (libyaml's when built with it) that refuses a key written twice in
    one mapping (:class:`DuplicateKey`) instead of keeping the last value."""

    def construct_mapping(self, node: yaml.Node, deep: bool = False) -> dict[object, object]:
        """The mapping of ``node``, after checking its explicit keys are distinct."""
        if isinstance(node, yaml.MappingNode):
            seen: set[object] = set()
            for key_node, _ in node.value:
                if key_node.tag == _MERGE:
                    continue
                key = self.construct_object(key_node, deep=deep)
                try:
                    if key in seen:
                        raise DuplicateKey(key, key_node.start_mark.line + 1)
                    seen.add(key)
                except TypeError:  # unhashable: the base class names it
                    continue
        return super().construct_mapping(node, deep)  # type: ignore[no-any-return]


def _unique_pairs(pairs: list[tuple[str, object]]) -> dict[str, object]:
    """``json.loads``'s ``object_pairs_hook``: refuse a key written twice in one object."""
    out: dict[str, object] = {}
    for key, value in pairs:
        if key in out:
            raise DuplicateKey(key, 0)
        out[key] = value
    return out


_LOADER = UniqueKeyLoader
_STYLE_TAG = re.compile(r"\[[A-Za-z#/@][^\[\]]*\]")  # what rich reads as markup: [red], [/x]


def text_problem(value: str, max_chars: int) -> str | None:
    """Why ``value`` (a name from an input file) cannot be shown as-is on a terminal, or None.

    Names are printed in tables and messages: they must be at most ``max_chars`` printable
    characters (no newline, tab or terminal escape) without a console style tag like ``[red]``.

    >>> text_problem("TITAN V", 20) is None
    True
    >>> text_problem("V[/x]", 20)
    "it holds '[/x]', which the console would read as a style tag"
    """
    if len(value) > max_chars:
        return f"it is longer than {max_chars} characters"
    if not value.isprintable():
        return "it is not printable text (a newline, tab or terminal escape)"
    tag = _STYLE_TAG.search(value)
    if tag is not None:
        return f"it holds {shown(tag.group(), 20)}, which the console would read as a style tag"
    return None


def read_text(path: str | os.PathLike[str], what: str, error: type[HetPipeError]) -> str:
    """The text of ``path``, which must be a UTF-8 file (byte-order mark allowed) of at most
    :data:`MAX_FILE_BYTES`.

    Args:
        path: the file.
        what: what the file is, for messages (``"cluster file"``).
        error: the :class:`HetPipeError` subclass to raise.

    Raises:
        error: the file is missing, not a regular file, unreadable, too large or not UTF-8.
    """
    p = Path(path)
    try:
        with p.open("rb") as fh:
            data = fh.read(MAX_FILE_BYTES + 1)
    except OSError as exc:
        raise error(f"{p}: cannot read {what} ({exc.strerror or type(exc).__name__})") from None
    if len(data) > MAX_FILE_BYTES:
        raise error(
            f"{p}: cannot read {what}: larger than {MAX_FILE_BYTES // 2**20} MiB (the wrong file?)"
        )
    try:
        return data.decode("utf-8-sig")  # a leading byte-order mark (Windows editors) is dropped
    except UnicodeDecodeError as exc:
        line = data.count(b"\n", 0, exc.start) + 1
        raise error(
            f"{p}: cannot read {what}: not UTF-8 text (byte {data[exc.start]:#04x} at line "
            f"{line}); save it as UTF-8"
        ) from None


def load_document(path: str | os.PathLike[str], what: str, error: type[HetPipeError]) -> object:
    """Parse a YAML (or JSON, which is YAML) file into plain data, bounded in size and depth.

    Raises:
        error: unreadable file (see :func:`read_text`), syntax error, or a document nested
            deeper than :data:`MAX_DEPTH` or holding more than :data:`MAX_VALUES` values.
    """
    p = Path(path)
    text = read_text(p, what, error)
    try:
        if p.suffix.lower() == ".json":
            data = json.loads(text, object_pairs_hook=_unique_pairs)
        else:
            _check_yaml_depth(text, p, what, error)
            data = yaml.load(text, Loader=_LOADER)
    except RecursionError:
        raise error(f"{p}: {what} is nested too deeply (at most {MAX_DEPTH} levels)") from None
    except DuplicateKey as exc:
        line = exc.line or _json_line(text, exc.key)
        at = f"line {line}: " if line else ""
        raise error(
            f"{p}: {at}key {shown(exc.key, 40)} is written twice in one mapping ({what}); "
            "keep one of them"
        ) from None
    except json.JSONDecodeError as exc:
        raise error(
            f"{p}: {what} is not valid JSON at line {exc.lineno}, column {exc.colno}: {exc.msg}"
        ) from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = getattr(exc, "problem", None) or type(exc).__name__
        raise error(f"{p}: YAML syntax error{where} ({what}): {problem}") from None
    except (ValueError, OverflowError, TypeError) as exc:  # a scalar no type can hold
        raise error(
            f"{p}: {what} holds a value that cannot be read ({type(exc).__name__}: {exc!s:.100})"
        ) from None
    _check_size(data, p, what, error)
    return data


def _json_line(text: str, key: object) -> int:
    """The line of the second ``"key":`` in a JSON text (0 when it cannot be told)."""
    hits = [m.start() for m in re.finditer(re.escape(json.dumps(key)) + r"\s*:", text)]
    return text.count("\n", 0, hits[1]) + 1 if len(hits) >= 2 else 0


def _check_yaml_depth(text: str, p: Path, what: str, error: type[HetPipeError]) -> None:
    """Refuse deep nesting from the parser's events (libyaml's composer would overflow the C
    stack on ``[[[[...`` and kill the process; its event parser is iterative).

    libyaml has a nesting limit of its own (1,000 levels since PyYAML 6.0.3, reported as a
    syntax error in its own words); when its parser fails, the pure-Python parser, which has
    none and yields events lazily, tells whether the document is deeper than ours, so the
    message never depends on a dependency's wording.
    """
    try:
        _max_depth_events(yaml.parse(text, Loader=_LOADER), p, what, error)
    except yaml.YAMLError:
        with contextlib.suppress(yaml.YAMLError):  # then the C parser's error below names it
            _max_depth_events(yaml.parse(text, Loader=yaml.SafeLoader), p, what, error)
        raise


def _max_depth_events(
    events: Iterable[yaml.Event], p: Path, what: str, error: type[HetPipeError]
) -> None:
    """Raise ``error`` as soon as ``events`` open more than :data:`MAX_DEPTH` collections."""
    depth = 0
    for event in events:
        if isinstance(event, yaml.CollectionStartEvent):
            depth += 1
            if depth > MAX_DEPTH:
                raise error(f"{p}: {what} is nested too deeply (at most {MAX_DEPTH} levels)")
        elif isinstance(event, yaml.CollectionEndEvent):
            depth -= 1


def _check_size(data: object, p: Path, what: str, error: type[HetPipeError]) -> None:
    """Walk the document (aliases expanded) without recursion; refuse bombs and deep nesting."""
    stack: list[tuple[object, int]] = [(data, 0)]
    seen = 0
    while stack:
        value, depth = stack.pop()
        seen += 1
        if seen > MAX_VALUES:
            raise error(
                f"{p}: {what} holds more than {MAX_VALUES:,} values once its YAML aliases are "
                "expanded (an alias bomb?); write the values out"
            )
        if depth > MAX_DEPTH:
            raise error(f"{p}: {what} is nested too deeply (at most {MAX_DEPTH} levels)")
        if isinstance(value, dict):
            stack.extend((v, depth + 1) for v in value.values())
        elif isinstance(value, (list, tuple)):
            stack.extend((v, depth + 1) for v in value)
