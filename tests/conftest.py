"""Fixtures shared by every test folder."""

from __future__ import annotations

import pytest
import torch


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
