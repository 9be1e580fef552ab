"""Profile CSV loading: values are range-checked; bad files are one line naming file and field."""

from __future__ import annotations

import re
from pathlib import Path

import pandas as pd
import pytest

from profiler.errors import ProfileError
from profiler.table import COLUMNS, Profile, ProfileMeta, load_profile


def small_profile() -> Profile:
    """input -> a -> b -> output, with a skip from a to output."""
    rows = [
        ("input_1", "placeholder", "", 0.0, 0.0, 800, 0, 0),
        ("a", "Linear", "input_1", 0.5, 1.0, 1600, 800, 4000),
        ("b", "Linear", "a", 0.25, 0.5, 400, 1600, 2000),
        ("output", "output", "b;a", 0.0, 0.0, 0, 0, 0),
    ]
    table = pd.DataFrame(
        [
            {
                "layer": r[0], "op": r[1], "inputs": r[2], "fwd_ms": r[3], "bwd_ms": r[4],
                "act_bytes": r[5], "saved_bytes": r[6], "param_bytes": r[7], "buffer_bytes": 0,
                "mem_per_mb_bytes": r[6] + r[7], "peak_bytes": 0, "flops": 1e6,
            }
            for r in rows
        ]
    ).astype(COLUMNS)  # fmt: skip
    return Profile(table, ProfileMeta("tiny", "cpu", 8))


def test_round_trip(tmp_path: Path) -> None:
    prof = small_profile()
    back = load_profile(prof.save(tmp_path / "p.csv"))
    pd.testing.assert_frame_equal(back.table, prof.table)
    assert back.meta == prof.meta


def _edit_cell(text: str, layer: str, column: str, value: str) -> str:
    lines = text.splitlines()
    header = lines[1].split(",")
    for i, line in enumerate(lines[2:], start=2):
        cells = line.split(",")
        if cells[0] == layer:
            cells[header.index(column)] = value
            lines[i] = ",".join(cells)
    return "\n".join(lines) + "\n"


CELLS = [
    # (layer, column, value, fragment of the message)
    (
        "a",
        "fwd_ms",
        "-0.5",
        "column 'fwd_ms', layer 'a' (line 4): -0.5 must be a finite number >= 0",
    ),
    ("a", "bwd_ms", "nan", "column 'bwd_ms', layer 'a' (line 4): 'nan' must be a finite number"),
    ("b", "fwd_ms", "inf", "column 'fwd_ms', layer 'b' (line 5): inf must be a finite number"),
    ("b", "flops", "1e400", "column 'flops', layer 'b' (line 5): inf must be a finite"),
    ("a", "act_bytes", "-1", "column 'act_bytes', layer 'a' (line 4): -1 must be a whole number"),
    ("a", "param_bytes", "1.5", "column 'param_bytes', layer 'a' (line 4): 1.5 must be a whole"),
    (
        "a",
        "saved_bytes",
        "9" * 40,
        "column 'saved_bytes', layer 'a' (line 4): 9999999999999999999999999999999999999999 must be a whole number of bytes from 0 to 2**60",
    ),
    ("a", "act_bytes", "lots", "column 'act_bytes', layer 'a' (line 4): 'lots' must be a whole"),
    (
        "b",
        "layer",
        "a",
        "column 'layer', line 5: 'a' cannot be used: it repeats the layer of line 4",
    ),
    ("b", "inputs", "output", "layer 'b' (line 5): 'output' is not an earlier layer"),
    ("b", "inputs", "ghost", "layer 'b' (line 5): 'ghost' is not an earlier layer"),
    ("b", "op", "[red]x", "column 'op', line 5: '[red]x' cannot be used: it holds '[red]'"),
    (
        "b",
        "op",
        "\x1b[31mred",
        r"column 'op', line 5: '\x1b[31mred' cannot be used: it is not printable",
    ),
]


