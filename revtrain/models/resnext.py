"""ResNeXt with In-place ABN (Jiang et al. 2021, §4.4) and its plain twin.

Jiang et al. train "ResNeXt-101 with In-place ABN" following the In-place ABN paper (Rota Bulò
et al. 2018) and adapting its authors' code (``mapillary/inplace_abn``: ``scripts/models/
resnext.py``, ``scripts/modules/residual.py``). We read that code for the architecture:

- **Pre-activation bottleneck units** (their ``IdentityResidualBlock``): ``a = ABN(x)``;
  ``r = conv1x1(ABN(conv3x3_grouped(ABN(conv1x1_strided(a)))))``; ``y = r + s`` where the
  shortcut ``s`` is ``x``, or ``conv1x1_strided(a)`` when the unit changes shape. Every
  batch norm + activation feeds a convolution (or the final pooling), so an M-mode
  :class:`~revtrain.layers.InPlaceABN` keeps nothing the convolution does not keep anyway.
- **Widths:** bottleneck width ``cardinality × group_width × 2^stage``, unit output twice that.
  Their ResNeXt-101 has cardinality 64 and bottleneck width 128 in the first stage (64×2d),
  with the stride on the first 1×1 convolution.
- **Stem** (their ``input_3x3``, used in the In-place ABN ImageNet runs): three 3×3
  convolutions, the first with stride 2, with ABN between them, then a 3×3/2 max-pool.
- **Head:** ABN, global average pool, linear layer. Leaky ReLU slope 0.01.

The CIFAR-size ``resnext29`` keeps the ResNeXt-29 layout of Xie et al. (2017) for CIFAR (three
stages of three units, a single 3×3 stem convolution of 64 channels) at 8×4d, small enough to
train on a CPU. ``*_iabn`` models use :class:`~revtrain.layers.InPlaceABN` (reversible layers
with M/C modes); ``*_bn`` twins use :class:`~revtrain.layers.BatchNormLeakyReLU` (plain
``nn.BatchNorm2d`` + leaky ReLU, same parameter names: state dicts load across).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence
from functools import partial
from typing import Literal

from torch import Tensor, nn

from revtrain.layers import BatchNormLeakyReLU, InPlaceABN
from revtrain.models.blocks import conv1x1, conv3x3, init_weights
from revtrain.models.registry import register_model

__all__ = ["NormAct", "ResNeXtUnit", "ResNeXt"]

NormAct = Callable[[int], nn.Module]
"""Builds the batch norm + activation layer for a channel count."""


class ResNeXtUnit(nn.Module):
    """Pre-activation ResNeXt bottleneck unit (the In-place ABN authors' ``IdentityResidualBlock``).

    Args:
        in_channels: Input channels.
        width: Bottleneck width (channels of the grouped 3×3 convolution).
        out_channels: Output channels.
        stride: Stride of the first 1×1 convolution and of the projection shortcut.
        cardinality: Groups of the 3×3 convolution; must divide ``width``.
        norm_act: Builds each batch norm + activation layer.
    """

    def __init__(
        self, in_channels: int, width: int, out_channels: int, stride: int, cardinality: int,
        norm_act: NormAct,
    ) -> None:
        super().__init__()
        if width % cardinality:
            raise ValueError(f"cardinality {cardinality} must divide the bottleneck width {width}")
        self.bn1 = norm_act(in_channels)
        self.conv1 = conv1x1(in_channels, width, stride)
        self.bn2 = norm_act(width)
        self.conv2 = nn.Conv2d(width, width, 3, padding=1, groups=cardinality, bias=False)
        self.bn3 = norm_act(width)
        self.conv3 = conv1x1(width, out_channels)
        needs_projection = stride != 1 or in_channels != out_channels
        self.shortcut = conv1x1(in_channels, out_channels, stride) if needs_projection else None

    def forward(self, x: Tensor) -> Tensor:
        a = self.bn1(x)
        shortcut = x if self.shortcut is None else self.shortcut(a)
        return self.conv3(self.bn3(self.conv2(self.bn2(self.conv1(a))))) + shortcut


class ResNeXt(nn.Module):
    """Pre-activation ResNeXt whose every batch norm + activation is one ``norm_act`` layer.

    Args:
        units: Units per stage, e.g. ``(3, 4, 23, 3)`` for ResNeXt-101.
        cardinality: Groups of every grouped convolution.
        group_width: Channels per group in the first stage (doubles each stage).
        stem: ``"cifar"`` (one 3×3 convolution) or ``"imagenet"`` (three 3×3 convolutions,
            the first strided, and a 3×3/2 max-pool).
        norm_act: Builds each batch norm + activation layer (``InPlaceABN`` or its twin).
        num_classes: Logits of the classifier.
        in_channels: Channels of the input image.

    Modules: ``stem``, ``stages.<s>.<i>`` (:class:`ResNeXtUnit`), ``head``.
    """

    def __init__(
        self,
        units: Sequence[int],
        *,
        cardinality: int,
        group_width: int,
        stem: Literal["cifar", "imagenet"],
        norm_act: NormAct,
        num_classes: int,
        in_channels: int = 3,
    ) -> None:
        super().__init__()
        for name, value in (("cardinality", cardinality), ("group_width", group_width)):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if not units or any(not isinstance(n, int) or n < 1 for n in units):
            raise ValueError(f"units needs a positive count per stage, got {units!r}")
        stem_channels = 64
        if stem == "cifar":
            self.stem: nn.Module = conv3x3(in_channels, stem_channels)
        elif stem == "imagenet":
            self.stem = nn.Sequential(OrderedDict([
                ("conv1", conv3x3(in_channels, stem_channels, stride=2)),
                ("bn1", norm_act(stem_channels)),
                ("conv2", conv3x3(stem_channels, stem_channels)),
                ("bn2", norm_act(stem_channels)),
                ("conv3", conv3x3(stem_channels, stem_channels)),
                ("pool", nn.MaxPool2d(3, stride=2, padding=1)),
            ]))
        else:
            raise ValueError(f"stem must be 'cifar' or 'imagenet', got {stem!r}")
        stages = []
        channels = stem_channels
        for s, n in enumerate(units):
            width = cardinality * group_width * 2**s
            out = 2 * width
            stages.append(nn.Sequential(*(
                ResNeXtUnit(channels if i == 0 else out, width, out,
                            stride=2 if s > 0 and i == 0 else 1, cardinality=cardinality,
                            norm_act=norm_act)
                for i in range(n)
            )))
            channels = out
        self.stages = nn.Sequential(*stages)
        self.head = nn.Sequential(OrderedDict([
            ("bn", norm_act(channels)),
            ("pool", nn.AdaptiveAvgPool2d(1)),
            ("flatten", nn.Flatten()),
            ("fc", nn.Linear(channels, num_classes)),
        ]))
        init_weights(self)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.stages(self.stem(x)))


_SLOPE = 0.01  # the In-place ABN experiments' leaky ReLU slope
_IABN = partial(InPlaceABN, slope=_SLOPE)
_PLAIN = partial(BatchNormLeakyReLU, slope=_SLOPE)
_JIANG = "Jiang et al. 2021, §4.4 (ResNeXt-101 with In-place ABN; mapillary/inplace_abn code)"
_XIE_CIFAR = "Xie et al. 2017 (ResNeXt-29 layout for CIFAR, at 8x4d)"
# Xie et al. 2017 print "~44 million parameters" for ResNeXt-101 (Fig. 5; the authors'
# README); Jiang et al. and the In-place ABN paper print none. See docs/models.md.
_XIE_101_PARAMS = 44e6
_CIFAR = dict(dataset="CIFAR-10", num_classes=10, input_size=(3, 32, 32))
_IMAGENET = dict(dataset="ImageNet", num_classes=1000, input_size=(3, 224, 224))


def _resnext29(norm_act: NormAct, num_classes: int, in_channels: int) -> ResNeXt:
    return ResNeXt((3, 3, 3), cardinality=8, group_width=4, stem="cifar", norm_act=norm_act,
                   num_classes=num_classes, in_channels=in_channels)


def _resnext101(
    norm_act: NormAct, num_classes: int, in_channels: int, cardinality: int, group_width: int
) -> ResNeXt:
    return ResNeXt((3, 4, 23, 3), cardinality=cardinality, group_width=group_width,
                   stem="imagenet", norm_act=norm_act, num_classes=num_classes,
                   in_channels=in_channels)


@register_model(reversible=True, **_CIFAR, paper=_XIE_CIFAR)
def resnext29_iabn(*, num_classes: int = 10, in_channels: int = 3) -> ResNeXt:
    """ResNeXt-29 (8x4d) with In-place ABN: units 3-3-3, widths 32-64-128 (CIFAR)."""
    return _resnext29(_IABN, num_classes, in_channels)


@register_model(reversible=False, **_CIFAR, paper=_XIE_CIFAR)
def resnext29_bn(*, num_classes: int = 10, in_channels: int = 3) -> ResNeXt:
    """ResNeXt-29 (8x4d) with BatchNorm2d + LeakyReLU: the plain twin of resnext29_iabn."""
    return _resnext29(_PLAIN, num_classes, in_channels)


@register_model(reversible=True, **_IMAGENET, paper=_JIANG, paper_params=_XIE_101_PARAMS)
def resnext101_iabn(
    *, num_classes: int = 1000, in_channels: int = 3, cardinality: int = 64, group_width: int = 2
) -> ResNeXt:
    """ResNeXt-101 (64x2d) with In-place ABN, as in the In-place ABN authors' code (ImageNet)."""
    return _resnext101(_IABN, num_classes, in_channels, cardinality, group_width)


@register_model(reversible=False, **_IMAGENET, paper=_JIANG, paper_params=_XIE_101_PARAMS)
def resnext101_bn(
    *, num_classes: int = 1000, in_channels: int = 3, cardinality: int = 64, group_width: int = 2
) -> ResNeXt:
    """ResNeXt-101 (64x2d) with BatchNorm2d + LeakyReLU: the plain twin of resnext101_iabn."""
    return _resnext101(_PLAIN, num_classes, in_channels, cardinality, group_width)
