"""Shared fixtures: every test is seeded, paths point at the repo and ../shared."""

from __future__ import annotations

import os
import random
from pathlib import Path

import numpy as np
import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
SHARED = REPO.parent / "shared"
PIPEDREAM = REPO / "tests" / "data" / "pipedream"  # vendored (MIT, LICENSE.txt beside)
EXAMPLES = REPO / "examples"


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Tests marked ``cuda`` are skipped, saying so, on a host without a CUDA device."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (torch.cuda.is_available() is False)")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True, scope="session")
def _profile_cache(tmp_path_factory: pytest.TempPathFactory) -> None:
    """Measured CPU profiles are cached in a folder of this session, never the user's cache."""
    os.environ["HETPIPE_CACHE_DIR"] = str(tmp_path_factory.mktemp("hetpipe-cache"))


@pytest.fixture(autouse=True)
def _seed() -> None:
    random.seed(0)
    np.random.seed(0)
    torch.manual_seed(0)
    torch.set_num_threads(1)
