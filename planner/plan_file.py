"""Reading plan files: a plan (:func:`load_plan`), or a file that is a plan or a cluster.yaml
(:func:`load_plan_or_cluster`, what ``hetpipe run`` and ``simulate`` accept). The document
itself, and its checks: :mod:`planner.plan`."""

from __future__ import annotations

import os
from pathlib import Path

from planner.cluster import Cluster, parse_cluster
from planner.plan import Plan
from profiler.errors import ConfigError, PlanError
from profiler.inputs import load_document

__all__ = ["load_plan", "load_plan_or_cluster"]


def load_plan(path: str | os.PathLike[str]) -> Plan:
    """Read a plan file (YAML or JSON).

    Raises:
        PlanError: unreadable, not a mapping, or invalid.
    """
    p = Path(path)
    data = load_document(p, "plan file", PlanError)
    if not isinstance(data, dict):
        raise PlanError(f"{p}: a plan file must be a mapping, got {type(data).__name__}")
    return Plan.from_dict(data, str(p))


def load_plan_or_cluster(path: str | os.PathLike[str]) -> Plan | Cluster:
    """Read a file that is either a plan (it has ``virtual_workers``) or a cluster.yaml.

    Raises:
        PlanError, ConfigError: unreadable or invalid, as :func:`load_plan` and
            :func:`planner.cluster.load_cluster` report it.
    """
    p = Path(path)
    data = load_document(p, "plan or cluster file", ConfigError)
    if isinstance(data, dict) and "virtual_workers" in data:
        return Plan.from_dict(data, str(p))
    return parse_cluster(data, str(p))
