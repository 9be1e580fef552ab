"""The kinds of message a launched child sends its launcher, below both of them.

The stage worker writes these and the launcher's :class:`runtime.launch.reports.Reports`
reads them; neither layer imports the other for the kind.
"""

from __future__ import annotations

__all__ = ["REPORTS"]

REPORTS = "reports"
"""The kind of a message carrying several reports of one child, in order."""
