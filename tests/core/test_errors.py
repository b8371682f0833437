"""Bad input ends in an error that names the problem and the fix, never a wrong gradient."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from revtrain.core import (
    Coupling,
    ReversibleBlock,
    ReversibleSequence,
    set_modes,
    verify_invertible,
)
from revtrain.errors import (
    NotInvertibleError,
    ReconstructionDriftWarning,
    ReconstructionError,
    ReversibilityError,
)

from .helpers import conv_fn, make_stack


def test_odd_split_size():
    block = ReversibleBlock(nn.Identity(), nn.Identity())
    with pytest.raises(ReversibilityError, match=r"size 5.*even size.*pair"):
        block(torch.randn(2, 5, 3, 3))


def test_f_output_shape_differs_additive():
    block = ReversibleBlock(nn.Conv2d(4, 6, 3, padding=1), conv_fn(4))
    with pytest.raises(ReversibilityError, match=r"F returned a tensor of shape \(2, 6, 5, 5\).*C/2 channels"):
        block(torch.randn(2, 8, 5, 5, requires_grad=True))


def test_g_output_shape_differs_spatially():
    block = ReversibleBlock(conv_fn(4), nn.Conv2d(4, 4, 3))  # no padding: 5x5 -> 3x3
    block.mode = "C"
    with pytest.raises(ReversibilityError, match=r"G returned.*padding='same'"):
        block(torch.randn(2, 8, 5, 5))


def test_affine_needs_twice_the_channels():
    block = ReversibleBlock(conv_fn(4), conv_fn(4), coupling="affine")
    with pytest.raises(ReversibilityError, match=r"affine coupling needs shape \(2, 8, 5, 5\).*\(s, t\)"):
        block(torch.randn(2, 8, 5, 5))


def test_output_modified_in_place_before_backward():
    model = make_stack(3)
    y = model(torch.randn(2, 8, 5, 5, requires_grad=True))
    y.mul_(2)
    with pytest.raises(ReconstructionError, match=r"modified in place.*out-of-place"):
        y.sum().backward()


def test_f_modifying_its_input_in_place():
    f = nn.Sequential(nn.ReLU(inplace=True), nn.Conv2d(4, 4, 3, padding=1))
    block = ReversibleBlock(f, conv_fn(4))
    with pytest.raises(ReversibilityError, match=r"F modified its input in place.*inplace=True"):
        block(torch.randn(2, 8, 5, 5))


class MultiplyCoupling(Coupling):
    """A user coupling y = x * h: invertible only where h != 0."""

    name = "multiply"

    def forward(self, x, h):
        return x * h

    def inverse(self, y, h):
        return y / h


def test_non_finite_reconstruction_raises():
    # ReLU makes F's output exactly 0 in places: the forward is finite, the inverse divides by 0.
    block = ReversibleBlock(nn.ReLU(), nn.Sigmoid(), coupling=MultiplyCoupling())
    x = torch.randn(4, 8, 3, 3, requires_grad=True)
    y = block(x)
    assert torch.isfinite(y).all()
    with pytest.raises(ReconstructionError, match=r"non-finite values.*C-mode"):
        y.sum().backward()


class Drifting(nn.Module):
    """A function that is not the same in backward as in forward (a hidden counter)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        return torch.tanh(x) + 0.1 * self.calls


def test_drift_warns_by_default_and_raises_when_opted_in():
    block = ReversibleBlock(Drifting(), nn.Tanh())
    with pytest.warns(ReconstructionDriftWarning, match=r"drifted.*drift_tolerance"):
        block(torch.randn(2, 8, requires_grad=True)).sum().backward()
    strict = ReversibleBlock(Drifting(), nn.Tanh(), drift_action="raise")
    with pytest.raises(ReconstructionError, match="drifted"):
        strict(torch.randn(2, 8, requires_grad=True)).sum().backward()


@pytest.mark.parametrize(
    "x2,match",
    [
        (torch.randn(2, 4, dtype=torch.float64), r"float32 on cpu, x2 is torch.float64"),
        pytest.param(None, r"cuda", marks=pytest.mark.gpu),
    ],
)
def test_mixed_dtypes_or_devices_between_halves(x2, match):
    if x2 is None:
        if not torch.cuda.is_available():
            pytest.skip("needs CUDA")
        x2 = torch.randn(2, 4, device="cuda")
    block = ReversibleBlock(nn.Linear(4, 4), nn.Linear(4, 4))
    with pytest.raises(ReversibilityError, match=match):
        block((torch.randn(2, 4), x2))


def test_unknown_mode_and_unknown_block_names():
    model = make_stack(2)
    with pytest.raises(ValueError, match=r"unknown mode 'X'.*'M'.*'C'"):
        set_modes(model, "X")
    with pytest.raises(ValueError, match=r"not in this model: blocks\.7.*another model"):
        set_modes(model, {"blocks.7": "C"})
    assert all(b.mode == "M" for b in model)  # nothing changed by the failed call


def test_sequence_rejects_ordinary_layers():
    with pytest.raises(TypeError, match=r"item 1 is a Linear.*nn.Sequential"):
        ReversibleSequence(ReversibleBlock(nn.Identity(), nn.Identity()), nn.Linear(2, 2))


def test_unknown_coupling_name():
    with pytest.raises(ValueError, match=r"unknown coupling 'multiplicative'"):
        ReversibleBlock(nn.Identity(), nn.Identity(), coupling="multiplicative")


class WrongInverse(Coupling):
    name = "wrong"

    def forward(self, x, h):
        return x + h

    def inverse(self, y, h):
        return y + h  # sign error: not the inverse


def test_verify_invertible_reports_and_fails_clearly():
    torch.manual_seed(0)
    good = make_stack(3).double()
    report = verify_invertible(good, torch.randn(2, 8, 5, 5, dtype=torch.float64))
    assert report.ok and len(report.checks) == 3
    assert max(c.rel_error for c in report.checks) < 1e-12

    bad = nn.Sequential(
        make_stack(1),
        ReversibleSequence(ReversibleBlock(conv_fn(4), conv_fn(4), coupling=WrongInverse())),
    )
    with pytest.raises(NotInvertibleError, match=r"(?s)1 of 2 reversible blocks.*1\.blocks\.0.*NO"):
        verify_invertible(bad, torch.randn(2, 8, 5, 5))


def test_verify_invertible_replays_dropout_and_keeps_state():
    torch.manual_seed(0)

    def fn():
        return nn.Sequential(nn.Conv2d(4, 4, 3, padding=1, bias=False), nn.BatchNorm2d(4), nn.Dropout(0.3))

    model = ReversibleSequence([ReversibleBlock(fn(), fn()) for _ in range(3)]).double()
    x = torch.randn(2, 8, 5, 5, dtype=torch.float64)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    rng = torch.get_rng_state()
    report = verify_invertible(model, x)
    assert report.ok
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert torch.equal(rng, torch.get_rng_state())


def test_double_backward_is_refused_clearly():
    model = make_stack(2).double()
    x = torch.randn(2, 8, 5, 5, dtype=torch.float64, requires_grad=True)
    with pytest.raises(ReconstructionError, match=r"create_graph=True.*C-mode"):
        torch.autograd.grad(model(x).square().sum(), x, create_graph=True)
    set_modes(model, "C")
    (gx,) = torch.autograd.grad(model(x).square().sum(), x, create_graph=True)
    assert gx.requires_grad


def test_incomplete_user_coupling_fails_at_construction():
    class OnlyForward(Coupling):
        def forward(self, x, h):
            return x + h

    with pytest.raises(TypeError, match="inverse"):
        OnlyForward()
