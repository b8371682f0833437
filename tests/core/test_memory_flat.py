"""Measured: M-mode activation memory does not grow with depth; plain autograd's does."""

from __future__ import annotations

import torch

from revtrain.core import set_modes
from revtrain.core.checks import PROJECTIONS
from revtrain.core.fingerprint import FOLD_EVERY, ROW_VECTORS, _slab_shape, layout_of
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


def _conv_params_bytes(module: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in module.parameters())


def test_m_mode_peak_equals_the_analysis_at_two_depths():
    """The peak of an M-mode step, counted tensor by tensor, at depths 4 and 16.

    With F = G = Conv3x3 + BatchNorm + Tanh on halves of ``h`` bytes, the peak comes during F's
    backward in the bottom block. Alive then: the stack's output (2h, held by the caller) and its
    gradient (2h, held by autograd for the run's whole backward call), and in the bottom block
    the rebuilt x2 and x1, dz1 (the gradient reaching y1), dx2 (so far), F's saved conv and tanh
    outputs and the two gradients of F's backward in flight (tanh's and batch norm's): 8h. So
    12h, plus the parameter gradients computed so far (all but the bottom F's) and the rebuild
    check's state: the forward's fingerprints (one per block's input and one of the run's output,
    float32), each block's verdict (two numbers per half, room for all allocated at the start of
    backward: ``RunCheck``) and the rebuilt inputs not compared yet, as row projections (two per
    row of each half; they are folded and compared in groups of ``FOLD_EVERY``). Before the fix the run's loop and the
    block still held the bottom block's y1, y2, dy1, G's input gradient and the rebuilt state of
    the block above through F's backward: 18h here (in the core benchmark 72.3 MiB against
    revlib's 64.0 MiB; 56.3 MiB now).
    """
    fingerprint_bytes = 2 * (1 + PROJECTIONS) * 4  # two float32 halves
    for depth in (4, 16):
        torch.manual_seed(0)
        model = make_stack(depth, half=8)
        x = torch.randn(8, 16, 32, 32)
        half = x.numel() * x.element_size() // 2

        def step() -> None:
            model(x).square().sum().backward()

        step()  # first-call allocations (generator states, cached check vectors) out of the way
        for p in model.parameters():
            p.grad = None
        peak = measure_peak(step, "cpu")[1]
        grads_so_far = _conv_params_bytes(model) - _conv_params_bytes(model[0].f)
        a, rows, _ = _slab_shape(x[:, :8], layout_of([x[:, :8]])[0])
        pending_bytes = 2 * (a * rows * ROW_VECTORS) * 4  # W of two float32 halves
        above = depth - 1  # blocks rebuilt before the bottom one
        pending = above % FOLD_EVERY  # rebuilt states not compared yet
        verdict_bytes = 2 * 2 * 4  # per block: two float32 numbers per half
        check_bytes = fingerprint_bytes * (depth + 1) + verdict_bytes * depth + pending_bytes * pending
        expected = 12 * half + grads_so_far + check_bytes
        # Slack: a few hundred bytes of small tensors (the run's check sums, scalars).
        assert abs(peak - expected) < 1024, (depth, peak, expected, (peak - expected) / half)
