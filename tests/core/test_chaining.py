"""M-mode blocks chained in any container keep one output, and stay exact in every corner.

A block whose input is the complete output of another M-mode run takes that output over: the
earlier run drops its copy and gets the tensor rebuilt by the later one in backward. The tests
prove the memory claim by measurement at two depths and every fallback by comparing gradients
with plain autograd (float64, 1e-10).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from revtrain.core import ReversibleBlock, ReversibleSequence, set_modes
from revtrain.errors import ReconstructionError
from revtrain.memory import measure_peak

from .helpers import assert_grads_close, conv_fn, grads, plain_twin

REL = 1e-10


def _blocks(depth: int, half: int = 4, seed: int = 0) -> list[ReversibleBlock]:
    torch.manual_seed(seed)
    return [ReversibleBlock(conv_fn(half), conv_fn(half)) for _ in range(depth)]


def _loop(blocks, x):
    for block in blocks:
        x = block(x)
    return x


CONTAINERS = {
    "python loop": lambda blocks: (blocks, _loop),
    "nn.Sequential": lambda blocks: (nn.Sequential(*blocks), lambda m, x: m(x)),
    "nn.ModuleList": lambda blocks: (nn.ModuleList(blocks), _loop),
    "sequences in nn.Sequential": lambda blocks: (
        nn.Sequential(*(ReversibleSequence(blocks[i : i + 2]) for i in range(0, len(blocks), 2))),
        lambda m, x: m(x),
    ),
}


def _peak(container: str, depth: int, mode: str) -> int:
    model, run = CONTAINERS[container](_blocks(depth, half=8))
    set_modes(nn.ModuleList(model) if isinstance(model, list) else model, mode)
    # Activations (1.2 MiB per half per block) dominate what grows with depth.
    x = torch.randn(16, 16, 48, 48)

    def step() -> None:
        run(model, x).square().sum().backward()

    return measure_peak(step, "cpu")[1]


@pytest.mark.parametrize("container", list(CONTAINERS))
def test_chained_m_mode_blocks_keep_flat_memory(container):
    m4, m16 = _peak(container, 4, "M"), _peak(container, 16, "M")
    c4 = _peak(container, 4, "C")
    assert m16 <= 1.10 * m4, (m4, m16)
    assert m16 < c4  # 16 chained M-mode blocks need less than 4 plain ones


@pytest.mark.parametrize("container", list(CONTAINERS))
def test_chained_blocks_match_plain_autograd(container):
    model, run = CONTAINERS[container]([b.double() for b in _blocks(6)])
    module = nn.ModuleList(model) if isinstance(model, list) else model
    twin = plain_twin(module)
    twin_model = list(twin) if isinstance(model, list) else twin
    x = torch.randn(2, 8, 5, 5, dtype=torch.float64, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_(True)
    run(model, x).square().sum().backward()
    run(twin_model, x_ref).square().sum().backward()
    torch.testing.assert_close(x.grad, x_ref.grad, rtol=REL, atol=1e-12)
    assert_grads_close(grads(module), grads(twin), REL)


# -- the corners: each path by which the earlier run gets its output back ----------------------


def _pair(seed=0):
    a, b = (blk.double() for blk in _blocks(2, seed=seed))
    return nn.ModuleList([a, b])


def _x(seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(2, 8, 5, 5, dtype=torch.float64, generator=g).requires_grad_(True)


def _both(model, fn):
    """Run ``fn(model, x)`` on the M-mode model and its plain twin; compare every gradient."""
    twin = plain_twin(model)
    x, x_ref = _x(), _x()
    fn(model, x)
    fn(twin, x_ref)
    torch.testing.assert_close(x.grad, x_ref.grad, rtol=REL, atol=1e-12)
    assert_grads_close(grads(model), grads(twin), REL)


def test_output_used_elsewhere_and_still_held():
    def fn(m, x):
        y = m[0](x)
        (m[1](y).square().sum() + (y * y).sum()).backward()

    _both(_pair(), fn)


def test_output_used_elsewhere_then_dropped():
    def fn(m, x):
        y = m[0](x)
        loss = m[1](y).square().sum() + y.sum()  # sum keeps nothing of y
        del y
        loss.backward()

    _both(_pair(), fn)


def test_later_block_not_in_the_loss_and_output_dropped():
    """The later block's backward never runs; the earlier run rebuilds from the later's output."""

    def fn(m, x):
        y = m[0](x)
        z = m[1](y)  # taken over, but z does not reach the loss
        loss = y.sum()
        del y
        loss.backward()
        assert z.grad_fn is not None  # z (and with it the later run) is still alive

    _both(_pair(), fn)


def test_output_modified_in_place_after_the_later_block_took_it():
    def fn(m, x):
        y = m[0](x)
        z = m[1](y)
        y2 = y.mul_(2) if m[0].mode == "M" else y * 2  # plain autograd refuses the in-place edit
        (z.square().sum() + y2.sum()).backward()

    _both(_pair(), fn)


def test_output_modified_in_place_before_the_later_block_is_not_taken():
    model = _pair()
    y = model[0](_x())
    y.mul_(2)
    with pytest.raises(ReconstructionError, match="modified in place"):
        model[1](y).sum().backward()


def test_retain_graph_twice_through_a_chain():
    def fn(m, x):
        loss = _loop(m, x).square().sum()
        loss.backward(retain_graph=True)
        loss.backward()

    _both(_pair(), fn)


def test_two_later_blocks_read_the_same_output():
    torch.manual_seed(0)
    blocks = nn.ModuleList([blk.double() for blk in _blocks(3)])

    def fn(m, x):
        y = m[0](x)
        (m[1](y).square().sum() + m[2](y).sum()).backward()

    _both(blocks, fn)


def test_second_backward_only_through_the_earlier_output():
    def fn(m, x):
        y = m[0](x)
        z = m[1](y)
        z.square().sum().backward(retain_graph=True)
        y.sum().backward()

    _both(_pair(), fn)


def test_lost_output_is_a_clear_error():
    """The later run is gone (its output dropped, not in the loss) and nothing held the
    earlier output: there is nothing left to rebuild from."""
    model = _pair()
    y = model[0](_x())
    model[1](y)  # the result is dropped at once: the later run dies with it
    loss = y.sum()
    del y
    with pytest.raises(ReconstructionError, match="taken over.*keep a reference|Keep a reference"):
        loss.backward()


# -- the caller's own saved-tensor hooks ------------------------------------------------------


def test_callers_saved_tensor_hooks_see_what_m_mode_keeps():
    """Offloading and memory profilers pack every saved tensor, M-mode's kept output too."""
    model = _pair()
    packed: list[tuple[int, ...]] = []

    def pack(t):
        packed.append(tuple(t.shape))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y = _loop(model, _x())
    assert (2, 8, 5, 5) in packed  # the run's output (the block's own tensors are not saved)
    y.square().sum().backward()
    twin = plain_twin(model)
    for p in twin.parameters():
        p.grad = None
    _loop(twin, _x()).square().sum().backward()
    assert_grads_close(grads(model), grads(twin), REL)


def test_in_place_edit_is_caught_under_callers_hooks_too():
    model = _pair()
    with torch.autograd.graph.saved_tensors_hooks(lambda t: t.clone(), lambda t: t):
        y = model[0](_x())
    y.mul_(2)
    with pytest.raises(ReconstructionError, match="modified in place"):
        y.sum().backward()
