"""RevNets of the RevNet paper (Gomez et al. 2017, Table 2): RevNet-38/110/164 and RevNet-104.

A RevNet mirrors a pre-activation ResNet (:class:`~revtrain.models.resnet.PreActResNet`)
with each residual unit replaced by a reversible unit on the two channel halves::

    y1 = x1 + F(x2)        F, G: residual functions on C/2 channels
    y2 = x2 + G(y1)

Units that keep shape are :class:`~revtrain.core.ReversibleBlock` s, and the consecutive
ones of a group sit in one :class:`~revtrain.core.ReversibleSequence` (in M-mode the whole
run keeps a single output, which is what makes activation memory flat in depth). The first
unit of a group that changes stride or channels cannot be inverted; as in the authors' code
(``renmengye/revnet-public``, ``revnet_model.py``) it is an ordinary layer of the same shape of
computation (:class:`RevTransition`) whose input autograd keeps.

The model knows nothing about memory modes; set them from outside with
:func:`revtrain.core.set_modes`.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

import torch
from torch import Tensor, nn

from revtrain.core import ReversibleBlock, ReversibleSequence
from revtrain.models.blocks import (
    ClassifierHead,
    PadShortcut,
    PreActBasic,
    PreActBottleneck,
    Stem,
    conv1x1,
    init_weights,
)
from revtrain.models.registry import register_model

__all__ = ["RevTransition", "RevNet"]

_GOMEZ = "Gomez et al. 2017 (RevNet), Table 2"


def _residual(bottleneck: bool) -> type[nn.Module]:
    return PreActBottleneck if bottleneck else PreActBasic


class RevTransition(nn.Module):
    """A group's first unit when it changes stride or channels; not reversible.

    ``y1 = F(x2) + s1(x1)``, ``y2 = G(y1) + s2(x2)``, with ``F`` strided and widening, and
    shortcuts ``s1``, ``s2`` on each half: average-pool plus channel zero-padding for basic
    units, a 1x1 projection each for bottleneck units (the authors' ``_possible_downsample``
    and ``_possible_bottleneck_downsample``).

    Args:
        in_channels: Input channels (both halves).
        out_channels: Output channels (both halves).
        stride: Stride of ``F`` and the shortcuts.
        bottleneck: Bottleneck residual functions instead of basic ones.
        preact: Whether ``F`` starts with BN-ReLU (False right after the stem).
    """

    def __init__(
        self, in_channels: int, out_channels: int, stride: int, bottleneck: bool, preact: bool
    ):
        super().__init__()
        half_in, half_out = in_channels // 2, out_channels // 2
        residual = _residual(bottleneck)
        self.f = residual(half_in, half_out, stride, preact)
        self.g = residual(half_out, half_out, 1, True)
        if bottleneck:
            self.shortcut1: nn.Module = conv1x1(half_in, half_out, stride)
            self.shortcut2: nn.Module = conv1x1(half_in, half_out, stride)
        else:
            self.shortcut1 = PadShortcut(half_in, half_out, stride)
            self.shortcut2 = PadShortcut(half_in, half_out, stride)

    def forward(self, x: Tensor) -> Tensor:
        x1, x2 = x.chunk(2, dim=1)  # (B, C/2, H, W) each
        y1 = self.f(x2) + self.shortcut1(x1)
        y2 = self.g(y1) + self.shortcut2(x2)
        return torch.cat([y1, y2], dim=1)


class RevNet(nn.Module):
    """A RevNet in the configuration language of Table 2 (units and channels per group).

    Args:
        units: Reversible units per group, e.g. ``(3, 3, 3)`` for RevNet-38.
        filters: Channels (both halves together) of the stem, then of each group, as the
            table writes them (``32-32-64-112``); bottleneck groups output 4x their entry.
        bottleneck: Bottleneck residual functions instead of basic ones.
        imagenet: ImageNet stem (7x7/2 convolution, max-pool) instead of a 3x3 one.
        num_classes: Logits of the classifier.
        in_channels: Channels of the input image.

    Each group is ``stages.<s>``, an ``nn.Sequential`` of an optional ``transition``
    (:class:`RevTransition`) and a ``reversible`` :class:`~revtrain.core.ReversibleSequence`.
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
        residual = _residual(bottleneck)
        self.stem = Stem(in_channels, widths[0], imagenet)
        stages = []
        for s, n in enumerate(units):
            cin, cout, stride = widths[s], widths[s + 1], 1 if s == 0 else 2
            layers: OrderedDict[str, nn.Module] = OrderedDict()
            blocks = []
            for i in range(n):
                # Only the unit right after the stem skips its pre-activation: the stem ends
                # with BN-ReLU (the authors' `no_activation`).
                preact = (s, i) != (0, 0)
                if i == 0 and (cin != cout or stride != 1):
                    layers["transition"] = RevTransition(cin, cout, stride, bottleneck, preact)
                    continue
                half = cout // 2
                # No dropout in F or G: nothing to capture for the rebuild.
                blocks.append(ReversibleBlock(residual(half, half, 1, preact), residual(half, half),
                                              preserve_rng_state=False))
            if blocks:
                layers["reversible"] = ReversibleSequence(*blocks)
            stages.append(nn.Sequential(layers))
        self.stages = nn.Sequential(*stages)
        self.head = ClassifierHead(widths[-1], num_classes, pre_activation=True)
        init_weights(self)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.stages(self.stem(x)))


_CIFAR = dict(reversible=True, dataset="CIFAR-10", num_classes=10, input_size=(3, 32, 32))
_IMAGENET = dict(reversible=True, dataset="ImageNet", num_classes=1000, input_size=(3, 224, 224))


@register_model(**_CIFAR, paper=_GOMEZ, paper_params=0.46e6)
def revnet38(*, num_classes: int = 10, in_channels: int = 3) -> RevNet:
    """RevNet-38: basic units 3-3-3, channels 32-32-64-112 (CIFAR)."""
    return RevNet((3, 3, 3), (32, 32, 64, 112), bottleneck=False, imagenet=False,
                  num_classes=num_classes, in_channels=in_channels)


@register_model(**_CIFAR, paper=_GOMEZ, paper_params=1.73e6)
def revnet110(*, num_classes: int = 10, in_channels: int = 3) -> RevNet:
    """RevNet-110: basic units 9-9-9, channels 32-32-64-128 (CIFAR)."""
    return RevNet((9, 9, 9), (32, 32, 64, 128), bottleneck=False, imagenet=False,
                  num_classes=num_classes, in_channels=in_channels)


@register_model(**_CIFAR, paper=_GOMEZ, paper_params=1.75e6)
def revnet164(*, num_classes: int = 10, in_channels: int = 3) -> RevNet:
    """RevNet-164: bottleneck units 9-9-9, channels 32-32-64-128 (x4 out; CIFAR)."""
    return RevNet((9, 9, 9), (32, 32, 64, 128), bottleneck=True, imagenet=False,
                  num_classes=num_classes, in_channels=in_channels)


@register_model(**_IMAGENET, paper=_GOMEZ, paper_params=45.2e6)
def revnet104(*, num_classes: int = 1000, in_channels: int = 3) -> RevNet:
    """RevNet-104: bottleneck units 2-2-11-2, channels 128-128-256-512-832 (x4 out; ImageNet)."""
    return RevNet((2, 2, 11, 2), (128, 128, 256, 512, 832), bottleneck=True, imagenet=True,
                  num_classes=num_classes, in_channels=in_channels)
