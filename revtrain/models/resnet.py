"""ResNets: the baselines the RevNets are compared against.

Two flavours, each as its paper's authors built it:

- :class:`PreActResNet`: ResNet-32/110/164 (CIFAR) and ResNet-101 (ImageNet) of the RevNet
  paper's Table 2 (Gomez et al. 2017), pre-activation units as in its authors' code
  (``renmengye/revnet-public``): parameter-free pad shortcuts for basic units, a 1x1
  projection (no BN) for bottleneck units, a BN-ReLU before the pooling head.
- :class:`ResNet`: ResNet-18/34/50 as in PETRA (Rivaud et al. 2024), i.e. torchvision's
  post-activation ResNet (1x1 projection + BN shortcuts), with a CIFAR variant that has a 3x3
  stem and no max-pool.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor, nn

from revtrain.models.blocks import (
    ClassifierHead,
    PadShortcut,
    PostActBasic,
    PostActBottleneck,
    PreActBasic,
    PreActBottleneck,
    Stem,
    conv1x1,
    init_weights,
)
from revtrain.models.registry import register_model

__all__ = ["PreActUnit", "PreActResNet", "PostActUnit", "ResNet"]

_GOMEZ = "Gomez et al. 2017 (RevNet), Table 2"
_PETRA = "Rivaud et al. 2024 (PETRA), Table 2"


class PreActUnit(nn.Module):
    """``y = residual(x) + shortcut(x)`` with a pre-activation residual function."""

    def __init__(
        self, in_channels: int, out_channels: int, stride: int, bottleneck: bool, preact: bool
    ):
        super().__init__()
        residual = PreActBottleneck if bottleneck else PreActBasic
        self.residual = residual(in_channels, out_channels, stride, preact)
        if in_channels == out_channels and stride == 1:
            self.shortcut: nn.Module = nn.Identity()
        elif bottleneck:
            self.shortcut = conv1x1(in_channels, out_channels, stride)
        else:
            self.shortcut = PadShortcut(in_channels, out_channels, stride)

    def forward(self, x: Tensor) -> Tensor:
        return self.residual(x) + self.shortcut(x)


class PreActResNet(nn.Module):
    """Pre-activation ResNet in the configuration language of the RevNet paper's Table 2.

    Args:
        units: Residual units per group, e.g. ``(5, 5, 5)`` for ResNet-32.
        filters: Channels of the stem, then of each group, as the table writes them
            (``16-16-32-64``); bottleneck groups output 4x their entry.
        bottleneck: Bottleneck units instead of basic ones.
        imagenet: ImageNet stem (7x7/2 convolution, max-pool) instead of a 3x3 one.
        num_classes: Logits of the classifier.
        in_channels: Channels of the input image.
    """

    def __init__(
        self,
        units: Sequence[int],
        filters: Sequence[int],
        *,
        bottleneck: bool,
        imagenet: bool,
        num_classes: int,
        in_channels: int = 3,
    ):
        super().__init__()
        if len(filters) != len(units) + 1:
            raise ValueError(f"filters needs one entry for the stem and one per group: {filters}")
        widths = [filters[0]] + [f * 4 if bottleneck else f for f in filters[1:]]
        self.stem = Stem(in_channels, widths[0], imagenet)
        stages = []
        for s, n in enumerate(units):
            cin, cout = widths[s], widths[s + 1]
            stride = 1 if s == 0 else 2
            stages.append(
                nn.Sequential(
                    *(
                        PreActUnit(cin if i == 0 else cout, cout, stride if i == 0 else 1,
                                   bottleneck, preact=(s, i) != (0, 0))
                        for i in range(n)
                    )
                )
            )
        self.stages = nn.Sequential(*stages)
        self.head = ClassifierHead(widths[-1], num_classes, pre_activation=True)
        init_weights(self)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.stages(self.stem(x)))


class PostActUnit(nn.Module):
    """torchvision's residual unit: ``ReLU(residual(x) + shortcut(x))``."""

    def __init__(self, in_channels: int, out_channels: int, stride: int, bottleneck: bool):
        super().__init__()
        if bottleneck:
            self.residual: nn.Module = PostActBottleneck(
                in_channels, out_channels // 4, out_channels, stride
            )
        else:
            self.residual = PostActBasic(in_channels, out_channels, stride)
        if in_channels == out_channels and stride == 1:
            self.shortcut: nn.Module = nn.Identity()
        else:
            self.shortcut = nn.Sequential(
                conv1x1(in_channels, out_channels, stride), nn.BatchNorm2d(out_channels)
            )

    def forward(self, x: Tensor) -> Tensor:
        return torch.relu(self.residual(x) + self.shortcut(x))


class ResNet(nn.Module):
    """Post-activation ResNet (He et al. 2015; torchvision), PETRA's ResNet-18/34/50.

    Args:
        units: Residual units per stage, e.g. ``(2, 2, 2, 2)`` for ResNet-18.
        bottleneck: Bottleneck units; stage outputs are then 4x ``64-128-256-512``.
        imagenet: ImageNet stem (7x7/2, max-pool) instead of PETRA's CIFAR stem (3x3/1).
        num_classes: Logits of the classifier.
        in_channels: Channels of the input image.
    """

    def __init__(
        self,
        units: Sequence[int],
        *,
        bottleneck: bool,
        imagenet: bool,
        num_classes: int,
        in_channels: int = 3,
    ):
        super().__init__()
        widths = [64] + [w * (4 if bottleneck else 1) for w in (64, 128, 256, 512)[: len(units)]]
        self.stem = Stem(in_channels, widths[0], imagenet)
        stages = []
        for s, n in enumerate(units):
            cin, cout = widths[s], widths[s + 1]
            stride = 1 if s == 0 else 2
            stages.append(
                nn.Sequential(
                    *(
                        PostActUnit(cin if i == 0 else cout, cout, stride if i == 0 else 1, bottleneck)
                        for i in range(n)
                    )
                )
            )
        self.stages = nn.Sequential(*stages)
        self.head = ClassifierHead(widths[-1], num_classes, pre_activation=False)
        init_weights(self)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.stages(self.stem(x)))


