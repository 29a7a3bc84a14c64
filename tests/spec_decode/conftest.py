"""Speculative-decoding tests run their engines in-process with one torch thread.

Verification runs one attention call per verifying request; with two OpenMP threads on this
2-core machine each such small call waits for the other core, which other test processes keep
busy. One thread keeps these
tests fast and steady; results do not depend on it (greedy tokens are compared exactly).
"""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(autouse=True, scope="module")
def _one_torch_thread():
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)