@pytest.mark.parametrize(("layer", "column", "value", "fragment"), CELLS)
def test_out_of_range_cell_is_one_line(
    tmp_path: Path, layer: str, column: str, value: str, fragment: str
) -> None:
    path = small_profile().save(tmp_path / "p.csv")
    path.write_text(_edit_cell(path.read_text(), layer, column, value))
    with pytest.raises(ProfileError) as info:
        load_profile(path)
    assert str(info.value).startswith(f"{path}: ")
    assert "\n" not in str(info.value)
    assert fragment in str(info.value)


META = [
    ('"batch_size": 8', '"batch_size": -4', "metadata field batch_size: -4 is not a whole number"),
    ('"batch_size": 8', '"batch_size": 0', "metadata field batch_size: 0 is not"),
    ('"batch_size": 8', '"batch_size": true', "metadata field batch_size: True is not"),
    ('"batch_size": 8', '"batch_size": "8"', "metadata field batch_size: '8' is not"),
    ('"batch_size": 8', '"batch_size": 1e400', "metadata field batch_size: inf is not"),
    (
        '"model": "tiny"',
        '"model": "t\\niny"',
        r"metadata field model: 't\niny' is not printable text",
    ),
    ('"model": "tiny"', '"colour": "red"', "metadata field 'colour' is unknown"),
    ('"model": "tiny"', '"model": ["tiny"]', "metadata field model: ['tiny'] is not"),
    ('"extra": {', '"extra": [1], "x": {', "metadata field extra: [1] is not a JSON object"),
    ("{", "[", "the metadata is not valid JSON"),
]


@pytest.mark.parametrize(("old", "new", "fragment"), META)
def test_bad_metadata_is_one_line(tmp_path: Path, old: str, new: str, fragment: str) -> None:
    path = small_profile().save(tmp_path / "p.csv")
    text = path.read_text()
    assert old in text
    path.write_text(text.replace(old, new, 1))
    with pytest.raises(ProfileError, match=re.escape(fragment)):
        load_profile(path)


@pytest.mark.parametrize(
    ("cut", "fragment"),
    [
        (lambda t: t[: t.rindex("\n", 0, -1) + 1], "profile is truncated (3 of 4 layer rows)"),
        (lambda t: t.split("\n")[0] + "\n", "malformed profile table (No columns to parse"),
        (lambda t: t[:20], "the metadata is not valid JSON"),
        (lambda t: "", "not a hetpipe profile"),
        (lambda t: t.replace("fwd_ms", "fwd"), "profile lacks columns ['fwd_ms']"),
    ],
)
def test_truncated_or_foreign_profile_is_one_line(
    tmp_path: Path, cut: object, fragment: str
) -> None:
    path = small_profile().save(tmp_path / "p.csv")
    path.write_text(cut(path.read_text()))  # type: ignore[operator]
    with pytest.raises(ProfileError, match=re.escape(fragment)):
        load_profile(path)


def test_byte_order_mark_is_accepted(tmp_path: Path) -> None:
    """A profile re-saved by a Windows editor starts with a UTF-8 byte-order mark."""
    path = small_profile().save(tmp_path / "p.csv")
    path.write_bytes(b"\xef\xbb\xbf" + path.read_bytes().replace(b"\n", b"\r\n"))
    back = load_profile(path)
    assert back.meta == small_profile().meta
    pd.testing.assert_frame_equal(back.table, small_profile().table)


def test_non_utf8_and_unreadable_profiles(tmp_path: Path) -> None:
    path = tmp_path / "p.csv"
    path.write_bytes(b"# hetpipe-profile {}\n\xff\xfe")
    with pytest.raises(
        ProfileError, match=r"cannot read profile: not UTF-8 text \(byte 0xff at line 2\)"
    ):
        load_profile(path)
    with pytest.raises(ProfileError, match=r"cannot read profile \(No such file"):
        load_profile(tmp_path / "missing.csv")
    with pytest.raises(ProfileError, match=r"cannot read profile \(Is a directory"):
        load_profile(tmp_path)
