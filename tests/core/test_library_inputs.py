"""Wrong inputs to a reversible layer end in a message that names the problem and the fix."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from revtrain.core import ReversibleBlock, ReversibleSequence
from revtrain.errors import ReversibilityError

from .helpers import conv_fn, make_stack


@pytest.mark.parametrize("mode", ["M", "C"])
@pytest.mark.parametrize("build", ["block", "sequence"])
def test_float32_block_on_float64_input(mode, build):
    torch.manual_seed(0)
    model = ReversibleBlock(conv_fn(4), conv_fn(4), mode=mode) if build == "block" else make_stack(2)
    for m in model.modules():
        if isinstance(m, ReversibleBlock):
            m.mode = mode
    x = torch.randn(2, 8, 5, 5, dtype=torch.float64, requires_grad=True)
    with pytest.raises(ReversibilityError, match=r"F has float32 parameters but the block's input is float64.*model.to\(torch.float64\)"):
        model(x)


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.uint8, torch.bool])
@pytest.mark.parametrize("build", ["block", "sequence", "inverse"])
def test_integer_input(dtype, build):
    block = ReversibleBlock(nn.Identity(), nn.Identity())
    call = {"block": block, "sequence": ReversibleSequence(block), "inverse": block.inverse}[build]
    with pytest.raises(ReversibilityError, match=r"floating-point tensors.*nn.Embedding"):
        call(torch.ones(2, 8, dtype=dtype))


def test_not_a_tensor():
    block = ReversibleBlock(nn.Identity(), nn.Identity())
    with pytest.raises(ReversibilityError, match=r"tensor or a pair"):
        block(3.0)
    with pytest.raises(ReversibilityError, match=r"input 2 is a list.*Pass a tensor"):
        block((torch.randn(2, 2), [1.0, 2.0]))


def test_pair_of_three():
    block = ReversibleBlock(nn.Identity(), nn.Identity())
    with pytest.raises(ReversibilityError, match=r"takes \(x1, x2\); got a tuple of 3"):
        block((torch.randn(2, 2),) * 3)
