"""ResNeXt with In-place ABN equals its plain twin; its layers verify; its structure is the paper's."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from revtrain.core import reversible_blocks, set_modes, verify_invertible
from revtrain.layers import BatchNormLeakyReLU, InPlaceABN
from revtrain.models import count_params, create_model
from revtrain.models.resnext import ResNeXtUnit


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny tensors: intra-op threads cost more than they save
    yield
    torch.set_num_threads(threads)


def _step(model: nn.Module, x: torch.Tensor, weights: torch.Tensor):
    model.zero_grad(set_to_none=True)
    x = x.clone().requires_grad_(True)
    out = model(x)
    (out * weights).sum().backward()
    grads = {n: p.grad for n, p in model.named_parameters()}
    return out.detach(), x.grad, grads, {n: b.clone() for n, b in model.named_buffers()}


def test_m_mode_equals_c_mode_equals_the_plain_twin():
    torch.manual_seed(0)
    iabn = create_model("resnext29_iabn", num_classes=5, in_channels=1).double()
    twin = create_model("resnext29_bn", num_classes=5, in_channels=1).double()
    twin.load_state_dict(iabn.state_dict())  # same names: BatchNormLeakyReLU is a BatchNorm2d
    initial = {k: v.clone() for k, v in iabn.state_dict().items()}
    x = torch.randn(4, 1, 8, 8, dtype=torch.float64)
    weights = torch.randn(4, 5, dtype=torch.float64)
    want = _step(twin, x, weights)
    for mode in ("M", "C"):
        iabn.load_state_dict(initial)
        set_modes(iabn, mode)
        got = _step(iabn, x, weights)
        for part, (g, w) in enumerate(zip(got, want)):
            g, w = (g, w) if isinstance(w, dict) else ({"": g}, {"": w})
            scale = max(float(t.abs().max()) for t in w.values() if t.is_floating_point())
            for key in w:
                # float64; measured worst case 1.4e-15 of the largest entry (C-mode: 0).
                torch.testing.assert_close(g[key], w[key], rtol=1e-10, atol=1e-12 * scale,
                                           msg=f"{mode}-mode, part {part}, {key}")


def test_every_in_place_abn_layer_verifies():
    torch.manual_seed(1)
    model = create_model("resnext29_iabn", in_channels=1).double()
    report = verify_invertible(model, torch.randn(4, 1, 8, 8, dtype=torch.float64))
    assert len(report.checks) == len(reversible_blocks(model)) == 28
    assert max(c.rel_error for c in report.checks) < 1e-12


def test_every_norm_and_activation_feeds_a_convolution_or_the_pooling():
    """What makes M-mode free: the tensor In-place ABN keeps is one the next layer keeps anyway
    (a convolution's input), except the head's, whose pooling keeps nothing."""
    with torch.device("meta"):
        model = create_model("resnext101_iabn")
    units = [m for m in model.modules() if isinstance(m, ResNeXtUnit)]
    assert len(units) == 33
    for unit in units:
        names = [name for name, _ in unit.named_children()]
        assert names[:6] == ["bn1", "conv1", "bn2", "conv2", "bn3", "conv3"]
        assert unit.conv2.groups == 64 and unit.conv2.in_channels // 64 in (2, 4, 8, 16)
    stem = list(model.stem.children())
    for i, layer in enumerate(stem):
        if isinstance(layer, InPlaceABN):
            assert isinstance(stem[i + 1], nn.Conv2d)
    assert isinstance(model.head.bn, InPlaceABN) and isinstance(model.head.pool, nn.AdaptiveAvgPool2d)


def test_the_twin_differs_only_in_the_norm_layer():
    with torch.device("meta"):
        iabn, twin = create_model("resnext101_iabn"), create_model("resnext101_bn")
    kinds = lambda m: [type(x).__name__ for x in m.modules()]  # noqa: E731
    swapped = [k.replace("InPlaceABN", "BatchNormLeakyReLU") for k in kinds(iabn)]
    assert swapped == kinds(twin)
    assert not any(isinstance(m, InPlaceABN) for m in twin.modules())
    assert sum(isinstance(m, BatchNormLeakyReLU) for m in twin.modules()) == 102


def test_cardinality_and_group_width_overrides():
    # The 32x4d configuration of Xie et al. (whose "~44M" the registry quotes).
    assert count_params("resnext101_iabn", cardinality=32, group_width=4) == 44_236_328
    with pytest.raises(ValueError, match="cardinality must be a positive int, got 0"):
        create_model("resnext101_iabn", cardinality=0)
    with pytest.raises(ValueError, match="cardinality 3 must divide the bottleneck width 8"):
        ResNeXtUnit(8, 8, 16, stride=1, cardinality=3, norm_act=InPlaceABN)
