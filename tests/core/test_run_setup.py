"""What an M-mode run sets up per layer in every forward: the random generators are captured by
the author's flag (``preserve_rng_state``), counted, and replayed only where ``F`` or ``G`` moved
them, exactly; the parameters come from the walk that finds the tensors."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import revtrain.core.block as block_module
from revtrain.core import AdditiveCoupling, ReversibleBlock, ReversibleSequence, set_modes
from revtrain.models import create_model

from .helpers import assert_grads_close, grads, plain_twin


class Noise(nn.Module):
    """Adds Gaussian noise: draws random numbers in its own forward, with no word about it."""

    def forward(self, x):
        return x + 0.1 * torch.randn_like(x)


def _fn(*extra: nn.Module) -> nn.Module:
    return nn.Sequential(nn.Conv2d(4, 4, 3, padding=1, bias=False), nn.BatchNorm2d(4), nn.ReLU(), *extra)


def _stack(f_extra=(), g_extra=(), coupling="additive", depth=3, **kwargs) -> ReversibleSequence:
    torch.manual_seed(0)
    return ReversibleSequence([
        ReversibleBlock(_fn(*[type(m)() for m in f_extra]), _fn(*[type(m)() for m in g_extra]), coupling=coupling,
                        **kwargs)
        for _ in range(depth)
    ])


def _captures(model: nn.Module, x: torch.Tensor, monkeypatch) -> int:
    """Generator captures in one M-mode forward (and the backward, which must take none)."""
    count = [0]
    real = block_module.RngState.capture

    def counted(device):
        count[0] += 1
        return real(device)

    monkeypatch.setattr(block_module.RngState, "capture", counted)
    model(x.clone().requires_grad_(True)).square().sum().backward()
    monkeypatch.setattr(block_module.RngState, "capture", real)
    return count[0]


def _replays(model: nn.Module, x: torch.Tensor, monkeypatch) -> int:
    """Generator replays in one M-mode backward."""
    count = [0]
    real = block_module.RngState.replay

    def counted(self):
        count[0] += 1
        return real(self)

    monkeypatch.setattr(block_module.RngState, "replay", counted)
    model(x.clone().requires_grad_(True)).square().sum().backward()
    monkeypatch.setattr(block_module.RngState, "replay", real)
    return count[0]


X = torch.randn(2, 8, 5, 5)


def _assert_same_as_plain(model: nn.Module, twin: nn.Module, x: torch.Tensor, seed: int, call=None) -> None:
    """One step of ``model`` and of its C-mode ``twin`` on ``x`` from the same generator state
    (``call(m, x)``, default ``m(x)``): equal input and parameter gradients, in float64."""
    input_grads = []
    for m in (model, twin):
        torch.manual_seed(seed)
        xi = x.clone().requires_grad_(True)
        (m(xi) if call is None else call(m, xi)).square().sum().backward()
        input_grads.append(xi.grad)
    torch.testing.assert_close(input_grads[0], input_grads[1], rtol=1e-10, atol=1e-12)
    assert_grads_close(grads(model), grads(twin), 1e-10)


@pytest.mark.parametrize("preserve", [True, False])
def test_a_block_captures_by_its_flag(monkeypatch, preserve):
    """Three captures per block (before F, before G, after G) where the author leaves
    ``preserve_rng_state`` on, whatever F and G are; none where it is off."""
    assert _captures(_stack(preserve_rng_state=preserve), X, monkeypatch) == (9 if preserve else 0)


@pytest.mark.parametrize("f_extra, g_extra, replays", [((), (), 0), ((nn.Dropout(),), (), 3),
                                                       ((Noise(),), (Noise(),), 6)])
def test_only_what_moved_the_generators_is_replayed(monkeypatch, f_extra, g_extra, replays):
    """The dynamic skip: where F or G drew no random numbers in the forward, the rebuild
    replays nothing for it."""
    assert _replays(_stack(f_extra, g_extra), X, monkeypatch) == replays


def test_the_zoo_revnet_captures_nothing(monkeypatch):
    torch.manual_seed(0)
    model = create_model("revnet38", in_channels=1, num_classes=10)
    assert _captures(model, torch.randn(2, 1, 8, 8), monkeypatch) == 0


@pytest.mark.parametrize("extra", [(Noise(),), (nn.Dropout(0.5),)])
def test_modules_that_draw_are_replayed_exactly(extra):
    """Where a module below may draw, the rebuild replays it: M-mode gradients equal plain
    autograd's from the same seed, in float64."""
    model = _stack(f_extra=extra, g_extra=extra, depth=4).double()
    assert all(block.preserve_rng_state for block in model)  # the default
    _assert_same_as_plain(model, plain_twin(model), torch.randn(2, 8, 5, 5, dtype=torch.float64), seed=11)


# -- a run differentiates with respect to each layer's step_params --


