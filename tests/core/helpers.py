"""Shared builders and comparisons for the core tests."""

from __future__ import annotations

import copy

import torch
from torch import nn

from revtrain.core import ReversibleBlock, ReversibleSequence, set_modes


def conv_fn(channels: int, out_mult: int = 1, final: type[nn.Module] = nn.Tanh) -> nn.Module:
    """Conv3x3 + BatchNorm + activation on one half; bias-free as in RevNet."""
    return nn.Sequential(
        nn.Conv2d(channels, channels * out_mult, 3, padding=1, bias=False),
        nn.BatchNorm2d(channels * out_mult),
        final(),
    )


def make_stack(depth: int, coupling: str = "additive", half: int = 4, **block_kwargs) -> ReversibleSequence:
    mult = 2 if coupling == "affine" else 1
    return ReversibleSequence(
        [
            ReversibleBlock(conv_fn(half, mult), conv_fn(half, mult), coupling=coupling, **block_kwargs)
            for _ in range(depth)
        ]
    )


def plain_twin(model: nn.Module) -> nn.Module:
    """The same model with the same weights, every block in C-mode (plain autograd)."""
    twin = copy.deepcopy(model)
    set_modes(twin, "C")
    return twin


def grads(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def assert_grads_close(got: dict, want: dict, rel: float) -> None:
    """Every gradient equal within ``rel`` of the largest gradient entry of the reference.

    Scaling the absolute tolerance by the global gradient scale (not per entry) is what
    "relative error" means for entries whose exact value is 0 (e.g. a conv bias before BN).
    """
    assert got.keys() == want.keys(), (sorted(got), sorted(want))
    scale = max(float(g.abs().max()) for g in want.values())
    assert scale > 0
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=rel, atol=rel * scale, msg=name)
