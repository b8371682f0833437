"""``torch.func.functional_call`` in M-mode: the rebuild runs with the tensors the forward ran with.

Meta-learning and ensembling run one module with substitute parameters (and buffers). The
substitutes are swapped in for the forward only; M-mode's rebuild happens later, in backward,
so it must put them back itself. Transforms that wrap the autograd function (``grad``,
``vmap``) are refused with a clear error, never answered with ``None`` gradients.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch.func import functional_call

from revtrain.core import ReversibleBlock, set_modes
from revtrain.errors import ReversibilityError

from .helpers import conv_fn, make_stack

REL = 1e-10


def _substitutes(model, seed=3, buffers=False):
    g = torch.Generator().manual_seed(seed)
    tensors = {
        name: (p.detach() + 0.1 * torch.randn(p.shape, dtype=p.dtype, generator=g)).requires_grad_(True)
        for name, p in model.named_parameters()
    }
    if buffers:
        for name, b in model.named_buffers():
            if b.is_floating_point():
                tensors[name] = b.detach() + 0.5 + torch.rand(b.shape, dtype=b.dtype, generator=g)
    return tensors


def _grads_through_functional_call(model, mode, tensors, x):
    set_modes(model, mode)
    out = functional_call(model, tensors, (x,))
    wrt = [t for t in tensors.values() if t.requires_grad]
    return out.detach(), torch.autograd.grad(out.square().sum(), wrt)


@pytest.mark.parametrize("train", [True, False])
@pytest.mark.parametrize("with_buffers", [False, True])
def test_functional_call_gradients_equal_c_mode(train, with_buffers):
    torch.manual_seed(0)
    model = make_stack(4).double().train(train)
    twin = copy.deepcopy(model)
    x = torch.randn(3, 8, 5, 5, dtype=torch.float64)
    tensors = _substitutes(model, buffers=with_buffers)
    own = {k: v.clone() for k, v in model.named_parameters()}

    def fresh():  # training-mode norm layers update substituted buffers: one copy per run
        return {k: v if v.requires_grad else v.clone() for k, v in tensors.items()}

    out_m, got = _grads_through_functional_call(model, "M", fresh(), x)
    out_c, want = _grads_through_functional_call(twin, "C", fresh(), x)
    torch.testing.assert_close(out_m, out_c, rtol=REL, atol=1e-12)
    assert len(got) == len(want) > 0
    for a, b in zip(got, want):
        assert a is not None
        torch.testing.assert_close(a, b, rtol=REL, atol=1e-12)
    # the module's own parameters are untouched and got no gradient; its buffers moved (or
    # not) exactly as plain autograd moved them
    assert all(torch.equal(own[k], v) and v.grad is None for k, v in model.named_parameters())
    for (name, a), (_, b) in zip(model.named_buffers(), twin.named_buffers()):
        torch.testing.assert_close(a, b, rtol=REL, atol=REL, msg=name)


def test_functional_call_module_tensors_back_after_backward():
    torch.manual_seed(0)
    block = ReversibleBlock(conv_fn(4), conv_fn(4)).double()
    own = dict(block.named_parameters())
    tensors = _substitutes(block)
    out = functional_call(block, tensors, (torch.randn(2, 8, 4, 4, dtype=torch.float64),))
    out.sum().backward()
    assert all(a is b for a, b in zip(own.values(), dict(block.named_parameters()).values()))
    assert all(t.grad is not None for t in tensors.values())


@pytest.mark.parametrize("transform", ["grad", "vmap"])
def test_torch_func_transforms_are_refused_clearly(transform):
    torch.manual_seed(0)
    # eval mode: torch.func refuses the in-place statistics updates of training-mode norms
    block = ReversibleBlock(conv_fn(4), conv_fn(4)).double().eval()
    x = torch.randn(2, 8, 4, 4, dtype=torch.float64)
    params = {k: v.detach() for k, v in block.named_parameters()}
    if transform == "grad":
        run = lambda: torch.func.grad(lambda p: functional_call(block, p, (x,)).sum())(params)  # noqa: E731
    else:
        run = lambda: torch.func.vmap(lambda xi: block(xi.unsqueeze(0)))(x)  # noqa: E731
    with pytest.raises(ReversibilityError, match=r"torch.func transforms.*C-mode"):
        run()
    set_modes(block, "C")
    run()  # the same call in C-mode works

