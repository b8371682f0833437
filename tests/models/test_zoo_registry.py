"""The registry: names, lookup errors, overrides, and the structure each entry promises."""

from __future__ import annotations

import functools

import pytest
import torch
from torch import nn

from revtrain.core import ReversibleBlock, ReversibleSequence, reversible_blocks
from revtrain.models import create_model, list_models, model_info, register_model

EXPECTED_MODELS = {
    # RevNet paper, Table 2
    "resnet32", "resnet110", "resnet164", "resnet101",
    "revnet38", "revnet110", "revnet164", "revnet104",
    # PETRA, §4.1 (CIFAR stem by default, ImageNet stem with the suffix)
    "resnet18", "resnet34", "resnet50", "resnet18_imagenet", "resnet34_imagenet", "resnet50_imagenet",
    "revnet18", "revnet34", "revnet50", "revnet18_imagenet", "revnet34_imagenet", "revnet50_imagenet",
    # Jiang et al. 2021 §4.4: ResNeXt with In-place ABN, and plain twins
    "resnext29_iabn", "resnext29_bn", "resnext101_iabn", "resnext101_bn",
}
# Reversible Transformers and their plain twins (tested in test_transformer.py).
TRANSFORMER_MODELS = {
    "revformer_tiny", "revformer_small", "revformer_enwik8",
    "transformer_tiny", "transformer_small", "transformer_enwik8",
    "revvit_digits", "revvit_cifar", "vit_digits", "vit_cifar",
}

# Reversible blocks implied by the papers' architectures: every unit except a group's first
# when that one changes stride or channels.
REVERSIBLE_BLOCKS = {
    "revnet38": 3 + 2 + 2,  # 3-3-3; group 1 keeps 32 channels at stride 1
    "revnet110": 9 + 8 + 8,
    "revnet164": 8 + 8 + 8,  # bottleneck: group 1 widens 32 -> 128
    "revnet104": 1 + 1 + 10 + 1,  # 2-2-11-2, every group widens
    "revnet18": 2 + 1 + 1 + 1,  # one reversible block per residual block of ResNet-18
    "revnet34": 3 + 3 + 5 + 2,
    "revnet50": 2 + 3 + 5 + 2,  # bottleneck: stage 1 widens 64 -> 256
    # In-place ABN layers: three per unit, the head's one, and the ImageNet stem's two
    "resnext29_iabn": 3 * 9 + 1,
    "resnext101_iabn": 3 * 33 + 1 + 2,
}


def _meta(name: str, **overrides: object) -> nn.Module:
    """The model on the meta device: shapes and structure, no memory, no compute."""
    with torch.device("meta"):
        return create_model(name, **overrides)


@functools.cache
def _meta_default(name: str) -> nn.Module:
    return _meta(name)


def test_registry_holds_exactly_the_zoo():
    assert set(list_models()) == EXPECTED_MODELS | TRANSFORMER_MODELS


def test_list_models_filters_with_shell_patterns_and_sorts():
    revnets = list_models("revnet*")
    assert revnets == sorted(revnets)
    assert set(revnets) == {n for n in EXPECTED_MODELS if n.startswith("revnet")}
    assert list_models("*_imagenet") == sorted(n for n in EXPECTED_MODELS if n.endswith("_imagenet"))
    assert list_models("no-such-*") == []


@pytest.mark.parametrize("lookup", [create_model, model_info])
def test_unknown_name_raises_with_close_matches(lookup):
    with pytest.raises(ValueError) as err:
        lookup("revnet39")
    message = str(err.value)
    assert message.startswith("unknown model 'revnet39'; did you mean: ")
    assert "revnet38" in message.split("did you mean: ")[1]
    assert "revtrain models" in message


def test_unknown_name_without_close_match_points_to_the_list():
    with pytest.raises(ValueError, match=r"unknown model 'lstm'; see `revtrain models`"):
        create_model("lstm")


def test_registering_a_taken_name_raises():
    def revnet38(**kwargs):  # same name as a zoo model
        return nn.Identity()

    with pytest.raises(ValueError, match="registered twice"):
        register_model(revnet38)
    assert model_info("revnet38").builder is not revnet38


def test_unknown_override_is_a_type_error():
    with pytest.raises(TypeError, match="depth"):
        create_model("revnet38", depth=50)


@pytest.mark.parametrize("name", sorted(EXPECTED_MODELS))
def test_overrides_and_input_sizes(name):
    """num_classes / in_channels overrides take effect, from 1x1 digits-size inputs up to the
    paper's input size (shape propagation on the meta device: no compute)."""
    info = model_info(name)
    model = _meta(name, num_classes=7, in_channels=1)
    convs = [m for m in model.modules() if isinstance(m, nn.Conv2d)]
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    assert convs[0].in_channels == 1
    assert len(linears) == 1 and linears[0].out_features == 7
    with torch.no_grad():
        for size in (1, 5, 8):
            assert model(torch.empty(2, 1, size, size, device="meta")).shape == (2, 7)
        default = _meta_default(name)
        assert default(torch.empty(2, *info.input_size, device="meta")).shape == (2, info.num_classes)


@pytest.mark.parametrize("name", sorted(EXPECTED_MODELS))
def test_reversible_structure_matches_the_paper(name):
    model = _meta_default(name)
    blocks = reversible_blocks(model)
    assert model_info(name).reversible == bool(blocks)
    base = name.removesuffix("_imagenet")
    assert len(blocks) == REVERSIBLE_BLOCKS.get(base, 0)
    if not blocks or not isinstance(blocks[0][1], ReversibleBlock):
        return  # invertible layers (In-place ABN) are not grouped in sequences
    # All reversible blocks of a stage sit in one ReversibleSequence (flat memory in M-mode).
    sequences = [m for m in model.modules() if isinstance(m, ReversibleSequence)]
    assert len(sequences) == len(model.stages)
    assert sum(len(s) for s in sequences) == len(blocks)
    for stage in model.stages:
        assert isinstance(stage[-1], ReversibleSequence)
        assert not any(isinstance(m, ReversibleBlock) for m in stage[:-1].modules())


def test_model_info_fields():
    info = model_info("revnet104")
    assert info.dataset == "ImageNet" and info.num_classes == 1000
    assert info.input_size == (3, 224, 224) and info.paper_params == 45_200_000
    assert info.reversible and "Table 2" in info.paper
    assert info.description.startswith("RevNet-104")
