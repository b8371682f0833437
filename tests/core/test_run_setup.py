"""What an M-mode run sets up per layer in every forward: the random generators are captured only
where something below a block may draw random numbers (core/randomness.py), counted, with exact
replay wherever one may; the parameters come from the walk that finds the tensors."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import revtrain.core.block as block_module
from revtrain.core import AdditiveCoupling, ReversibleBlock, ReversibleSequence, set_modes
from revtrain.core.randomness import draws_no_random_numbers, known_random_free, no_module_draws_random_numbers
from revtrain.models import create_model

from .helpers import assert_grads_close, grads, plain_twin


class Noise(nn.Module):
    """Adds Gaussian noise: draws random numbers in its own forward, with no word about it."""

    def forward(self, x):
        return x + 0.1 * torch.randn_like(x)


class SaysNoRandomness(nn.Module):
    draws_random_numbers = False

    def forward(self, x):
        return torch.tanh(x)


class InheritsTheWord(SaysNoRandomness):
    """A subclass may add randomness: the parent's word does not count for it."""

    def forward(self, x):
        return torch.tanh(x) + 0.1 * torch.randn_like(x)


class OwnForwardSequential(nn.Sequential):
    def forward(self, x):
        return super().forward(x) + 0.1 * torch.randn_like(x)


class PlainCoupling(AdditiveCoupling):
    """Not a built-in type: the block keeps capturing whatever F and G are."""


def _fn(*extra: nn.Module) -> nn.Module:
    return nn.Sequential(nn.Conv2d(4, 4, 3, padding=1, bias=False), nn.BatchNorm2d(4), nn.ReLU(), *extra)


