"""In-place ABN: M-mode equals C-mode equals BatchNorm2d + LeakyReLU; rebuild, statistics, errors.

Reference throughout: :class:`BatchNormLeakyReLU`, an ``nn.BatchNorm2d`` followed by
``F.leaky_relu`` (plain autograd), loaded with the same state dict.

float64 tolerances: rtol 1e-10, atol 1e-12 of the largest entry. The modes differ only by the
rounding of the rebuilt input and of the closed-form sums; measured worst case 7e-16
of the largest entry (over every case of the first test).
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.func import functional_call

from revtrain.core import reverse_step, set_modes, verify_invertible
from revtrain.core.checks import DEFAULT_EVERY, FIRST_CHECKS
from revtrain.errors import ReversibilityError
from revtrain.layers import ABNRecord, BatchNormLeakyReLU, InPlaceABN

RTOL, ATOL_OF_SCALE = 1e-10, 1e-12
C = 5


def _close(actual, expected, what=""):
    scale = max(float(expected.detach().abs().max()), 1e-300)
    torch.testing.assert_close(actual, expected, rtol=RTOL, atol=ATOL_OF_SCALE * scale, msg=what or None)


def _layer(slope=0.1, seed=0, **kwargs) -> InPlaceABN:
    """A float64 layer with random γ (both signs, |γ| >= 0.3) and β, and non-trivial statistics."""
    g = torch.Generator().manual_seed(seed)
    layer = InPlaceABN(C, slope, **kwargs).double()
    with torch.no_grad():
        sign = torch.where(torch.rand(C, generator=g) < 0.5, -1.0, 1.0).double()
        layer.weight.copy_(sign * (0.3 + torch.rand(C, generator=g, dtype=torch.float64)))
        layer.bias.copy_(torch.randn(C, generator=g, dtype=torch.float64))
        layer.running_mean.copy_(torch.randn(C, generator=g, dtype=torch.float64))
        layer.running_var.copy_(0.5 + torch.rand(C, generator=g, dtype=torch.float64))
    return layer


def _twin(layer: InPlaceABN) -> BatchNormLeakyReLU:
    twin = BatchNormLeakyReLU(C, layer.slope, eps=layer.eps, momentum=layer.momentum).double()
    twin.load_state_dict(layer.state_dict())
    return twin


def _step(module: nn.Module, x: torch.Tensor, weights: torch.Tensor):
    module.zero_grad(set_to_none=True)
    x = x.clone().requires_grad_(True)
    y = module(x)
    (y * weights).sum().backward()
    return {
        "output": y.detach(), "input grad": x.grad, "weight grad": module.weight.grad,
        "bias grad": module.bias.grad, "running_mean": module.running_mean.clone(),
        "running_var": module.running_var.clone(),
    }


@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize("slope", [0.01, 0.2, 3.0])
@pytest.mark.parametrize("closed_form", [True, False], ids=["closed-form", "recompute"])
@pytest.mark.parametrize("shape", [(4, C, 6, 7), (16, C)], ids=["NCHW", "NC"])
def test_m_mode_equals_c_mode_equals_batchnorm_leaky_relu(training, slope, closed_form, shape):
    torch.manual_seed(1)
    x = 2 * torch.randn(*shape, dtype=torch.float64) + 0.5
    weights = torch.randn(*shape, dtype=torch.float64)
    reference = _twin(_layer(slope)).train(training)
    want = _step(reference, x, weights)
    for mode in ("M", "C"):
        layer = _layer(slope, closed_form_backward=closed_form, mode=mode).train(training)
        got = _step(layer, x, weights)
        for key in want:
            _close(got[key], want[key], f"{mode}-mode {key}")
        assert layer.num_batches_tracked.item() == reference.num_batches_tracked.item()


def test_rebuilt_input_matches_the_true_input():
    torch.manual_seed(2)
    for training in (True, False):
        layer = _layer(0.05).train(training)
        x = 3 * torch.randn(8, C, 5, 5, dtype=torch.float64) - 1
        (y,), record = layer.step_forward((x,))
        assert isinstance(record, ABNRecord) and record.batch == training
        assert record.mean.shape == record.invstd.shape == (C,)  # all the rebuild keeps: 2C numbers
        rebuilt = layer.invert(y, record)
        torch.testing.assert_close(rebuilt, x, rtol=1e-13, atol=1e-13)
        result = layer.step_reverse((y,), (None,), record, layer.step_params(), False)
        torch.testing.assert_close(result.inputs[0], x, rtol=1e-13, atol=1e-13)
    layer.eval()  # eval mode: the running statistics suffice, no record needed
    torch.testing.assert_close(layer.inverse(layer(x)), x, rtol=1e-13, atol=1e-13)


@pytest.mark.parametrize("momentum", [0.1, None])
@pytest.mark.parametrize("mode", ["M", "C"])
def test_running_statistics_equal_batchnorm_after_several_steps(momentum, mode):
    layer = _layer(momentum=momentum, mode=mode)
    reference = _twin(layer)
    torch.manual_seed(3)
    for step in range(5):
        x = torch.randn(6, C, 4, 4, dtype=torch.float64) * (step + 1) + step
        for module in (layer, reference):
            module(x.clone().requires_grad_(True)).square().sum().backward()
        # Updated once per step, in the forward: backward's rebuild leaves them alone.
        _close(layer.running_mean, reference.running_mean, "running_mean")
        _close(layer.running_var, reference.running_var, "running_var")
        assert layer.num_batches_tracked.item() == reference.num_batches_tracked.item() == step + 1


@pytest.mark.parametrize("closed_form", [True, False], ids=["closed-form", "recompute"])
@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
def test_gradcheck_m_mode(closed_form, training):
    layer = _layer(0.1, closed_form_backward=closed_form).train(training)
    x = torch.randn(3, C, 2, 3, dtype=torch.float64, requires_grad=True)
    w = layer.weight.detach().clone().requires_grad_(True)
    b = layer.bias.detach().clone().requires_grad_(True)

    def fn(x, w, b):
        return functional_call(layer, {"weight": w, "bias": b}, (x,))

    assert torch.autograd.gradcheck(fn, (x, w, b))


def test_reverse_step_with_the_forward_record_equals_autograd():
    """The public rebuild step (what a PETRA stage calls) on an In-place ABN layer."""
    layer = _layer(0.1)
    reference = _twin(layer)
    x = torch.randn(4, C, 3, 3, dtype=torch.float64)
    dy = torch.randn(4, C, 3, 3, dtype=torch.float64)
    (y,), record = layer.step_forward((x,))
    rebuilt, dx = reverse_step(layer, y, dy, record=record)
    xr = x.clone().requires_grad_(True)
    reference(xr).backward(dy)
    _close(rebuilt, x)
    _close(dx, xr.grad)
    _close(layer.weight.grad, reference.weight.grad)
    _close(layer.bias.grad, reference.bias.grad)
    with pytest.raises(ReversibilityError, match="record"):
        reverse_step(layer, y, dy)  # without the batch statistics nothing can be rebuilt


def test_verify_invertible_on_a_model_with_in_place_abn():
    torch.manual_seed(4)
    model = nn.Sequential(
        nn.Conv2d(3, C, 3, padding=1), InPlaceABN(C), nn.Conv2d(C, C, 3, padding=1), InPlaceABN(C, 0.2),
    ).double()
    x = torch.randn(4, 3, 6, 6, dtype=torch.float64)
    state = copy.deepcopy(model.state_dict())
    report = verify_invertible(model, x)
    assert report.ok and [c.name for c in report.checks] == ["1", "3"]
    assert max(c.rel_error for c in report.checks) < 1e-13
    for key, value in model.state_dict().items():  # statistics left as they were
        assert torch.equal(value, state[key]), key
    set_modes(model, "C")
    assert verify_invertible(model, x).ok  # verification rebuilds whatever the mode


def test_zero_gamma_is_refused_in_m_mode_with_the_channels_named():
    layer = _layer()
    with torch.no_grad():
        layer.weight[2] = 0.0
        layer.weight[4] = 1e-6
    x = torch.randn(4, C, 3, 3, dtype=torch.float64, requires_grad=True)
    before = layer.running_mean.clone()
    with pytest.raises(ReversibilityError, match=r"min_weight=0.0001 in channel\(s\) 2 \(γ=0\), 4"):
        layer(x)
    assert torch.equal(layer.running_mean, before)  # refused before any work
    with torch.no_grad():
        layer.weight[2] = float("nan")
    with pytest.raises(ReversibilityError, match="channel"):
        layer(x)
    with torch.no_grad():
        layer.weight[2] = 0.0
    layer.mode = "C"  # nothing is inverted in C-mode: plain batch norm accepts γ = 0
    reference = _twin(layer)
    _close(layer(x), reference(x))
    layer.min_weight = 0.0
    layer.mode = "M"  # with the check off, γ = 0 gives a non-finite rebuild, caught in backward
    from revtrain.errors import ReconstructionError

    with pytest.raises(ReconstructionError, match="non-finite"):
        layer(x).sum().backward()


@pytest.mark.parametrize("settings, checked", [({}, FIRST_CHECKS + 2), ({"check_every": 1}, 105),
                                               ({"check_reconstruction": False}, 0)])
def test_the_gamma_check_is_sampled_like_the_rebuild_check(monkeypatch, settings, checked):
    """The γ check costs a device sync, so M-mode training steps run it on the calls the rebuild
    check's schedule samples (105 calls: the first FIRST_CHECKS, then calls 54 and 104), on
    every call with ``check_every=1``, never with the checks off."""
    import revtrain.layers.inplace_abn as abn

    count = [0]
    real = abn._check_weight

    def counted(weight, min_weight):
        count[0] += 1
        real(weight, min_weight)

    monkeypatch.setattr(abn, "_check_weight", counted)
    layer = _layer()
    for name, value in settings.items():
        setattr(layer, name, value)
    x = torch.randn(4, C, 3, 3, dtype=torch.float64, requires_grad=True)
    for _ in range(105):
        layer(x).sum().backward()
    assert count[0] == checked


def test_outside_a_training_step_every_call_checks_gamma():
    """A direct ``step_forward`` (what PETRA stages and ``verify_invertible`` call) checks γ on
    every call, sampled or not; ``verify_invertible`` reports the layer's failure."""
    layer = _layer()
    x = torch.randn(4, C, 3, 3, dtype=torch.float64, requires_grad=True)
    for _ in range(FIRST_CHECKS + 1):  # the next training step is not sampled
        layer(x).sum().backward()
    with torch.no_grad():
        layer.weight[1] = 0.0
    with pytest.raises(ReversibilityError, match=r"channel\(s\) 1 \(γ=0\)"):
        layer.step_forward((x.detach(),))
    with pytest.raises(ReversibilityError, match=r"channel\(s\) 1 \(γ=0\)"):
        verify_invertible(nn.Sequential(layer), x.detach())
    layer(x).sum().backward()  # an unsampled training step does not check (docs/layers.md)
    assert not torch.isfinite(layer.weight.grad).all()
    layer.min_weight = 0.0  # γ = 0 let through: the non-finite rebuild is a failed verification
    assert not verify_invertible(nn.Sequential(layer), x.detach(), raise_on_failure=False).ok


