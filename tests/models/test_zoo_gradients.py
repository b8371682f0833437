"""Every zoo model trains: forward + backward in M- and C-mode, with M-mode equal to C-mode.

M-mode rebuilds each reversible block's input from its output in backward; C-mode is plain
autograd. On identical weights and input they must give the same output, input gradient,
parameter gradients and batch-norm running statistics.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from revtrain.core import get_modes, set_modes
from revtrain.models import create_model, example_batch, list_models, model_info
from revtrain.models.blocks import PadShortcut
from revtrain.models.revnet_single_branch import NoUpdate

# float64 tolerances. The only difference between the modes is rounding in the rebuilt
# inputs, which compounds over a run of up to 10 consecutive blocks; measured worst case:
# 3e-14 of the largest gradient entry. atol is relative to that largest entry (some
# gradients are zero up to rounding, e.g. the bias of a BN that feeds another BN).
RTOL = 1e-10
ATOL_OF_SCALE = 1e-12



@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """These tensors are tiny: intra-op threads cost more than they save, and oversubscribe
    the cores when test processes run side by side (measured: 5x the CPU time with 2 threads)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


TABLE2_CIFAR = {"resnet32", "resnet110", "resnet164", "revnet38", "revnet110", "revnet164"}


def _input_size(name: str) -> int:
    """The smallest input that leaves every BN more than a few values per channel."""
    if model_info(name).dataset == "ImageNet":
        return 32  # 7x7/2 stem and max-pool: stages at 8, 4, 2, 1 (batch 4: 4 values)
    return 8 if name in TABLE2_CIFAR else 16  # three groups: 8-4-2; four stages: 16-8-4-2


def _run(model, x, weights, mode):
    set_modes(model, mode)
    model.zero_grad(set_to_none=True)
    x = x.clone().requires_grad_(True)
    out = model(x)
    (out * weights).sum().backward()
    grads = {n: p.grad for n, p in model.named_parameters()}
    buffers = {n: b.clone() for n, b in model.named_buffers()}
    return out.detach(), x.grad, grads, buffers


def _assert_close_scaled(actual, expected, what):
    scale = max(t.abs().max().item() for t in expected.values())
    for key in expected:
        torch.testing.assert_close(
            actual[key], expected[key], rtol=RTOL, atol=ATOL_OF_SCALE * scale,
            msg=lambda m, key=key: f"{what} {key}: {m}",
        )


# The convolutional zoo; Transformers (token inputs, fixed patch grids) have their own
# registry-driven tests in test_transformer.py.
CONV_MODELS = [
    n for n in list_models()
    if model_info(n).builder.__module__ not in ("revtrain.models.transformer", "revtrain.models.vit")
]


@pytest.mark.parametrize("name", CONV_MODELS)
def test_forward_backward_and_m_mode_equals_c_mode(name):
    torch.manual_seed(0)
    # The digits' shape (1 channel, small images) with a non-default class count.
    model = create_model(name, num_classes=5, in_channels=1).double().train()
    size = _input_size(name)
    x, _ = example_batch(name, 4, seed=0, input_size=(1, size, size), num_classes=5)  # (4, 1, size, size)
    x = x.double()
    weights = torch.randn(4, 5, dtype=torch.float64)
    initial = {k: v.clone() for k, v in model.state_dict().items()}

    results = {}
    modes = ("C", "M") if model_info(name).reversible else ("C",)
    if not model_info(name).reversible:
        assert get_modes(model) == {}, "a ResNet has no reversible blocks, so no modes"
    for mode in modes:
        model.load_state_dict(initial)
        out, dx, grads, buffers = _run(model, x, weights, mode)
        assert set(get_modes(model).values()) <= {mode}
        assert out.shape == (4, 5) and torch.isfinite(out).all()
        assert torch.isfinite(dx).all() and dx.abs().sum() > 0
        missing = [n for n, g in grads.items() if g is None]
        assert not missing, f"{mode}-mode: no gradient for {missing}"
        bad = [n for n, g in grads.items() if not torch.isfinite(g).all()]
        assert not bad, f"{mode}-mode: non-finite gradient for {bad}"
        results[mode] = out, dx, grads, buffers
    if len(results) == 1:
        return

    (out_c, dx_c, grads_c, buf_c), (out_m, dx_m, grads_m, buf_m) = results["C"], results["M"]
    _assert_close_scaled({"output": out_m}, {"output": out_c}, "M vs C")
    _assert_close_scaled({"input": dx_m}, {"input": dx_c}, "M vs C gradient of")
    _assert_close_scaled(grads_m, grads_c, "M vs C gradient of")
    # The rebuild in backward must not update BN running statistics a second time.
    float_bufs = {k: v for k, v in buf_c.items() if v.is_floating_point()}
    _assert_close_scaled({k: buf_m[k] for k in float_bufs}, float_bufs, "M vs C buffer")
    for key, value in buf_c.items():
        if not value.is_floating_point():  # num_batches_tracked: one forward, counted once
            assert torch.equal(buf_m[key], value), key
            assert value.item() == 1, key


def test_petra_blocks_follow_petra_recurrence():
    """Our alternating one-branch blocks compute PETRA's (x, x~) -> (x~ + F(x), x)."""
    torch.manual_seed(0)
    model = create_model("revnet34", in_channels=1).double().train()
    sequence = model.stages[0].reversible  # 3 reversible blocks, x in the first half
    x = torch.randn(4, 128, 6, 6, dtype=torch.float64)
    set_modes(model, "C")
    with torch.no_grad():
        ours = sequence(x)
        state = x.chunk(2, dim=1)  # PETRA splits the stem's output as (x, x~)
        for block in sequence:
            fn = block.g if isinstance(block.f, NoUpdate) else block.f
            state = (state[1] + fn(state[0]), state[0])
    # Our blocks keep streams in place; after 3 blocks x (the latest) is the second half.
    torch.testing.assert_close(ours, torch.cat([state[1], state[0]], dim=1), rtol=0, atol=0)


@pytest.mark.parametrize("size", range(1, 10))
def test_pad_shortcut_matches_strided_conv_size(size):
    x = torch.randn(2, 4, size, size)
    shortcut = PadShortcut(4, 8, stride=2)(x)
    conv = F.conv2d(x, torch.zeros(8, 4, 3, 3), stride=2, padding=1)
    assert shortcut.shape == conv.shape
    torch.testing.assert_close(shortcut[:, :2], torch.zeros_like(shortcut[:, :2]))
    torch.testing.assert_close(shortcut[:, 6:], torch.zeros_like(shortcut[:, 6:]))
