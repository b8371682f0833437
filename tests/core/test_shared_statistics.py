"""A rebuild writes to no tensor that another pending graph saved (batch-norm statistics).

Batch norm in training mode updates its running statistics in place. Plain autograd copes with
a norm layer used by several pending graphs; an M-mode rebuild must too: it must neither update
the statistics a second time nor write them back, or every other graph that saved them fails
with "modified by an inplace operation".
"""

from __future__ import annotations

import pytest
import torch

from revtrain.core import ReversibleBlock

from .helpers import assert_grads_close, conv_fn, grads, plain_twin

REL = 1e-10  # float64 throughout


def _block(seed: int = 0) -> ReversibleBlock:
    torch.manual_seed(seed)
    return ReversibleBlock(conv_fn(4), conv_fn(4)).double()


def _x(seed: int, requires_grad: bool = True) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(3, 8, 5, 5, dtype=torch.float64, generator=g).requires_grad_(requires_grad)


def _versions(module: torch.nn.Module) -> dict[str, int]:
    return {name: t._version for name, t in [*module.named_parameters(), *module.named_buffers()]}


def _assert_same_state(model, twin) -> None:
    assert_grads_close(grads(model), grads(twin), REL)
    for (name, a), (_, b) in zip(model.named_buffers(), twin.named_buffers()):
        torch.testing.assert_close(a, b, rtol=REL, atol=REL, msg=name)


@pytest.mark.parametrize("modes", [("C", "M"), ("M", "C"), ("M", "M")])
def test_weight_tied_block_in_mixed_modes(modes):
    """One block applied twice in one graph, each time in its own mode (what a plan can make)."""
    block = _block()
    twin = plain_twin(block)

    def two_applications(module, first, second):
        x = _x(1)
        module.mode = first
        y = module(x)
        module.mode = second
        module(y).square().sum().backward()
        return x.grad

    gx = two_applications(block, *modes)
    gx_ref = two_applications(twin, "C", "C")
    torch.testing.assert_close(gx, gx_ref, rtol=REL, atol=1e-12)
    _assert_same_state(block, twin)


def test_training_through_inverse_and_forward_in_one_backward():
    block = _block()
    twin = plain_twin(block)
    for module in (block, twin):
        x, target = _x(1), _x(2)
        loss = module.inverse(target).square().sum() + module(x).square().sum()
        loss.backward()
    _assert_same_state(block, twin)


def test_forward_then_two_inverses_then_two_backward_passes():
    block = _block()
    twin = plain_twin(block)
    for module in (block, twin):
        y = module(_x(1))
        a, b = module.inverse(y), module.inverse(2 * y)
        a.square().sum().backward(retain_graph=True)
        b.sum().backward(retain_graph=True)
        a.sum().backward()
    _assert_same_state(block, twin)


def test_m_mode_backward_writes_to_no_parameter_or_buffer():
    """The class behind the three cases: after the forward, backward bumps no version counter."""
    block = _block()
    y = block(_x(1))
    before = _versions(block)
    y.square().sum().backward()
    assert _versions(block) == before


def test_norm_layer_shared_by_two_blocks_in_different_modes():
    torch.manual_seed(0)
    shared = conv_fn(4)
    first = ReversibleBlock(shared, conv_fn(4), mode="C").double()
    second = ReversibleBlock(conv_fn(4), shared, mode="M").double()
    model = torch.nn.Sequential(first, second)
    twin = plain_twin(model)
    for module in (model, twin):
        module(_x(1)).square().sum().backward()
    _assert_same_state(model, twin)
