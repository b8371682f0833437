"""Fixtures shared by every test folder."""

from __future__ import annotations

import os

import pytest
import torch
from hypothesis import settings

# Property tests draw the same examples on every run, so a run of the suite cannot fail by the
# luck of the draw; HYPOTHESIS_PROFILE=explore draws new ones (to hunt for bugs, not in CI).
settings.register_profile("repeatable", derandomize=True)
settings.register_profile("explore", derandomize=False)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "repeatable"))


@pytest.fixture
def checkpoint_reads(monkeypatch: pytest.MonkeyPatch) -> list[object]:
    """The paths ``torch.load`` reads from now on, in order (it still loads them)."""
    reads: list[object] = []
    real_load = torch.load

    def counting_load(*args: object, **kwargs: object) -> object:
        reads.append(args[0])
        return real_load(*args, **kwargs)

    monkeypatch.setattr(torch, "load", counting_load)
    return reads
