"""Shared fixtures: every test is seeded, paths point at the repo and ../shared."""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
SHARED = REPO.parent / "shared"
PIPEDREAM = SHARED / "profiles" / "pipedream"
EXAMPLES = REPO / "examples"


@pytest.fixture(autouse=True)
def _seed() -> None:
    random.seed(0)
    np.random.seed(0)
    torch.manual_seed(0)
    torch.set_num_threads(1)
