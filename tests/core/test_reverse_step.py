"""The public rebuild step and the generic Invertible base, against plain autograd."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from revtrain import verify_invertible
from revtrain.core.function import _ReversibleRun, run_spec
from revtrain.core import Invertible, ReversibleBlock, get_modes, reverse_step, set_modes
from tests.core.helpers import assert_grads_close, grads, make_stack, plain_twin

F64_REL = 1e-10  # float64: rebuild rounding only


def _stats(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in model.state_dict().items() if "running" in k or "num_batches" in k}


@pytest.mark.parametrize("coupling", ["additive", "affine"])
def test_reverse_step_of_a_sequence_equals_autograd(coupling):
    """What a PETRA stage does: forward without a graph, then rebuild + backprop from (y, dy)."""
    torch.manual_seed(0)
    seq = make_stack(3, coupling).double()
    twin = plain_twin(seq)
    x = torch.randn(2, 8, 5, 5, dtype=torch.float64)
    dy = torch.randn(2, 8, 5, 5, dtype=torch.float64)
    with torch.no_grad():
        y = seq(x)
    xr = x.clone().requires_grad_()
    y_ref = twin(xr)
    y_ref.backward(dy)
    x_rebuilt, dx = reverse_step(seq, y, dy)
    torch.testing.assert_close(y, y_ref.detach(), rtol=F64_REL, atol=F64_REL)
    torch.testing.assert_close(x_rebuilt, x, rtol=F64_REL, atol=F64_REL)
    torch.testing.assert_close(dx, xr.grad, rtol=F64_REL, atol=F64_REL)
    assert_grads_close(grads(seq), grads(twin), F64_REL)


def test_reverse_step_accumulates_like_backward_and_can_only_return():
    torch.manual_seed(1)
    block = ReversibleBlock(nn.Linear(3, 3), nn.Sequential(nn.Linear(3, 3), nn.Tanh())).double()
    x = torch.randn(4, 6, dtype=torch.float64)
    dy = torch.randn(4, 6, dtype=torch.float64)
    with torch.no_grad():
        y = block(x)
    reverse_step(block, y, dy)
    once = grads(block)
    reverse_step(block, y, dy)
    for name, g in grads(block).items():
        torch.testing.assert_close(g, 2 * once[name], rtol=1e-12, atol=1e-12)
    block.zero_grad(set_to_none=True)
    reverse_step(block, y, dy, accumulate=False)
    assert all(p.grad is None for p in block.parameters())


def test_reverse_step_on_pairs_and_running_statistics():
    torch.manual_seed(2)
    seq = make_stack(2).double()
    x1, x2 = torch.randn(2, 4, 5, 5, dtype=torch.float64), torch.randn(2, 4, 5, 5, dtype=torch.float64)
    with torch.no_grad():
        y1, y2 = seq((x1, x2))
    after_forward = _stats(seq)
    (r1, r2), (d1, d2) = reverse_step(seq, (y1, y2), (torch.ones_like(y1), None))
    torch.testing.assert_close((r1, r2), (x1, x2), rtol=F64_REL, atol=F64_REL)
    assert d1 is not None and d2 is not None
    for k, v in _stats(seq).items():  # default: the rebuild leaves statistics alone
        torch.testing.assert_close(v, after_forward[k], rtol=0, atol=0)
    reverse_step(seq, (y1, y2), (torch.ones_like(y1), torch.ones_like(y2)), update_running_stats=True)
    counts = [int(v) for k, v in _stats(seq).items() if k.endswith("num_batches_tracked")]
    assert counts and all(c == 2 for c in counts)  # forward once + rebuild once


class Scale(Invertible):
    """A per-channel scaling with a learnable log-scale: the smallest invertible layer."""

    def __init__(self, channels: int, **kwargs) -> None:
        super().__init__(**kwargs)
        self.log_s = nn.Parameter(torch.randn(channels, 1, 1) * 0.1)
        self.calls = 0

    def forward_state(self, xs):
        self.calls += 1
        (x,) = xs
        return (nn.functional.dropout(x, 0.2, self.training) * self.log_s.exp(),)

    def inverse_state(self, ys):
        (y,) = ys
        return (y * (-self.log_s).exp(),)


class NotInvertible(Scale):
    def inverse_state(self, ys):
        return (ys[0] * 2,)


def _net(layer: nn.Module) -> nn.Module:
    return nn.Sequential(nn.Conv2d(2, 4, 1), layer, nn.Conv2d(4, 3, 1)).double()


def test_generic_invertible_m_mode_equals_c_mode_and_is_found_by_modes():
    torch.manual_seed(3)
    model = _net(Scale(4).eval())  # eval: dropout off, so the layer is exactly invertible
    assert get_modes(model) == {"1": "M"}
    twin = copy.deepcopy(model)
    set_modes(twin, {"1": "C"})
    x = torch.randn(3, 2, 5, 5, dtype=torch.float64)
    model(x).square().sum().backward()
    twin(x).square().sum().backward()
    assert_grads_close(grads(model), grads(twin), F64_REL)
    report = verify_invertible(model, x)
    assert report.ok and report.checks[0].name == "1"


def test_generic_invertible_replays_dropout_and_runs_forward_twice():
    torch.manual_seed(4)
    layer = Scale(4, drift_action="raise")
    model = _net(layer)
    twin = copy.deepcopy(model)
    set_modes(twin, "C")
    x = torch.randn(3, 2, 5, 5, dtype=torch.float64)
    # Dropout zeroes entries, so the inverse cannot rebuild them: the rebuild check must say so.
    with pytest.raises(Exception, match="drifted"):
        torch.manual_seed(5)
        model(x).sum().backward()
    layer.calls = 0
    model.eval(), twin.eval()
    model(x).sum().backward()
    assert layer.calls == 2  # forward once, and once more in backward to build the graph


def test_gradcheck_through_a_generic_invertible():
    torch.manual_seed(6)
    layers = (Scale(3).double().eval(), Scale(3).double().eval())
    params = tuple(layer.step_params() for layer in layers)
    x = torch.randn(2, 3, 2, 2, dtype=torch.float64, requires_grad=True)

    def fn(t, *ps):  # gradcheck perturbs the parameters in place; the layers read them
        return _ReversibleRun.apply(run_spec(layers, 1), t, *ps)

    assert torch.autograd.gradcheck(fn, (x, *(p for plist in params for p in plist)), eps=1e-6, atol=1e-8)


def test_verify_reports_a_layer_whose_inverse_is_wrong():
    model = _net(NotInvertible(4).eval())
    report = verify_invertible(model, torch.randn(2, 2, 3, 3, dtype=torch.float64), raise_on_failure=False)
    assert not report.ok and report.failures[0].name == "1"


def test_the_rebuilt_input_is_detached_whatever_the_coupling_inverse_returns():
    """The rebuild runs the coupling's inverse on backward's leaf for the output half without
    detaching it first; an inverse that hands that tensor back (here: when ``h`` is all zero)
    or builds a graph anyway must still leave a rebuilt input without a graph."""
    from revtrain.core import Coupling

    class Passthrough(Coupling):
        name = "passthrough-when-zero"

        def forward(self, x, h):
            return x + h

        def inverse(self, y, h):
            return y if not h.any() else y - h

    class GradInverse(Coupling):
        name = "grad-inverse"

        def forward(self, x, h):
            return x + h

        def inverse(self, y, h):
            with torch.enable_grad():
                return y - h

    for coupling in (Passthrough(), GradInverse()):
        torch.manual_seed(0)
        zero = nn.Conv2d(2, 2, 3, padding=1, bias=False)
        nn.init.zeros_(zero.weight)  # F(x2) = 0: the pass-through case
        block = ReversibleBlock(zero, nn.Conv2d(2, 2, 3, padding=1, bias=False), coupling=coupling).double()
        x = torch.randn(2, 4, 5, 5, dtype=torch.float64)
        with torch.no_grad():
            y = block(x)
        x_rebuilt, dx = reverse_step(block, y, torch.ones_like(y))
        assert not x_rebuilt.requires_grad and x_rebuilt.grad_fn is None, coupling.name
        torch.testing.assert_close(x_rebuilt, x, rtol=F64_REL, atol=F64_REL)