def test_a_gamma_that_reaches_zero_late_is_refused_within_the_sampling_period():
    """γ set to 0 after 200 calls is refused by call 200 + DEFAULT_EVERY, naming the channel."""
    layer = _layer()
    x = torch.randn(4, C, 3, 3, dtype=torch.float64, requires_grad=True)
    for _ in range(200):
        layer(x).sum().backward()
    with torch.no_grad():
        layer.weight[3] = 0.0
    for call in range(DEFAULT_EVERY):
        try:
            layer(x)  # the forward alone: the refusal comes before any work
        except ReversibilityError as err:
            assert r"channel(s) 3 (γ=0)" in str(err)
            break
    else:
        pytest.fail(f"γ = 0 not refused within {DEFAULT_EVERY} calls")


@pytest.mark.parametrize("slope", [0.0, -0.1, float("nan"), float("inf")])
def test_non_positive_slope_is_refused(slope):
    with pytest.raises(ReversibilityError, match="slope must be a finite number > 0"):
        InPlaceABN(C, slope)
    with pytest.raises(ReversibilityError, match="slope"):
        BatchNormLeakyReLU(C, slope)


def test_bad_shapes_and_settings_are_refused():
    layer = InPlaceABN(C)
    with pytest.raises(ValueError, match=r"expects input \(N, 5, \.\.\.\), got shape \(2, 4, 3, 3\)"):
        layer(torch.randn(2, 4, 3, 3, requires_grad=True))
    with pytest.raises(ValueError, match="more than one value per channel"):
        layer(torch.randn(1, C, 1, 1, requires_grad=True))
    with pytest.raises(ValueError, match="min_weight"):
        InPlaceABN(C, min_weight=-1.0)
    with pytest.raises(ValueError, match="momentum"):
        InPlaceABN(C, momentum=2.0)
    with pytest.raises(ValueError, match="num_features"):
        InPlaceABN(0)
    layer.train()
    with pytest.raises(ReversibilityError, match="invert"):
        layer.inverse(torch.randn(2, C))  # training statistics are not in the output


