"""Dropout replays exactly in the rebuild; batch-norm statistics are updated once per step."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from revtrain.core import ReversibleBlock, ReversibleSequence

from .helpers import assert_grads_close, conv_fn, grads, make_stack, plain_twin


def _dropout_stack(depth: int) -> ReversibleSequence:
    def fn():
        return nn.Sequential(nn.Conv2d(4, 4, 3, padding=1, bias=False), nn.Dropout(0.5), nn.Tanh())

    return ReversibleSequence([ReversibleBlock(fn(), fn()) for _ in range(depth)])


def _step_with_seed(model, x, seed):
    torch.manual_seed(seed)
    x = x.clone().requires_grad_(True)
    model(x).square().sum().backward()
    cuda = torch.cuda.get_rng_state(x.device) if x.is_cuda else None
    return x.grad, (torch.get_rng_state(), cuda)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_dropout_replays_exactly(device):
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    torch.manual_seed(0)
    model = _dropout_stack(6).double().to(device)
    twin = plain_twin(model)
    x = torch.randn(2, 8, 5, 5, dtype=torch.float64, device=device)
    gx, rng_after = _step_with_seed(model, x, seed=123)
    gx_ref, rng_after_ref = _step_with_seed(twin, x, seed=123)
    torch.testing.assert_close(gx, gx_ref, rtol=1e-10, atol=1e-12)
    assert_grads_close(grads(model), grads(twin), 1e-10)
    # The rebuild borrows the generators and gives them back: the step consumes the same numbers.
    assert torch.equal(rng_after[0], rng_after_ref[0])
    if device == "cuda":
        assert torch.equal(rng_after[1], rng_after_ref[1])


def test_dropout_without_replay_is_caught_as_drift():
    torch.manual_seed(0)
    model = _dropout_stack(2)
    for block in model:
        block.preserve_rng_state = False
        block.drift_action = "raise"
    from revtrain.errors import ReconstructionError

    with pytest.raises(ReconstructionError, match="drifted"):
        model(torch.randn(2, 8, 5, 5, requires_grad=True)).square().sum().backward()


@pytest.mark.parametrize("random_in", ["none", "G", "both"])
def test_only_functions_that_drew_random_numbers_replay_the_generators(monkeypatch, random_in):
    """The forward notes whether F and G moved the generators; the rebuild replays (set, then
    restore: two calls) only those that did, and gradients still equal plain autograd's."""
    torch.manual_seed(0)

    def fn(dropout: bool) -> nn.Module:
        layers = [nn.Conv2d(4, 4, 3, padding=1, bias=False), nn.Tanh()]
        return nn.Sequential(*layers, nn.Dropout(0.5)) if dropout else nn.Sequential(*layers)

    model = ReversibleSequence(
        [ReversibleBlock(fn(random_in == "both"), fn(random_in != "none")) for _ in range(3)]
    ).double()
    twin = plain_twin(model)
    x = torch.randn(2, 8, 5, 5, dtype=torch.float64)
    torch.manual_seed(7)
    y = model(x.clone().requires_grad_(True))
    sets = []
    real_set = torch.set_rng_state
    monkeypatch.setattr(torch, "set_rng_state", lambda state: (sets.append(1), real_set(state)))
    y.square().sum().backward()
    monkeypatch.setattr(torch, "set_rng_state", real_set)
    assert len(sets) == {"none": 0, "G": 2 * 3, "both": 4 * 3}[random_in]
    torch.manual_seed(7)
    twin(x.clone().requires_grad_(True)).square().sum().backward()
    assert_grads_close(grads(model), grads(twin), 1e-10)


@pytest.mark.parametrize("steps", [1, 3])
def test_batchnorm_statistics_match_plain_autograd(steps):
    torch.manual_seed(0)
    model = make_stack(4).double()
    twin = plain_twin(model)
    for _ in range(steps):
        x = torch.randn(4, 8, 5, 5, dtype=torch.float64)
        model(x).square().sum().backward()
        twin(x).square().sum().backward()
    for (name, a), (_, b) in zip(model.named_buffers(), twin.named_buffers()):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12, msg=name)
        if name.endswith("num_batches_tracked"):
            assert int(a) == steps


def test_dropout_and_batchnorm_match_plain_autograd_over_steps_and_modes():
    """Dropout and batch norm in F over several steps, then eval mode, then training again:
    gradients, the generators' end state and the running statistics equal plain autograd's at
    every step."""
    torch.manual_seed(0)

    def fn():
        return nn.Sequential(nn.Conv2d(4, 4, 3, padding=1, bias=False), nn.BatchNorm2d(4), nn.Dropout(0.3), nn.Tanh())

    model = ReversibleSequence([ReversibleBlock(fn(), fn()) for _ in range(3)]).double()
    twin = plain_twin(model)
    x = torch.randn(4, 8, 5, 5, dtype=torch.float64)
    for step, training in enumerate([True, True, False, True]):
        for m in (model, twin):
            m.train(training)
            m.zero_grad()
        torch.manual_seed(100 + step)
        model(x.clone().requires_grad_(True)).square().sum().backward()
        rng_after = torch.get_rng_state()
        torch.manual_seed(100 + step)
        twin(x.clone().requires_grad_(True)).square().sum().backward()
        assert torch.equal(rng_after, torch.get_rng_state())
        assert_grads_close(grads(model), grads(twin), 1e-10)
        for a, b in zip(model.buffers(), twin.buffers()):
            torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


@pytest.mark.gpu
def test_a_cuda_generator_is_captured_as_its_seed_and_offset():
    """On CUDA the capture reads the Philox generator's seed and offset (what its state tensor
    holds); a draw moves it, and a replay draws the same numbers, then leaves the generator
    where it found it."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from revtrain.core.replay import RngState

    cuda = torch.device("cuda")
    torch.cuda.manual_seed(3)
    a = RngState.capture(cuda)
    assert a.same_as(RngState.capture(cuda))
    assert a.cuda_seed_offset == tuple(torch.cuda.get_rng_state(cuda).view(torch.int64).tolist())
    want = torch.rand(5, device=cuda)
    assert not a.same_as(RngState.capture(cuda))
    now = torch.cuda.get_rng_state(cuda)
    with a.replay():
        got = torch.rand(5, device=cuda)
    assert torch.equal(got, want)
    assert torch.equal(torch.cuda.get_rng_state(cuda), now)


def test_generator_states_compare_by_every_byte():
    """The forward's test for "F drew random numbers" (``RngState.same_as``): equal states are
    equal, a state after one draw is not, and a difference in the first or the last byte alone
    is seen."""
    from revtrain.core.replay import RngState

    cpu = torch.device("cpu")
    a, b = RngState.capture(cpu), RngState.capture(cpu)
    assert a.same_as(b)
    torch.rand(1)
    assert not a.same_as(RngState.capture(cpu))
    for index in (0, -1):
        changed = a.cpu.clone()
        changed[index] ^= 1
        assert not a.same_as(RngState(changed))
        assert a.same_as(RngState(a.cpu.clone()))
