"""The gradient angle monitor measures stored vs rebuilt activations and leaves the model alone."""

from __future__ import annotations

import copy
import json
import math

import pytest
import torch
from torch import nn

from revtrain.core import ReversibleBlock, ReversibleSequence, get_modes, set_modes
from revtrain.train.grad_angle import angle_between, gradient_angles, plot_grad_angles


def _net(coupling: str = "additive", depth: int = 4, dropout: float = 0.0, dtype=torch.float32) -> nn.Module:
    mult = 2 if coupling == "affine" else 1

    def fn():
        return nn.Sequential(
            nn.Conv2d(4, 4 * mult, 3, padding=1, bias=False), nn.BatchNorm2d(4 * mult), nn.Dropout(dropout), nn.Tanh()
        )

    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1),
        ReversibleSequence([ReversibleBlock(fn(), fn(), coupling=coupling) for _ in range(depth)]),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(8, 5),
    ).to(dtype)


def _batch(dtype=torch.float32):
    g = torch.Generator().manual_seed(1)
    return torch.randn(6, 3, 6, 6, generator=g, dtype=dtype), torch.randint(0, 5, (6,), generator=g)


LOSS = nn.functional.cross_entropy


def test_angle_between_is_accurate_for_tiny_and_large_angles():
    a = torch.tensor([1.0, 0.0], dtype=torch.float64)
    for degrees in (1e-9, 1e-4, 1.0, 45.0, 90.0, 179.0):
        t = math.radians(degrees)
        b = torch.tensor([math.cos(t), math.sin(t)], dtype=torch.float64) * 3
        assert angle_between(a, b) == pytest.approx(degrees, rel=1e-6)
    assert angle_between(a, a) == 0.0


def test_float64_rebuild_gives_no_angle():
    model = _net(dtype=torch.float64)
    result = gradient_angles(model, _batch(torch.float64), LOSS)
    assert result.overall.group == "all" and result.overall.parameters == len(list(model.parameters()))
    assert result.overall.angle_deg < 1e-8 and result.overall.rel_error < 1e-10


def test_matches_a_direct_computation_in_float32():
    model = _net("affine", depth=8)
    result = gradient_angles(model, _batch(), LOSS)
    grads = {}
    for mode in ("C", "M"):
        twin = copy.deepcopy(model)
        set_modes(twin, mode)
        x, y = _batch()
        grads[mode] = torch.cat([g.flatten() for g in torch.autograd.grad(LOSS(twin(x), y), list(twin.parameters()))])
    want = angle_between(grads["C"], grads["M"])
    assert result.overall.angle_deg == pytest.approx(want, rel=1e-6, abs=1e-12)
    assert result.overall.angle_deg > 0  # float32 affine rebuilds drift measurably


class Replayed(nn.Module):
    """Tanh whose rebuild call is off by 1% (not a pure function)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        return torch.tanh(x) * (1.0 if self.calls % 2 else 1.01)


def test_a_bad_rebuild_shows_as_a_large_angle():
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(8, 8),
        ReversibleBlock(Replayed(), nn.Sequential(nn.Linear(4, 4), nn.Tanh()), check_reconstruction=False),
        nn.Linear(8, 3),
    ).double()
    result = gradient_angles(model, (torch.randn(5, 8, dtype=torch.float64), torch.tensor([0, 1, 2, 0, 1])), LOSS)
    assert result.overall.rel_error > 1e-3 and result.overall.angle_deg > 1e-2


def test_exact_couplings_give_exactly_zero_in_float32():
    result = gradient_angles(_net("exact", depth=8), _batch(), LOSS)
    assert all(g.angle_deg == 0.0 and g.rel_error == 0.0 for g in result.groups)


def test_model_state_is_left_as_it_was():
    model = _net(dropout=0.3, dtype=torch.float64)
    set_modes(model, {"1.blocks.0": "C", "1.blocks.2": "C"})
    for p in model.parameters():
        p.grad = torch.full_like(p, 7.0)
    modes = get_modes(model)
    buffers = {k: v.clone() for k, v in model.named_buffers()}
    rng = torch.get_rng_state()
    result = gradient_angles(model, _batch(torch.float64), LOSS)
    assert get_modes(model) == modes
    assert all(torch.equal(buffers[k], v) for k, v in model.named_buffers())
    assert all(torch.equal(p.grad, torch.full_like(p, 7.0)) for p in model.parameters())
    assert torch.equal(rng, torch.get_rng_state())
    # Both passes drew the same dropout masks: in float64 the rebuild leaves no angle.
    assert result.overall.angle_deg < 1e-8


def test_groups_by_name_prefix():
    model = _net()
    names = {g.group for g in gradient_angles(model, _batch(), LOSS).groups}
    assert names == {"all", "0", "1", "4"}
    deep = {g.group for g in gradient_angles(model, _batch(), LOSS, group_depth=3).groups}
    assert "1.blocks.0" in deep and "1.blocks.3" in deep
    custom = {g.group for g in gradient_angles(model, _batch(), LOSS, groups=lambda n: n.split(".")[-1]).groups}
    assert custom == {"all", "weight", "bias"}


def test_refuses_a_model_without_reversible_layers():
    with pytest.raises(ValueError, match="no reversible layer"):
        gradient_angles(nn.Linear(3, 3), (torch.randn(2, 3), torch.tensor([0, 1])), LOSS)


def test_plot_from_records_and_from_a_metrics_file(tmp_path):
    model = _net("affine")
    records = []
    for step in range(3):
        records.append({"event": "grad_angle", "step": step, **gradient_angles(model, _batch(), LOSS).to_record()})
    png = plot_grad_angles(records, tmp_path / "a" / "angles.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text("\n".join(json.dumps(r) for r in [{"event": "step", "step": 0, "loss": 1.0}, *records]) + "\n")
    assert plot_grad_angles(metrics, tmp_path / "b.png").stat().st_size > 1000
    with pytest.raises(ValueError, match="no 'grad_angle' records"):
        plot_grad_angles([{"event": "step", "step": 0}], tmp_path / "c.png")