def test_autocast_bf16_adds_less_error_than_autocast_itself():
    """Under CPU autocast the convolution before the layer yields bfloat16; the layer runs in
    bfloat16 (batch norm is not an autocast op: torch runs it in its input's dtype, with float32
    statistics), M-mode keeps a bfloat16 output and rebuilds the input from it (in float32,
    rounded to bfloat16), then runs batch norm's backward kernel as C-mode does.

    M-mode's gradients then differ from C-mode's by the bfloat16 rounding of the stored output
    (measured over 3 seeds: 1e-3 to 9e-3 relative; dβ equal), well below what bfloat16 autocast costs
    C-mode itself against float32 (1e-2 to 4e-2)."""
    torch.manual_seed(0)
    conv = nn.Conv2d(3, C, 3, padding=1, bias=False)
    layer = InPlaceABN(C, 0.1)
    with torch.no_grad():
        layer.weight.uniform_(0.5, 1.5)
        layer.bias.normal_()
    x, weights = torch.randn(8, 3, 8, 8), torch.randn(8, C, 8, 8)

    def run(mode, dtype):
        layer.mode = mode
        for m in (conv, layer):
            m.zero_grad(set_to_none=True)
        xr = x.clone().requires_grad_(True)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == torch.bfloat16):
            y = layer(conv(xr))
        assert y.dtype == dtype
        (y.float() * weights).sum().backward()
        assert layer.weight.grad.dtype == torch.float32
        return y.detach().float(), [xr.grad, conv.weight.grad.clone(), layer.weight.grad.clone(),
                                    layer.bias.grad.clone()]

    y_m, grads_m = run("M", torch.bfloat16)
    y_c, grads_c = run("C", torch.bfloat16)
    _, grads_fp32 = run("C", torch.float32)
    torch.testing.assert_close(y_m, y_c, rtol=0, atol=0)  # the same forward
    for m, c, exact in zip(grads_m, grads_c, grads_fp32):
        m_vs_c = float((m - c).norm() / c.norm())
        c_vs_fp32 = float((c - exact).norm() / exact.norm())
        assert m_vs_c < 1e-2 and m_vs_c < 0.5 * c_vs_fp32, (m_vs_c, c_vs_fp32)
