"""RevNet-18/34/50 as in PETRA (Rivaud et al. 2024, §4.1), for CIFAR and ImageNet inputs.

PETRA turns a ResNet into a RevNet by doubling the channels of every stage (two streams of
the ResNet's width) and making *each residual block one reversible block* with a single
residual function ``F~`` (post-activation, ending in a ReLU) on one stream (PETRA's Fig. 2
and its code, ``async_torch/models/models_RevNet.py``)::

    (x, x~)  ->  (x~ + F~(x), x)          # the updated stream is read by the next block

Our :class:`~revtrain.core.ReversibleBlock` computes ``y1 = x1 + F(x2)``, ``y2 = x2 + G(y1)``.
With one of ``F``, ``G`` a branch that adds nothing (:class:`NoUpdate`), a block updates one
half from the other; alternating which half is updated reproduces PETRA's block exactly,
with the swap of streams expressed as "the other half is read next". So each residual block
of the ResNet is one ``ReversibleBlock``, and PETRA's stages (one per residual block: 10 for
RevNet-18, 18 for RevNet-34/50) map one-to-one onto our modules.

A stage's first block, when it changes stride or channels, is not reversible
(:class:`PetraBasicTransition`, :class:`PetraBottleneckTransition`), as in PETRA.
"""

from __future__ import annotations

import abc
from collections import OrderedDict
from collections.abc import Sequence

import torch
from torch import Tensor, nn

from revtrain.core import ReversibleBlock, ReversibleSequence
from revtrain.models.blocks import (
    ClassifierHead,
    PostActBasic,
    PostActBottleneck,
    Stem,
    conv1x1,
    conv3x3,
    init_weights,
)
from revtrain.models.registry import register_model

__all__ = ["NoUpdate", "PetraBasicTransition", "PetraBottleneckTransition", "PetraRevNet"]

_PETRA = "Rivaud et al. 2024 (PETRA), Table 2"


class NoUpdate(nn.Module):
    """A residual branch that returns zeros, so its half passes through a block unchanged."""

    def forward(self, x: Tensor) -> Tensor:
        return torch.zeros_like(x)


class _Transition(nn.Module, abc.ABC):
    """Split the input into PETRA's ``(x, x~)``; subclasses map them to ``(y, y~)``.

    Args:
        x_half: Which half (0: first, 1: second) holds ``x``, the stream most recently
            updated. The output always puts ``y`` first.
    """

    def __init__(self, x_half: int):
        super().__init__()
        self.x_half = x_half

    def forward(self, inp: Tensor) -> Tensor:
        halves = inp.chunk(2, dim=1)  # (B, C/2, H, W) each
        x, x_tilde = halves[self.x_half], halves[1 - self.x_half]
        return torch.cat(self.streams(x, x_tilde), dim=1)

    @abc.abstractmethod
    def streams(self, x: Tensor, x_tilde: Tensor) -> tuple[Tensor, Tensor]:
        """Map PETRA's two streams ``(x, x~)`` to ``(y, y~)``."""

    def extra_repr(self) -> str:
        return f"x_half={self.x_half}"


class PetraBasicTransition(_Transition):
    """PETRA's downsampling basic block (not reversible), per stream ``in -> out`` channels.

    ``h = ReLU(BN(conv3x3_s(x)))``, ``y = ReLU(BN(conv3x3(h))) + BN(conv1x1_s(x~))``,
    ``y~ = h``: the other stream's new value is the residual function's first activation.
    """

    def __init__(self, in_channels: int, out_channels: int, stride: int, x_half: int):
        super().__init__(x_half)
        self.conv1 = conv3x3(in_channels, out_channels, stride)
        self.bn1 = nn.BatchNorm2d(out_channels)
        self.conv2 = conv3x3(out_channels, out_channels)
        self.bn2 = nn.BatchNorm2d(out_channels)
        self.shortcut = nn.Sequential(
            conv1x1(in_channels, out_channels, stride), nn.BatchNorm2d(out_channels)
        )

    def streams(self, x: Tensor, x_tilde: Tensor) -> tuple[Tensor, Tensor]:
        h = torch.relu(self.bn1(self.conv1(x)))
        y = torch.relu(self.bn2(self.conv2(h))) + self.shortcut(x_tilde)
        return y, h


class PetraBottleneckTransition(_Transition):
    """PETRA's downsampling bottleneck block (not reversible), per stream ``in -> out``.

    ``y = F~_s(x) + BN(conv1x1_s(x~))``, ``y~ = BN(conv1x1_s(x))``: each stream gets its
    own projection shortcut.
    """

    def __init__(self, in_channels: int, mid_channels: int, out_channels: int, stride: int,
                 x_half: int):
        super().__init__(x_half)
        self.residual = PostActBottleneck(in_channels, mid_channels, out_channels, stride,
                                          final_relu=True)
        self.shortcut = nn.Sequential(
            conv1x1(in_channels, out_channels, stride), nn.BatchNorm2d(out_channels)
        )
        self.shortcut_x = nn.Sequential(
            conv1x1(in_channels, out_channels, stride), nn.BatchNorm2d(out_channels)
        )

    def streams(self, x: Tensor, x_tilde: Tensor) -> tuple[Tensor, Tensor]:
        return self.residual(x) + self.shortcut(x_tilde), self.shortcut_x(x)


