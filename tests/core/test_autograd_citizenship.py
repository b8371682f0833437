"""M-mode behaves like any autograd op where other libraries slip."""

from __future__ import annotations

import threading

import pytest
import torch

from .helpers import assert_grads_close, grads, make_stack, plain_twin

REL = 1e-10  # float64 throughout


def _model(seed=0, depth=3):
    torch.manual_seed(seed)
    return make_stack(depth).double()


def _x(seed=1, requires_grad=False):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(2, 8, 5, 5, dtype=torch.float64, generator=g).requires_grad_(requires_grad)


def test_parameters_get_gradients_when_input_does_not_require_grad():
    model = _model()
    twin = plain_twin(model)
    model(_x()).square().sum().backward()
    twin(_x()).square().sum().backward()
    assert all(p.grad is not None for p in model.parameters())
    assert_grads_close(grads(model), grads(twin), REL)


def test_leaf_input_gradient_is_exact_not_doubled():
    model = _model()
    twin = plain_twin(model)
    x, x_ref = _x(requires_grad=True), _x(requires_grad=True)
    model(x).square().sum().backward()
    twin(x_ref).square().sum().backward()
    torch.testing.assert_close(x.grad, x_ref.grad, rtol=REL, atol=1e-12)


def test_autograd_grad_leaves_dot_grad_untouched():
    model = _model()
    twin = plain_twin(model)
    x = _x(requires_grad=True)
    params = list(model.parameters())
    got = torch.autograd.grad(model(x).square().sum(), [x, *params])
    assert x.grad is None and all(p.grad is None for p in model.parameters())
    x_ref = _x(requires_grad=True)
    want = torch.autograd.grad(twin(x_ref).square().sum(), [x_ref, *twin.parameters()])
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=REL, atol=1e-12)


def test_retain_graph_twice_gives_twice_the_gradients():
    model = _model()
    twin = plain_twin(model)
    loss = model(_x()).square().sum()
    loss.backward(retain_graph=True)
    loss.backward()
    twin(_x()).square().sum().backward()
    doubled = {k: 2 * v for k, v in grads(twin).items()}
    assert_grads_close(grads(model), doubled, REL)


def test_autocast_bfloat16_matches_plain_autograd_under_same_autocast():
    torch.manual_seed(0)
    model = make_stack(4)
    twin = plain_twin(model)
    x = torch.randn(2, 8, 6, 6)
    for m in (model, twin):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = m(x)
        out.float().square().sum().backward()
    # bfloat16 has 8 bits of mantissa (eps 7.8e-3); the rebuild reruns the same bf16 kernels
    # on a float32 value equal to the forward's input up to float32 rounding, so the results
    # agree to a few bf16 ulps.
    assert_grads_close(grads(model), grads(twin), 3e-2)


def test_two_models_interleaved_steps_are_independent():
    a, b = _model(0), _model(1, depth=5)
    a_ref, b_ref = plain_twin(a), plain_twin(b)
    loss_a = a(_x(1)).square().sum()
    loss_b = b(_x(2)).square().sum()
    loss_b.backward()
    loss_a.backward()
    a_ref(_x(1)).square().sum().backward()
    b_ref(_x(2)).square().sum().backward()
    assert_grads_close(grads(a), grads(a_ref), REL)
    assert_grads_close(grads(b), grads(b_ref), REL)


def test_two_threads_train_two_models_concurrently():
    models = [_model(s, depth=4) for s in range(2)]
    refs = [plain_twin(m) for m in models]
    errors: list[BaseException] = []

    def work(model, seed):
        try:
            for step in range(3):
                model(_x(seed + 10 * step)).square().sum().backward()
        except BaseException as e:  # noqa: BLE001 - reported by the main thread
            errors.append(e)

    threads = [threading.Thread(target=work, args=(m, s)) for s, m in enumerate(models)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    for seed, ref in enumerate(refs):
        for step in range(3):
            ref(_x(seed + 10 * step)).square().sum().backward()
    for m, ref in zip(models, refs):
        assert_grads_close(grads(m), grads(ref), REL)


def test_no_grad_forward_keeps_nothing_and_matches():
    model = _model()
    with torch.no_grad():
        y = model(_x())
    assert y.grad_fn is None
    twin = plain_twin(model)
    with torch.no_grad():
        torch.testing.assert_close(y, twin(_x()), rtol=REL, atol=1e-12)


@pytest.mark.parametrize("mode", ["M", "C"])
def test_unused_output_half_gets_zero_gradient(mode):
    model = _model()
    twin = plain_twin(model)
    from revtrain.core import set_modes

    set_modes(model, mode)
    x1, x2 = _x(3)[:, :4], _x(3)[:, 4:]
    y1, _ = model((x1, x2))
    y1.square().sum().backward()
    r1, _ = twin((x1, x2))
    r1.square().sum().backward()
    assert_grads_close(grads(model), grads(twin), REL)


@pytest.mark.parametrize("where", ["block", "global"])
def test_hooks_on_c_mode_blocks_in_a_sequence_fire(where):
    """A sequence runs hook-free C-mode blocks without the module call (3-4% of a small step);
    a hook on a block, or a global module hook, puts the call back and fires once per block."""
    model = _model()
    for block in model:
        block.mode = "C"
    seen = []
    hook = lambda module, inputs, output: seen.append(module)  # noqa: E731
    if where == "block":
        handles = [model[1].register_forward_hook(hook)]
    else:
        handles = [torch.nn.modules.module.register_module_forward_hook(hook)]
    try:
        out = model(_x())
    finally:
        for h in handles:
            h.remove()
    blocks_seen = [m for m in seen if m in list(model)]
    assert blocks_seen == ([model[1]] if where == "block" else list(model))
    twin = plain_twin(model)
    torch.testing.assert_close(out, twin(_x()), rtol=0, atol=0)
