"""Backward in M-mode runs F and G exactly once more each (RevNet Algorithm 1, not 5N)."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import flop_registry

from revtrain.core import ReversibleBlock, ReversibleSequence, set_modes

from .helpers import conv_fn


class FlopCount(TorchDispatchMode):
    """Total FLOPs of every op that torch's flop registry knows (convolutions, matmuls).

    torch's FlopCounterMode also tracks modules with autograd hooks that do not support the
    ``torch.autograd.grad`` calls inside our backward, so we count at the dispatch level.
    """

    def __init__(self) -> None:
        super().__init__()
        self.total = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func.overloadpacket in flop_registry:
            self.total += flop_registry[func.overloadpacket](*args, **kwargs, out_val=out)
        return out


class Counted(nn.Module):
    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        return self.inner(x)


def _stack(depth: int) -> ReversibleSequence:
    return ReversibleSequence(
        [ReversibleBlock(Counted(conv_fn(4)), Counted(conv_fn(4))) for _ in range(depth)]
    )


@pytest.mark.parametrize("mode,calls_per_step", [("M", 2), ("C", 1)])
def test_each_f_and_g_runs_twice_in_m_mode_once_in_c_mode(mode, calls_per_step):
    model = _stack(5)
    set_modes(model, mode)
    for step in range(1, 3):
        model(torch.randn(2, 8, 5, 5, requires_grad=True)).square().sum().backward()
        counts = [m.calls for m in model.modules() if isinstance(m, Counted)]
        assert counts == [calls_per_step * step] * 10


def test_m_mode_extra_flops_equal_one_forward_of_f_and_g():
    """FLOPs(M step) - FLOPs(C step) == FLOPs of one forward of every F and G, exactly.

    The rebuild check's random projections are matrix products too (about 2 per input value per
    block, against ~600 for the 3x3 convolutions here); they are switched off to count F and G.
    """
    torch.manual_seed(0)
    model = _stack(4)
    for block in model:
        block.check_reconstruction = False
    x = torch.randn(2, 8, 6, 6)

    def step_flops(mode: str) -> int:
        set_modes(model, mode)
        with FlopCount() as counter:
            model(x).square().sum().backward()
        return counter.total

    with FlopCount() as fwd, torch.no_grad():
        model(x)
    plain, m_mode = step_flops("C"), step_flops("M")
    assert fwd.total > 0 and plain > 2 * fwd.total
    assert m_mode - plain == fwd.total


@pytest.mark.parametrize("mode,calls_per_step", [("M", 2), ("C", 1)])
def test_memory_saving_inverse_runs_f_and_g_twice_in_m_mode(mode, calls_per_step):
    """Training through ``inverse`` costs what training through the forward costs."""
    model = _stack(5)
    set_modes(model, mode)
    for step in range(1, 3):
        model.inverse(torch.randn(2, 8, 5, 5, requires_grad=True)).square().sum().backward()
        counts = [m.calls for m in model.modules() if isinstance(m, Counted)]
        assert counts == [calls_per_step * step] * 10


def test_chained_blocks_run_f_and_g_twice():
    blocks = [ReversibleBlock(Counted(conv_fn(4)), Counted(conv_fn(4))) for _ in range(4)]
    h = torch.randn(2, 8, 5, 5, requires_grad=True)
    for block in blocks:
        h = block(h)
    h.square().sum().backward()
    assert [m.calls for b in blocks for m in b.modules() if isinstance(m, Counted)] == [2] * 8
