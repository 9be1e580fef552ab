"""Imported by the launcher's forkserver before anything else, and by nothing else: it makes
the forkserver die with the launcher.

The ranks are the forkserver's children and die with it (``PR_SET_PDEATHSIG``,
:func:`runtime.launch.child.setup_child`); the forkserver itself only exits once it reads
the end of its pipe from the launcher, then tears down an interpreter holding torch, which
took up to 5.5 s on a loaded host after a ``SIGKILL``\\ed launcher, while the ranks it had
started went on and printed ``BrokenPipeError`` tracebacks on their report pipes. With the
death signal the kernel kills the forkserver, and so every rank, the moment the launcher
dies. Its one statement runs at import on purpose: the forkserver runs nothing of ours but
the imports of :data:`runtime.launch.procs.PRELOAD`, of which this is the first.
"""

from __future__ import annotations

from runtime.launch.child import die_with_parent

__all__: list[str] = []

die_with_parent()
