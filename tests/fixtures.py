"""Fixtures shared by several test packages (imported into their conftest.py)."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(autouse=True)
def one_torch_thread():
    """Tiny models are dispatch-bound: one intra-op thread is as fast, and does not stall on
    its barrier when another process holds the second core."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)
