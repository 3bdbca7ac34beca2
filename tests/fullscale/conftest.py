"""Shared fixtures of the fullscale tests."""

import pytest
import torch


@pytest.fixture
def one_thread():
    """One torch thread: 2 cores shared by 2 xdist workers crawl when oversubscribed."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
