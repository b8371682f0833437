"""Extra arguments of a block reach F and G, get gradients, and are replayed in the rebuild."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from revtrain.core import ReversibleBlock, ReversibleSequence, set_modes
from revtrain.errors import ReconstructionError, ReversibilityError

from .helpers import assert_grads_close, grads, plain_twin

REL = 1e-10


class Conditioned(nn.Module):
    """``tanh(W x * mask + shift * scale)``: a mask and a conditioning tensor, positional and
    keyword, nested in a dict, plus a plain number."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.lin = nn.Linear(width, width)
        self.calls = 0

    def forward(self, x, mask, *, cond, scale=1.0):
        self.calls += 1
        return torch.tanh(self.lin(x) * mask + cond["shift"] * scale)


def _block(mode="M", seed=0) -> ReversibleBlock:
    torch.manual_seed(seed)
    return ReversibleBlock(Conditioned(3), Conditioned(3), mode=mode).double()


def _inputs(seed=1):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(4, 6, dtype=torch.float64, generator=g, requires_grad=True)
    mask = (torch.rand(4, 3, generator=g) > 0.3).double()
    shift = torch.randn(4, 3, dtype=torch.float64, generator=g, requires_grad=True)
    return x, mask, shift


def _step(model, x, mask, shift, inverse=False):
    fn = model.inverse if inverse else model
    out = fn(x, mask, cond={"shift": shift}, scale=0.5)
    out.square().sum().backward()
    return out.detach()


@pytest.mark.parametrize("inverse", [False, True])
@pytest.mark.parametrize("build", ["block", "sequence"])
def test_extra_arguments_get_exact_gradients(build, inverse):
    model = _block() if build == "block" else ReversibleSequence([_block(seed=s) for s in range(3)])
    twin = plain_twin(model)
    x, mask, shift = _inputs()
    x_ref, _, shift_ref = _inputs()
    out = _step(model, x, mask, shift, inverse)
    out_ref = _step(twin, x_ref, mask, shift_ref, inverse)
    torch.testing.assert_close(out, out_ref, rtol=REL, atol=1e-12)
    torch.testing.assert_close(x.grad, x_ref.grad, rtol=REL, atol=1e-12)
    torch.testing.assert_close(shift.grad, shift_ref.grad, rtol=REL, atol=1e-12)
    assert_grads_close(grads(model), grads(twin), REL)


def test_rebuild_replays_the_arguments():
    """The rebuild must use the forward's mask: without it the input would not come back."""
    block = _block()
    block.drift_action = "raise"
    x, mask, shift = _inputs()
    _step(block, x, mask, shift)  # raises on any rebuild error (drift check)
    assert [block.f.calls, block.g.calls] == [2, 2]  # forward once, rebuild once


def test_pair_input_with_arguments():
    block = _block()
    twin = plain_twin(block)
    for model in (block, twin):
        x, mask, shift = _inputs()
        y1, y2 = model((x[:, :3], x[:, 3:]), mask, cond={"shift": shift})
        (y1 * y2).sum().backward()
    assert_grads_close(grads(block), grads(twin), REL)


def test_argument_modified_in_place_before_backward():
    block = _block()
    x, mask, shift = _inputs()
    out = block(x, mask, cond={"shift": shift})
    mask.mul_(0)
    with pytest.raises(ReconstructionError, match="extra argument.*modified in place"):
        out.sum().backward()


def test_old_pair_call_says_what_changed():
    block = ReversibleBlock(nn.Linear(3, 3), nn.Linear(3, 3))
    x1, x2 = torch.randn(2, 3), torch.randn(2, 3)
    with pytest.raises(ReversibilityError, match=r"block\(\(x1, x2\)\)"):
        block(x1, x2)


def test_modes_agree_with_unused_argument_gradient():
    """An argument that requires grad but is multiplied by zero gets zeros, like autograd."""
    block = _block()
    twin = plain_twin(block)
    set_modes(twin, "C")
    for model in (block, twin):
        x, mask, shift = _inputs()
        model(x, torch.zeros_like(mask), cond={"shift": shift}, scale=0.0).sum().backward()
        assert shift.grad is not None and float(shift.grad.abs().max()) == 0.0
