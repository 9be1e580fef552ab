"""Where a ``wave`` stage resumes from: its part of a committed snapshot (paper Sec. 5 runtime).

A resumed run starts every stage from its part of the snapshot at the resume clock; a restarted
VW (``rejoined``) takes the newest committed snapshot at or below that clock that holds its
part (:class:`runtime.sync.wave.WaveSync`, :mod:`runtime.persist.stage_part`).
"""

from __future__ import annotations

import logging
from pathlib import Path

from runtime.persist.snapshot import (
    Manifest,
    SnapshotSpec,
    committed_clocks,
    load_part,
    read_manifest,
    snapshot_dir,
)
from runtime.persist.stage_part import StagePart, stage_from_payload

__all__ = ["own_snapshot", "resume_part"]

log = logging.getLogger(__name__)


def resume_part(
    snapshots: SnapshotSpec | None, where: str, clock: int, nm: int, rejoined: bool
) -> StagePart | None:
    """Stage ``where``'s part to start from (``None``: a run from the start, or no part of its
    own: fresh optimizer state)."""
    if clock <= 0 or snapshots is None:
        return None
    manifest = own_snapshot(snapshots.directory, where, clock, rejoined)
    if manifest is None:
        return None
    path = manifest.path / f"{where}.pt"
    return stage_from_payload(load_part(manifest, where), path, manifest.clock, nm)


def own_snapshot(directory: Path, where: str, clock: int, rejoined: bool) -> Manifest | None:
    """The snapshot to start from: the one at ``clock`` (a resume); a restarted VW's
    (``rejoined``): the newest committed one at or below ``clock`` holding its part."""
    if not rejoined:
        manifest = read_manifest(snapshot_dir(directory, clock))
        if where not in manifest.parts:  # its VW was left out before that clock
            log.warning("%s: no part of %s (its VW was evicted before that clock): it "
                        "starts with fresh optimizer state", manifest.path, where)  # fmt: skip
            return None
        return manifest
    for c in sorted((c for c in committed_clocks(directory) if c <= clock), reverse=True):
        manifest = read_manifest(snapshot_dir(directory, c))
        if where in manifest.parts:
            return manifest
    return None