def _tied_block() -> ReversibleBlock:
    torch.manual_seed(0)
    f, g = _fn(), _fn()
    g[0].weight = f[0].weight  # shared: counted once
    g[1].weight.requires_grad_(False)  # frozen: not a parameter of the step (3 + 1 left)
    return ReversibleBlock(f, g)


def test_the_runs_parameters_are_the_layers_step_params_in_order():
    from revtrain.core.function import run_spec

    block = _tied_block()
    layers = [block, block.inverse_step()]
    spec = run_spec(layers, 2)
    for layer, params in zip(layers, spec.param_lists):
        want = layer.step_params()
        assert len(params) == len(want) == 4 and all(a is b for a, b in zip(params, want))


def test_a_layer_that_overrides_step_params_is_asked():
    from revtrain.core.function import run_spec

    class OnlyF(ReversibleBlock):
        def step_params(self):
            return list(self.f.parameters())

    torch.manual_seed(0)
    block = OnlyF(_fn(), _fn())
    (params,) = run_spec([block], 2).param_lists
    assert [id(p) for p in params] == [id(p) for p in block.f.parameters()]


def test_tied_and_frozen_parameters_get_plain_autograds_gradients():
    model = ReversibleSequence([_tied_block(), _tied_block()]).double()
    twin = plain_twin(model)
    x = torch.randn(2, 8, 5, 5, dtype=torch.float64)
    for m in (model, twin):
        m(x.clone().requires_grad_(True)).square().sum().backward()
    assert_grads_close(grads(model), grads(twin), 1e-10)


# -- what a review found: instance forwards, overridden calls, the inverse, extra parameters --


def _dropout_forward(module: nn.Module) -> nn.Module:
    """Replace the instance's forward (as a monkeypatch or accelerate's hooks do) with one that
    adds dropout to the class's."""
    cls_forward = type(module).forward
    module.forward = lambda x: torch.nn.functional.dropout(cls_forward(module, x), 0.5, True)
    return module


def test_a_forward_set_on_the_instance_replays_exactly(monkeypatch):
    model = _stack(depth=2).double()
    for block in model:
        _dropout_forward(block.f[0])
    twin = plain_twin(model)
    for block in twin:  # deepcopy keeps the instance forward bound to the original: set again
        _dropout_forward(block.f[0])
    assert _captures(model, X.double(), monkeypatch) == 6
    model.zero_grad(set_to_none=True)
    _assert_same_as_plain(model, twin, torch.randn(2, 8, 5, 5, dtype=torch.float64), seed=3)


def test_the_inverse_of_a_block_with_dropout_replays_exactly():
    """``block.inverse`` in M-mode keeps only its output and rebuilds through the block's
    forward: with dropout in F and G that rebuild must replay the generators too."""
    torch.manual_seed(0)
    block = ReversibleBlock(_fn(nn.Dropout(0.3)), _fn(nn.Dropout(0.3))).double()
    y = torch.randn(2, 8, 5, 5, dtype=torch.float64)
    _assert_same_as_plain(block, plain_twin(block), y, seed=5, call=lambda b, yi: b.inverse(yi))


def test_a_parameter_of_a_block_subclass_used_by_f_gets_its_gradient():
    """``ReversibleBlock.step_params`` is every trainable parameter below the block (not only
    F's and G's): a gate the subclass holds and F reads gets plain autograd's gradient in
    M-mode (before, it got none)."""

    class Gated(nn.Module):
        def __init__(self, owner_gate):
            super().__init__()
            self.conv = nn.Conv2d(4, 4, 3, padding=1, bias=False)
            self.gate = owner_gate

        def forward(self, x):
            return self.conv(x) * self.gate()

    class GatedBlock(ReversibleBlock):
        def __init__(self):
            gate = nn.Parameter(torch.tensor(0.7))
            super().__init__(Gated(lambda: self.gate), _fn())
            self.gate = gate

    def build(mode):
        torch.manual_seed(0)
        model = ReversibleSequence([GatedBlock(), GatedBlock()]).double()
        set_modes(model, mode)
        return model

    # Built twice from one seed, not copied: F reads the gate through its own block.
    model, twin = build("M"), build("C")
    _assert_same_as_plain(model, twin, torch.randn(2, 8, 5, 5, dtype=torch.float64), seed=1)
    assert model[0].gate.grad is not None


def test_an_instance_override_of_step_params_is_asked():
    from revtrain.core.function import run_spec

    torch.manual_seed(0)
    block = ReversibleBlock(_fn(), _fn())
    block.step_params = lambda: list(block.f.parameters())
    (params,) = run_spec([block], 2).param_lists
    assert [id(p) for p in params] == [id(p) for p in block.f.parameters()]


@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_the_zoo_transformer_captures_where_it_has_dropout(dropout):
    model = create_model("revformer_tiny", dropout=dropout)
    blocks = [m for m in model.modules() if isinstance(m, ReversibleBlock)]
    assert blocks and all(b.preserve_rng_state == (dropout > 0) for b in blocks)

