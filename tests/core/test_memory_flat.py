"""Measured: M-mode activation memory does not grow with depth; plain autograd's does."""

from __future__ import annotations

import torch

from revtrain.core import set_modes
from revtrain.memory import measure_peak

from .helpers import make_stack


def _peak_of_step(depth: int, mode: str, inverse: bool = False) -> int:
    torch.manual_seed(0)
    model = make_stack(depth, half=8)
    set_modes(model, mode)
    # Activations (1.2 MiB per half per block) dominate what grows with depth regardless of
    # mode: parameter gradients and the per-block generator states (about 30 KiB per block).
    x = torch.randn(16, 16, 48, 48)
    run = model.inverse if inverse else model

    def step() -> None:
        run(x).square().sum().backward()

    return measure_peak(step, "cpu")[1]


def test_m_mode_peak_flat_in_depth_plain_grows():
    m4, m32 = _peak_of_step(4, "M"), _peak_of_step(32, "M")
    c4, c32 = _peak_of_step(4, "C"), _peak_of_step(32, "C")
    assert m32 <= 1.10 * m4, (m4, m32)
    assert c32 >= 4 * c4, (c4, c32)
    assert m32 < c4  # 32 M-mode blocks need less than 4 plain ones


def test_training_through_the_inverse_keeps_memory_flat_too():
    m4, m16 = _peak_of_step(4, "M", inverse=True), _peak_of_step(16, "M", inverse=True)
    c4 = _peak_of_step(4, "C", inverse=True)
    assert m16 <= 1.10 * m4, (m4, m16)
    assert m16 < c4
