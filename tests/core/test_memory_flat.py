"""Measured: M-mode activation memory does not grow with depth; plain autograd's does."""

from __future__ import annotations

import os

import pytest
import torch

from revtrain.core import ReversibleBlock, ReversibleSequence, set_modes
from revtrain.core.checks import FIRST_CHECKS
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
    12h, plus the parameter gradients computed so far (all but the bottom F's); the rebuild
    check keeps its sketches on the host, so no tensor, on a step it samples as on one it does
    not. Before a fix the run's loop
    and the block still held the bottom block's y1, y2, dy1, G's input gradient and the rebuilt
    state of the block above through F's backward: 18h here.
    """
    for depth, checked in ((4, True), (16, True), (4, False), (16, False)):
        torch.manual_seed(0)
        model = make_stack(depth, half=8, check_every=1 if checked else 1000)
        x = torch.randn(8, 16, 32, 32)
        half = x.numel() * x.element_size() // 2

        def step() -> None:
            model(x).square().sum().backward()

        step()  # first-call allocations out of the way (and, with check_every=1000, the checked call)
        for p in model.parameters():
            p.grad = None
        peak = measure_peak(step, "cpu")[1]
        grads_so_far = _conv_params_bytes(model) - _conv_params_bytes(model[0].f)
        check_bytes = 0
        expected = 12 * half + grads_so_far + check_bytes
        # Slack: a few hundred bytes of small tensors (the run's check sums, scalars).
        assert abs(peak - expected) < 1024, (depth, checked, peak, expected, (peak - expected) / half)


def _kept_bytes(model: torch.nn.Module, x: torch.Tensor) -> int:
    """Tensor bytes allocated by a forward and still live when it returns (the output included)."""
    from revtrain.memory import track_peak_memory

    with track_peak_memory("cpu") as mem:
        y = model(x)
    kept = mem.end_bytes
    y.square().sum().backward()
    return kept


@pytest.mark.parametrize("chained", [False, True], ids=["sequence", "chained blocks"])
def test_memory_kept_until_backward_is_the_output_alone_at_4_and_64_blocks(chained):
    """revlib's "no more memory with depth" test at a 16 KiB stream: on a step the check does not
    sample, what an M-mode forward keeps for backward is the same at 4 blocks as at 64 (the
    output and one more stream-sized tensor of the last block, whatever the depth)."""
    kept = {}
    x = torch.randn(1, 16, 16, 16)  # 16 KiB
    for depth in (4, 64):
        torch.manual_seed(0)
        blocks = list(make_stack(depth, half=8))
        model = torch.nn.Sequential(*blocks) if chained else make_stack(depth, half=8)
        if not chained:
            model.load_state_dict(torch.nn.Sequential(*blocks).state_dict(), strict=False)
        for _ in range(FIRST_CHECKS):  # the checked first calls of the default schedule
            model(x).sum().backward()
        kept[depth] = _kept_bytes(model, x)
    assert kept[4] == kept[64] <= 2 * x.numel() * x.element_size(), kept


def test_memory_does_not_grow_with_the_number_of_input_shapes():
    """2,000 sequence lengths through M-mode blocks with the default check (and 500 more with
    the check on every call): the process grows by a bounded amount, not per shape."""
    import gc

    def rss() -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny products: threads only wait for each other on a busy host
    try:
        torch.manual_seed(0)
        width = 8
        for every, lengths in ((None, range(101, 2101)), (1, range(2101, 2601))):
            model = ReversibleSequence([
                ReversibleBlock(torch.nn.Linear(width, width), torch.nn.Linear(width, width), split_dim=-1,
                                check_every=every)
                for _ in range(2)])
            for length in range(1, 101):  # warm-up
                model(torch.randn(1, length, 2 * width)).sum().backward()
            gc.collect()
            start = rss()
            for length in lengths:
                model(torch.randn(1, length, 2 * width)).sum().backward()
            gc.collect()
            grown = rss() - start
            assert grown < 32 * 2**20, (every, grown)
    finally:
        torch.set_num_threads(threads)
