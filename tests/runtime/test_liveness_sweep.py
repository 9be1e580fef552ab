"""The next launch removes the rendezvous folders of dead launchers, and only those (one
process: folders made by hand in ``tmp_path``, a pid of a finished child as the dead one)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from runtime.launch.liveness import STALE_AFTER_S, _sweep_temp


def _dead_pid() -> int:
    """The pid of a child that ran and was reaped (not reused in the test's few ms)."""
    child = subprocess.Popen([sys.executable, "-c", ""])
    child.wait()
    return child.pid


def _folder(base: Path, name: str, age_s: float) -> Path:
    """A rendezvous-like folder ``name`` with a card file in it, last changed ``age_s`` ago."""
    d = base / name
    d.mkdir()
    (d / "card-0").write_bytes(bytes(8))
    then = time.time() - age_s
    os.utime(d, (then, then))
    return d


OLD_S = STALE_AFTER_S + 60.0


def test_a_dead_launchers_old_folder_is_removed_with_its_card_files(tmp_path: Path) -> None:
    d = _folder(tmp_path, f"hetpipe-rdzv-{_dead_pid()}-x1y2", OLD_S)
    _sweep_temp(tmp_path)
    assert not d.exists()


def test_a_live_launchers_folder_is_kept(tmp_path: Path) -> None:
    d = _folder(tmp_path, f"hetpipe-rdzv-{os.getpid()}-x1y2", OLD_S)
    _sweep_temp(tmp_path)
    assert (d / "card-0").exists()


def test_a_young_folder_is_kept_even_when_its_pid_looks_dead(tmp_path: Path) -> None:
    # e.g. a launcher in another pid namespace that shares the temp folder
    d = _folder(tmp_path, f"hetpipe-rdzv-{_dead_pid()}-x1y2", 0.0)
    _sweep_temp(tmp_path)
    assert (d / "card-0").exists()


def test_only_our_own_folders_are_swept_and_links_are_never_followed(tmp_path: Path) -> None:
    dead = _dead_pid()
    others = [
        _folder(tmp_path, f"other-rdzv-{dead}-x1y2", OLD_S),  # not our prefix
        _folder(tmp_path, "hetpipe-rdzv-abc-x1y2", OLD_S),  # no pid in the name
    ]
    target = _folder(tmp_path, "kept", OLD_S)
    link = tmp_path / f"hetpipe-rdzv-{dead}-link"
    link.symlink_to(target, target_is_directory=True)
    then = time.time() - OLD_S
    os.utime(link, (then, then), follow_symlinks=False)
    _sweep_temp(tmp_path)
    assert all((d / "card-0").exists() for d in others)
    assert link.is_symlink() and (target / "card-0").exists()