class PetraRevNet(nn.Module):
    """PETRA's RevNet: a ResNet-18/34/50 with two streams of the ResNet's width.

    Args:
        units: Residual blocks per stage, e.g. ``(2, 2, 2, 2)`` for RevNet-18.
        bottleneck: Bottleneck residual functions (RevNet-50) instead of basic ones.
        imagenet: ImageNet stem (7x7/2 convolution, max-pool) instead of PETRA's CIFAR stem
            (3x3/1 convolution, no max-pool).
        num_classes: Logits of the classifier.
        in_channels: Channels of the input image.

    Each stage is ``stages.<s>``, an ``nn.Sequential`` of an optional ``transition`` and a
    ``reversible`` :class:`~revtrain.core.ReversibleSequence`, one block per residual block.
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
        mids = (64, 128, 256, 512)[: len(units)]
        widths = [64] + [m * (4 if bottleneck else 1) for m in mids]  # per stream
        self.stem = Stem(in_channels, 2 * widths[0], imagenet)
        x_half = 0  # PETRA splits the stem's output as (x, x~)
        stages = []
        for s, n in enumerate(units):
            cin, cout, mid, stride = widths[s], widths[s + 1], mids[s], 1 if s == 0 else 2
            layers: OrderedDict[str, nn.Module] = OrderedDict()
            blocks = []
            for i in range(n):
                if i == 0 and (cin != cout or stride != 1):
                    layers["transition"] = (
                        PetraBottleneckTransition(cin, mid, cout, stride, x_half)
                        if bottleneck
                        else PetraBasicTransition(cin, cout, stride, x_half)
                    )
                    x_half = 0
                    continue
                fn = (
                    PostActBottleneck(cout, mid, cout, final_relu=True)
                    if bottleneck
                    else PostActBasic(cout, cout, final_relu=True)
                )
                if x_half == 0:  # x is the first half: y2 = x2 + F~(x1)
                    blocks.append(ReversibleBlock(NoUpdate(), fn, preserve_rng_state=False))  # no dropout
                else:  # x is the second half: y1 = x1 + F~(x2)
                    blocks.append(ReversibleBlock(fn, NoUpdate(), preserve_rng_state=False))
                x_half = 1 - x_half
            if blocks:
                layers["reversible"] = ReversibleSequence(*blocks)
            stages.append(nn.Sequential(layers))
        self.stages = nn.Sequential(*stages)
        self.head = ClassifierHead(2 * widths[-1], num_classes, pre_activation=False)
        init_weights(self)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.stages(self.stem(x)))


_CIFAR = dict(reversible=True, dataset="CIFAR-10", num_classes=10, input_size=(3, 32, 32))
_IMAGENET = dict(reversible=True, dataset="ImageNet", num_classes=1000, input_size=(3, 224, 224))


@register_model(**_CIFAR, paper=_PETRA)
def revnet18(*, num_classes: int = 10, in_channels: int = 3) -> PetraRevNet:
    """RevNet-18 (PETRA), CIFAR stem: 3x3 conv, no max-pool."""
    return PetraRevNet((2, 2, 2, 2), bottleneck=False, imagenet=False,
                       num_classes=num_classes, in_channels=in_channels)


@register_model(**_IMAGENET, paper=_PETRA, paper_params=12.2e6)
def revnet18_imagenet(*, num_classes: int = 1000, in_channels: int = 3) -> PetraRevNet:
    """RevNet-18 (PETRA), ImageNet stem: 7x7/2 conv, max-pool."""
    return PetraRevNet((2, 2, 2, 2), bottleneck=False, imagenet=True,
                       num_classes=num_classes, in_channels=in_channels)


@register_model(**_CIFAR, paper=_PETRA)
def revnet34(*, num_classes: int = 10, in_channels: int = 3) -> PetraRevNet:
    """RevNet-34 (PETRA), CIFAR stem: 3x3 conv, no max-pool."""
    return PetraRevNet((3, 4, 6, 3), bottleneck=False, imagenet=False,
                       num_classes=num_classes, in_channels=in_channels)


@register_model(**_IMAGENET, paper=_PETRA, paper_params=22.3e6)
def revnet34_imagenet(*, num_classes: int = 1000, in_channels: int = 3) -> PetraRevNet:
    """RevNet-34 (PETRA), ImageNet stem: 7x7/2 conv, max-pool."""
    return PetraRevNet((3, 4, 6, 3), bottleneck=False, imagenet=True,
                       num_classes=num_classes, in_channels=in_channels)


@register_model(**_CIFAR, paper=_PETRA)
def revnet50(*, num_classes: int = 10, in_channels: int = 3) -> PetraRevNet:
    """RevNet-50 (PETRA), CIFAR stem: 3x3 conv, no max-pool."""
    return PetraRevNet((3, 4, 6, 3), bottleneck=True, imagenet=False,
                       num_classes=num_classes, in_channels=in_channels)


@register_model(**_IMAGENET, paper=_PETRA, paper_params=30.4e6)
def revnet50_imagenet(*, num_classes: int = 1000, in_channels: int = 3) -> PetraRevNet:
    """RevNet-50 (PETRA), ImageNet stem: 7x7/2 conv, max-pool."""
    return PetraRevNet((3, 4, 6, 3), bottleneck=True, imagenet=True,
                       num_classes=num_classes, in_channels=in_channels)