# -- Table 2 of the RevNet paper --------------------------------------------------------------

_CIFAR = dict(reversible=False, dataset="CIFAR-10", num_classes=10, input_size=(3, 32, 32))
_IMAGENET = dict(reversible=False, dataset="ImageNet", num_classes=1000, input_size=(3, 224, 224))


@register_model(**_CIFAR, paper=_GOMEZ, paper_params=0.46e6)
def resnet32(*, num_classes: int = 10, in_channels: int = 3) -> PreActResNet:
    """ResNet-32: basic units 5-5-5, channels 16-16-32-64 (CIFAR)."""
    return PreActResNet((5, 5, 5), (16, 16, 32, 64), bottleneck=False, imagenet=False,
                        num_classes=num_classes, in_channels=in_channels)


@register_model(**_CIFAR, paper=_GOMEZ, paper_params=1.73e6)
def resnet110(*, num_classes: int = 10, in_channels: int = 3) -> PreActResNet:
    """ResNet-110: basic units 18-18-18, channels 16-16-32-64 (CIFAR)."""
    return PreActResNet((18, 18, 18), (16, 16, 32, 64), bottleneck=False, imagenet=False,
                        num_classes=num_classes, in_channels=in_channels)


@register_model(**_CIFAR, paper=_GOMEZ, paper_params=1.70e6)
def resnet164(*, num_classes: int = 10, in_channels: int = 3) -> PreActResNet:
    """ResNet-164: bottleneck units 18-18-18, channels 16-16-32-64 (x4 out; CIFAR)."""
    return PreActResNet((18, 18, 18), (16, 16, 32, 64), bottleneck=True, imagenet=False,
                        num_classes=num_classes, in_channels=in_channels)


@register_model(**_IMAGENET, paper=_GOMEZ, paper_params=44.5e6)
def resnet101(*, num_classes: int = 1000, in_channels: int = 3) -> PreActResNet:
    """ResNet-101: bottleneck units 3-4-23-3, channels 64-64-128-256-512 (x4 out; ImageNet)."""
    return PreActResNet((3, 4, 23, 3), (64, 64, 128, 256, 512), bottleneck=True, imagenet=True,
                        num_classes=num_classes, in_channels=in_channels)


# -- PETRA's ResNet twins ---------------------------------------------------------------------


@register_model(**_CIFAR, paper=_PETRA)
def resnet18(*, num_classes: int = 10, in_channels: int = 3) -> ResNet:
    """ResNet-18, CIFAR stem (3x3 conv, no max-pool) as PETRA trains it on CIFAR-10."""
    return ResNet((2, 2, 2, 2), bottleneck=False, imagenet=False,
                  num_classes=num_classes, in_channels=in_channels)


@register_model(**_IMAGENET, paper=_PETRA, paper_params=11.7e6)
def resnet18_imagenet(*, num_classes: int = 1000, in_channels: int = 3) -> ResNet:
    """ResNet-18, ImageNet stem (7x7/2 conv, max-pool); torchvision's resnet18."""
    return ResNet((2, 2, 2, 2), bottleneck=False, imagenet=True,
                  num_classes=num_classes, in_channels=in_channels)


@register_model(**_CIFAR, paper=_PETRA)
def resnet34(*, num_classes: int = 10, in_channels: int = 3) -> ResNet:
    """ResNet-34, CIFAR stem (3x3 conv, no max-pool) as PETRA trains it on CIFAR-10."""
    return ResNet((3, 4, 6, 3), bottleneck=False, imagenet=False,
                  num_classes=num_classes, in_channels=in_channels)


@register_model(**_IMAGENET, paper=_PETRA, paper_params=21.8e6)
def resnet34_imagenet(*, num_classes: int = 1000, in_channels: int = 3) -> ResNet:
    """ResNet-34, ImageNet stem (7x7/2 conv, max-pool); torchvision's resnet34."""
    return ResNet((3, 4, 6, 3), bottleneck=False, imagenet=True,
                  num_classes=num_classes, in_channels=in_channels)


@register_model(**_CIFAR, paper=_PETRA)
def resnet50(*, num_classes: int = 10, in_channels: int = 3) -> ResNet:
    """ResNet-50, CIFAR stem (3x3 conv, no max-pool) as PETRA trains it on CIFAR-10."""
    return ResNet((3, 4, 6, 3), bottleneck=True, imagenet=False,
                  num_classes=num_classes, in_channels=in_channels)


@register_model(**_IMAGENET, paper=_PETRA, paper_params=25.6e6)
def resnet50_imagenet(*, num_classes: int = 1000, in_channels: int = 3) -> ResNet:
    """ResNet-50, ImageNet stem (7x7/2 conv, max-pool); torchvision's resnet50 (v1.5)."""
    return ResNet((3, 4, 6, 3), bottleneck=True, imagenet=True,
                  num_classes=num_classes, in_channels=in_channels)
