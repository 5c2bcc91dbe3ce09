"""Unit tests run torch on one intra-op thread: their tensors are tiny, and on 2 cores OpenMP wake-up costs
would dominate (and make the suite sensitive to other load)."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)
