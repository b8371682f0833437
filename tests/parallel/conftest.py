"""Stage-parallel tests run on one thread: results must not depend on the thread count, and
the simulator is compared bit for bit with one-thread worker processes."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch


@pytest.fixture(autouse=True)
def one_thread() -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
