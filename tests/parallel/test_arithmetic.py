"""PETRA's arithmetic on the simulator: J=1 is backprop, J=2 is the paper's delayed update, k averages."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from revtrain.parallel.config import PetraConfig
from revtrain.train.optim import param_groups
from tests.parallel.cases import Toy, reference_two_stages, revnet_batches, run_simulator, small_revnet, toy_batches

# float64: the only differences allowed are rounding (summation order), far below this.
RTOL, ATOL = 1e-10, 1e-13


def _assert_same_state(got: torch.nn.Module, want: torch.nn.Module) -> None:
    for (name, a), (_, b) in zip(got.state_dict().items(), want.state_dict().items()):
        if a.is_floating_point():
            torch.testing.assert_close(a, b, rtol=RTOL, atol=ATOL, msg=lambda m, n=name: f"{n}: {m}")
        else:
            assert torch.equal(a, b), name


@pytest.mark.parametrize("k", [1, 3])
def test_one_stage_equals_ordinary_backprop(k: int) -> None:
    """J=1: every batch's forward, loss and backward in one tick, updates every k: plain SGD."""
    model = small_revnet().double()
    plain = copy.deepcopy(model)
    batches = [(x.double(), y) for x, y in revnet_batches(4)]
    run_simulator(model, 1, batches, PetraConfig(lr=0.05, accumulation=k, weight_decay=5e-4))

    opt = torch.optim.SGD(param_groups(plain, 5e-4), lr=0.05, momentum=0.9, nesterov=True)
    for i, (x, y) in enumerate(batches, start=1):
        F.cross_entropy(plain(x), y).backward()
        if i % k == 0 or i == len(batches):
            passes = k if i % k == 0 else i % k
            for p in plain.parameters():
                p.grad /= passes
            opt.step()
            opt.zero_grad(set_to_none=True)
    _assert_same_state(model, plain)


@pytest.mark.parametrize("k", [1, 2])
def test_two_stages_equal_hand_written_delayed_update(k: int) -> None:
    """J=2 on a toy (stem + reversible block | two blocks + head) equals the paper's equations
    written out tick by tick with plain autograd (cases.reference_two_stages)."""
    torch.manual_seed(0)
    model = Toy().double()
    batches = toy_batches(6)
    want = reference_two_stages(model, batches, lr=0.05, k=k, weight_decay=1e-3)
    run_simulator(model, 2, batches, PetraConfig(lr=0.05, accumulation=k, weight_decay=1e-3), split=[1, 2])
    _assert_same_state(model, want)
    # The delay matters: plain backprop on the same batches lands elsewhere.
    torch.manual_seed(0)
    plain = Toy().double()
    run_simulator(plain, 1, batches, PetraConfig(lr=0.05, accumulation=k, weight_decay=1e-3))
    assert not torch.allclose(plain.stem[0].weight, model.stem[0].weight, rtol=1e-6)


def test_accumulation_averages_k_backward_passes() -> None:
    """k=3, no momentum or decay, lr 1: the update is minus the mean of the three gradients, all
    taken at the same parameters; a final partial accumulation of 2 is averaged over 2."""
    torch.manual_seed(0)
    model = Toy().double()
    start = copy.deepcopy(model)
    batches = toy_batches(5)
    sim = run_simulator(model, 1, batches, PetraConfig(lr=1.0, accumulation=3, momentum=0.0, nesterov=False,
                                                        weight_decay=0.0))
    assert sim.workers[0].updates == 2

    def grads_at(m: torch.nn.Module, some: list) -> list[torch.Tensor]:
        out = [torch.zeros_like(p) for p in m.parameters()]
        for x, y in some:
            m.zero_grad()
            F.cross_entropy(m(x), y).backward()
            out = [o + p.grad for o, p in zip(out, m.parameters())]
        return [o / len(some) for o in out]

    want = copy.deepcopy(start)
    for some in (batches[:3], batches[3:]):
        mean = grads_at(copy.deepcopy(want), some)
        with torch.no_grad():
            for p, g in zip(want.parameters(), mean):
                p -= g
    for p, q in zip(model.parameters(), want.parameters()):
        torch.testing.assert_close(p, q, rtol=RTOL, atol=ATOL)


def test_paper_learning_rate_rule() -> None:
    assert PetraConfig(accumulation=4).peak_lr(64) == pytest.approx(0.1 * 64 * 4 / 256)
    assert PetraConfig(accumulation=4, lr=0.3).peak_lr(64) == 0.3
    assert PetraConfig(lr_per_256=0.2).peak_lr(128) == pytest.approx(0.1)


def test_no_weight_decay_on_norms_and_biases() -> None:
    model = small_revnet()
    sim = run_simulator(model, 2, revnet_batches(1), PetraConfig(weight_decay=1e-3))
    for w in sim.workers:
        groups = {g["name"]: g for g in w.optimizer.param_groups}
        no_decay = {id(p) for p in groups["no_decay"]["params"]}
        assert groups["no_decay"]["weight_decay"] == 0.0 and groups["decay"]["weight_decay"] == 1e-3
        for m in w.stage.modules():
            if isinstance(m, torch.nn.BatchNorm2d):
                assert id(m.weight) in no_decay and id(m.bias) in no_decay
        assert w.optimizer.defaults["nesterov"] and w.optimizer.defaults["momentum"] == 0.9