def _stack(f_extra=(), g_extra=(), coupling="additive", depth=3) -> ReversibleSequence:
    torch.manual_seed(0)
    return ReversibleSequence([
        ReversibleBlock(_fn(*[type(m)() for m in f_extra]), _fn(*[type(m)() for m in g_extra]), coupling=coupling)
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


def test_blocks_of_torch_layers_capture_nothing(monkeypatch):
    assert _captures(_stack(), X, monkeypatch) == 0


@pytest.mark.parametrize("extra, random", [
    ((nn.Dropout(),), True),
    ((Noise(),), True),
    ((SaysNoRandomness(),), False),
    ((InheritsTheWord(),), True),
])
def test_a_block_captures_where_a_module_may_draw(monkeypatch, extra, random):
    """Three captures per block (before F, before G, after G) wherever one module below it may
    draw; none where every module is known not to."""
    model = _stack(f_extra=extra)
    assert _captures(model, X, monkeypatch) == (9 if random else 0)


def test_a_sequential_with_its_own_forward_is_not_trusted(monkeypatch):
    torch.manual_seed(0)
    fn = OwnForwardSequential(nn.Conv2d(4, 4, 3, padding=1, bias=False))
    model = ReversibleSequence([ReversibleBlock(fn, _fn())])
    assert not draws_no_random_numbers(fn)
    assert _captures(model, X, monkeypatch) == 3


def test_hooks_and_custom_couplings_keep_the_capture(monkeypatch):
    model = _stack()
    handle = model[1].f[0].register_forward_hook(lambda m, i, o: o + 0.0 * torch.rand(()))
    assert _captures(model, X, monkeypatch) == 3  # the hooked block only
    handle.remove()
    handle = nn.modules.module.register_module_forward_pre_hook(lambda m, i: None)
    try:
        assert _captures(model, X, monkeypatch) == 9
    finally:
        handle.remove()
    assert _captures(_stack(coupling=PlainCoupling()), X, monkeypatch) == 9
    assert _captures(model, X, monkeypatch) == 0


def test_the_zoo_revnet_captures_nothing(monkeypatch):
    torch.manual_seed(0)
    model = create_model("revnet38", in_channels=1, num_classes=10)
    assert _captures(model, torch.randn(2, 1, 8, 8), monkeypatch) == 0


@pytest.mark.parametrize("extra", [(Noise(),), (InheritsTheWord(),), (nn.Dropout(0.5),)])
def test_modules_that_draw_are_replayed_exactly(extra):
    """Where a module below may draw, the rebuild replays it: M-mode gradients equal plain
    autograd's from the same seed, in float64."""
    model = _stack(f_extra=extra, g_extra=extra, depth=4).double()
    _assert_same_as_plain(model, plain_twin(model), torch.randn(2, 8, 5, 5, dtype=torch.float64), seed=11)


def test_the_flag_is_only_set_around_a_random_free_step():
    seen = []

    class Spy(nn.Module):
        draws_random_numbers = False

        def forward(self, x):
            seen.append(known_random_free())
            return x * 0.5

    torch.manual_seed(0)
    model = ReversibleSequence([ReversibleBlock(Spy(), Spy()), ReversibleBlock(Spy(), Noise())])
    model(X.clone().requires_grad_(True)).sum().backward()
    # Forward: the first block is random-free, the second not (its G draws); the rebuild in
    # backward never runs under the flag.
    assert seen[:3] == [True, True, False]
    assert not any(seen[3:]) and not known_random_free()


def test_the_rules_for_single_modules():
    assert draws_no_random_numbers(nn.Conv2d(1, 1, 1)) and draws_no_random_numbers(nn.Sequential())
    assert not draws_no_random_numbers(nn.Dropout()) and not draws_no_random_numbers(nn.RReLU())
    assert not draws_no_random_numbers(nn.MultiheadAttention(4, 1))
    assert not draws_no_random_numbers(Noise())
    assert no_module_draws_random_numbers([nn.Linear(2, 2), nn.GELU()])
    assert not no_module_draws_random_numbers([nn.Linear(2, 2), nn.Dropout()])


# -- one walk for a layer's tensors and its parameters (revtrain.core.step.walk_gives_params) --


def _tied_block() -> ReversibleBlock:
    torch.manual_seed(0)
    f, g = _fn(), _fn()
    g[0].weight = f[0].weight  # shared: counted once
    g[1].weight.requires_grad_(False)  # frozen: not a parameter of the step (3 + 1 left)
    return ReversibleBlock(f, g)


def test_the_runs_parameters_are_the_layers_step_params_in_order():
    from revtrain.core.function import run_spec
    from revtrain.core.step import walk_gives_params

    block = _tied_block()
    layers = [block, block.inverse_step()]
    spec = run_spec(layers, 2)
    for layer, params in zip(layers, spec.param_lists):
        assert walk_gives_params(layer)
        want = layer.step_params()
        assert len(params) == len(want) == 4 and all(a is b for a, b in zip(params, want))


def test_a_layer_that_overrides_step_params_is_asked():
    from revtrain.core.function import run_spec
    from revtrain.core.step import walk_gives_params

    class OnlyF(ReversibleBlock):
        def step_params(self):
            return list(self.f.parameters())

    torch.manual_seed(0)
    block = OnlyF(_fn(), _fn())
    assert not walk_gives_params(block) and not walk_gives_params(block.inverse_step())
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


def test_a_forward_set_on_the_instance_is_not_trusted_and_replays_exactly(monkeypatch):
    model = _stack(depth=2).double()
    for block in model:
        _dropout_forward(block.f[0])
    assert not draws_no_random_numbers(model[0].f[0])
    twin = plain_twin(model)
    for block in twin:  # deepcopy keeps the instance forward bound to the original: set again
        _dropout_forward(block.f[0])
    assert _captures(model, X.double(), monkeypatch) == 6
    model.zero_grad(set_to_none=True)
    _assert_same_as_plain(model, twin, torch.randn(2, 8, 5, 5, dtype=torch.float64), seed=3)


def test_an_overridden_call_is_not_trusted():
    class CalledOtherwise(nn.Sequential):
        def __call__(self, *args):
            return super().__call__(*args) + 0.1 * torch.randn_like(args[0])

    class Plain(nn.Sequential):
        pass

    assert not draws_no_random_numbers(CalledOtherwise(nn.Identity()))
    assert draws_no_random_numbers(Plain(nn.Identity()))
    patched = Plain(nn.Identity())
    patched._call_impl = lambda *a, **k: torch.rand(())
    assert not draws_no_random_numbers(patched)


def test_compile_models_forward_is_judged_by_its_class_and_a_later_patch_is_not():
    from revtrain.compilation import compile_model, uncompile_model
    from revtrain.core.replay import ModuleTensors

    model = _stack(depth=1)
    assert compile_model(model)  # sets a compiled forward on F and G (compiled on first call)
    assert "forward" in model[0].f.__dict__ and ModuleTensors.capture(model[0]).random_free
    _dropout_forward(model[0].f)
    assert not ModuleTensors.capture(model[0]).random_free
    uncompile_model(model)
    assert ModuleTensors.capture(model[0]).random_free


def test_no_layer_inherits_the_answer_of_an_outer_scope(monkeypatch):
    from revtrain.core.randomness import enter_random_free, leave_random_free

    token = enter_random_free(True)
    try:
        assert _captures(_stack(f_extra=(nn.Dropout(),)), X, monkeypatch) == 9
    finally:
        leave_random_free(token)


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
    from revtrain.core.step import walk_gives_params

    torch.manual_seed(0)
    block = ReversibleBlock(_fn(), _fn())
    block.step_params = lambda: list(block.f.parameters())
    assert not walk_gives_params(block) and not walk_gives_params(block.inverse_step())
    (params,) = run_spec([block], 2).param_lists
    assert [id(p) for p in params] == [id(p) for p in block.f.parameters()]
