"""PaReprop-style overlap (``ReversibleSequence(..., overlap_rebuild=True)``): the reordered
schedule (rebuild of block i-1 before block i's gradients) gives results identical to the
sequential one, bit for bit on a CPU, where the second stream is a no-op."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from revtrain.core import ReversibleBlock, ReversibleSequence, set_modes
from revtrain.core import overlap as overlap_module

from .helpers import conv_fn, grads


def _pair(seed: int, depth: int, dropout: float, dtype: torch.dtype) -> tuple[ReversibleSequence, ReversibleSequence]:
    torch.manual_seed(seed)

    def fn() -> nn.Module:
        return nn.Sequential(conv_fn(4), nn.Dropout(dropout))

    sequential = ReversibleSequence([ReversibleBlock(fn(), fn()) for _ in range(depth)]).to(dtype)
    overlapped = copy.deepcopy(sequential)
    overlapped.overlap_rebuild = True
    return sequential, overlapped


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_overlap_gives_identical_results(dtype, monkeypatch):
    calls = []
    original = overlap_module.reverse_overlapped

    def counting(*args, **kwargs):
        calls.append(args[0])
        return original(*args, **kwargs)

    monkeypatch.setattr("revtrain.core.function.reverse_overlapped", counting)
    sequential, overlapped = _pair(0, 5, 0.2, dtype)
    x = torch.randn(3, 8, 6, 6, dtype=dtype)
    results = []
    for model in (sequential, overlapped):
        xi = x.clone().requires_grad_(True)
        torch.manual_seed(1)  # the same dropout masks in both forwards
        out = model(xi)
        out.square().sum().backward()
        rng_after = torch.get_rng_state()
        buffers = {k: v.clone() for k, v in model.state_dict().items()}
        results.append((out.detach(), xi.grad, grads(model), buffers, rng_after))
    assert calls == [5]  # the overlapped schedule ran, over all five blocks; the other did not
    (out_s, dx_s, g_s, b_s, rng_s), (out_o, dx_o, g_o, b_o, rng_o) = results
    assert torch.equal(out_s, out_o) and torch.equal(dx_s, dx_o) and torch.equal(rng_s, rng_o)
    assert g_s.keys() == g_o.keys() and all(torch.equal(g_s[k], g_o[k]) for k in g_s)
    assert all(torch.equal(b_s[k], b_o[k]) for k in b_s)  # running statistics updated once


def test_overlap_matches_plain_autograd_in_float64():
    sequential, overlapped = _pair(2, 4, 0.0, torch.float64)
    plain = copy.deepcopy(overlapped)
    set_modes(plain, "C")
    x = torch.randn(2, 8, 5, 5, dtype=torch.float64)
    for model in (overlapped, plain):
        model(x).square().sum().backward()
    got, want = grads(overlapped), grads(plain)
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-10, atol=1e-12, msg=name)


def test_overlap_with_a_c_mode_block_in_the_middle_and_extra_arguments():
    class Scaled(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv = conv_fn(4)

        def forward(self, x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
            return self.conv(x) * scale

    torch.manual_seed(3)
    model = ReversibleSequence([ReversibleBlock(Scaled(), Scaled()) for _ in range(5)], overlap_rebuild=True)
    model.to(torch.float64)
    model[2].mode = "C"
    plain = copy.deepcopy(model)
    set_modes(plain, "C")
    x = torch.randn(2, 8, 5, 5, dtype=torch.float64)
    scales = []
    for m in (model, plain):
        scale = torch.tensor(0.7, dtype=torch.float64, requires_grad=True)
        m(x, scale).square().sum().backward()
        scales.append(scale.grad)
    torch.testing.assert_close(scales[0], scales[1], rtol=1e-10, atol=0)
    got, want = grads(model), grads(plain)
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-10, atol=1e-12, msg=name)
