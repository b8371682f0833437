"""Exact couplings: activations on a fixed-point grid, rebuilt bit for bit at any depth.

M-mode gradients of an exact stack must equal the C-mode gradients of the same (quantised)
network exactly (``torch.equal``, float32), where a plain additive stack only agrees to
rounding; overflow of the grid's range is an error, never a silent loss of exactness.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from revtrain.core import (
    ExactAdditiveCoupling,
    ReversibleBlock,
    ReversibleSequence,
    set_modes,
    use_exact_couplings,
    verify_invertible,
)
from revtrain.errors import GridOverflowError, ReversibilityError
from revtrain.memory import measure_peak

from .helpers import conv_fn, grads, make_stack, plain_twin


def _dropout_fn() -> nn.Module:
    return nn.Sequential(nn.Conv2d(4, 4, 3, padding=1, bias=False), nn.BatchNorm2d(4), nn.Dropout(0.2), nn.ReLU())


def _step(model, x, w, seed=5):
    torch.manual_seed(seed)  # the same dropout masks in both runs
    x = x.clone().requires_grad_(True)
    (model(x) * w).sum().backward()
    return x.grad


@pytest.mark.parametrize("fn", ["conv-bn-tanh", "with dropout"])
def test_m_mode_gradients_equal_c_mode_exactly_at_depth_16(fn):
    torch.manual_seed(0)
    if fn == "with dropout":
        model = ReversibleSequence([ReversibleBlock(_dropout_fn(), _dropout_fn(), coupling="exact") for _ in range(16)])
    else:
        model = make_stack(16, "exact")
    twin = plain_twin(model)
    x, w = torch.randn(4, 8, 6, 6), torch.randn(4, 8, 6, 6)
    gx, gx_ref = _step(model, x, w), _step(twin, x, w)
    assert torch.equal(gx, gx_ref)
    got, want = grads(model), grads(twin)
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in got)
    for (name, a), (_, b) in zip(model.named_buffers(), twin.named_buffers()):
        assert torch.equal(a, b), name


def _linear_stack(depth: int, coupling: str) -> ReversibleSequence:
    def fn():
        return nn.Sequential(nn.Linear(8, 8), nn.Tanh())

    torch.manual_seed(0)
    return ReversibleSequence([ReversibleBlock(fn(), fn(), coupling=coupling) for _ in range(depth)])


@pytest.mark.parametrize("coupling", ["exact", "additive"])
def test_depth_1000(coupling):
    """Exact: every block rebuilds its input with error 0 and M == C bit for bit. Additive,
    the same network in plain float32: both differ (what exact mode removes)."""
    model = _linear_stack(1000, coupling)
    for block in model:
        block.check_reconstruction = False  # the additive stack's drift is the point here
    x = torch.randn(16, 16)
    report = verify_invertible(model, x, raise_on_failure=False)
    worst = max(c.max_abs_error for c in report.checks)
    twin = plain_twin(model)
    w = torch.randn(16, 16)
    gx, gx_ref = _step(model, x, w), _step(twin, x, w)
    got, want = grads(model), grads(twin)
    same = torch.equal(gx, gx_ref) and all(torch.equal(got[k], want[k]) for k in got)
    if coupling == "exact":
        assert worst == 0.0 and same
    else:
        assert worst > 0.0 and not same


def test_activations_stay_on_the_grid():
    coupling = ExactAdditiveCoupling(fraction_bits=10)
    block = ReversibleBlock(conv_fn(4), conv_fn(4), coupling=coupling)
    y = block(torch.randn(2, 8, 5, 5))
    scaled = y.detach() * 2**10
    assert torch.equal(scaled, scaled.round())


def test_chained_exact_blocks_keep_flat_memory_and_exactness():
    """An exact block fed by another exact block does not quantise again (its input is on the
    grid already), so it can take over the earlier output like any M-mode block."""

    def peak(depth):
        torch.manual_seed(0)
        blocks = nn.ModuleList([ReversibleBlock(conv_fn(8), conv_fn(8), coupling="exact") for _ in range(depth)])
        x = torch.randn(16, 16, 48, 48)

        def step():
            h = x
            for b in blocks:
                h = b(h)
            h.square().sum().backward()

        return measure_peak(step, "cpu")[1]

    assert peak(12) <= 1.10 * peak(4)
    torch.manual_seed(0)
    blocks = nn.ModuleList([ReversibleBlock(conv_fn(4), conv_fn(4), coupling="exact") for _ in range(6)])
    twin = plain_twin(blocks)
    x, w = torch.randn(2, 8, 5, 5), torch.randn(2, 8, 5, 5)

    def loop(model):
        def run(h):
            for b in model:
                h = b(h)
            return h

        return run

    class Run(nn.Module):
        def __init__(self, model):
            super().__init__()
            self.model = model

        def forward(self, h):
            return loop(self.model)(h)

    assert torch.equal(_step(Run(blocks), x, w), _step(Run(twin), x, w))
    got, want = grads(blocks), grads(twin)
    assert all(torch.equal(got[k], want[k]) for k in got)


# -- the grid's limits are errors -------------------------------------------------------------


class Huge(nn.Module):
    def __init__(self, value: float) -> None:
        super().__init__()
        self.value = value

    def forward(self, x):
        return torch.full_like(x, self.value)


@pytest.mark.parametrize("mode", ["M", "C"])
def test_overflow_is_a_clear_error(mode):
    block = ReversibleBlock(Huge(5000.0), nn.Tanh(), coupling="exact", mode=mode)  # range ±4096
    with pytest.raises(GridOverflowError, match=r"reached 5\d\d\d.*range ±4096.*fraction_bits=\d+"):
        block(torch.randn(2, 8, requires_grad=True))


def test_input_beyond_the_range_is_a_clear_error():
    block = ReversibleBlock(nn.Tanh(), nn.Tanh(), coupling=ExactAdditiveCoupling(fraction_bits=20))  # ±16
    with pytest.raises(GridOverflowError, match=r"input of an exact block.*reached"):
        block(torch.full((2, 8), 100.0))


def test_non_finite_f_is_named_as_such():
    block = ReversibleBlock(Huge(float("nan")), nn.Tanh(), coupling="exact")
    with pytest.raises(GridOverflowError, match=r"non-finite values.*forward pass"):
        block(torch.randn(2, 8))


def test_half_precision_halves_are_refused():
    block = ReversibleBlock(nn.Identity(), nn.Identity(), coupling="exact")
    with pytest.raises(ReversibilityError, match=r"float32 or float64"):
        block(torch.randn(2, 8, dtype=torch.bfloat16))


def test_use_exact_couplings_on_a_model():
    model = nn.Sequential(nn.Conv2d(3, 8, 1), make_stack(3), make_stack(2))
    assert use_exact_couplings(model, fraction_bits=11) == 5
    assert all(b.coupling.grid.fraction_bits == 11 for b in model[1]) and all(b.coupling.name == "exact" for b in model[2])
    set_modes(model, "M")
    model(torch.randn(2, 3, 5, 5)).sum().backward()
    with pytest.raises(ValueError, match=r"additive ones only.*AffineCoupling"):
        use_exact_couplings(nn.Sequential(make_stack(1), make_stack(1, "affine")))


def test_bad_fraction_bits():
    with pytest.raises(ValueError, match="fraction_bits must be an integer from 0 to 40"):
        ExactAdditiveCoupling(fraction_bits=64)
