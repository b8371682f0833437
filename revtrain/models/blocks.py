"""Layers shared by the zoo: residual functions, shortcuts, stems and classifier heads.

Two families of residual function appear in the papers we reproduce:

- *pre-activation* (He et al. 2016, "v2"), used by the RevNet paper (Gomez et al. 2017,
  Eq. 3: ``a(x) = ReLU(BN(x))``, ``c_k(x) = Conv_kxk(a(x))``) and its authors' code for both
  the RevNets and the ResNets of Table 2;
- *post-activation* (He et al. 2015, "v1", torchvision's ResNet), used by PETRA (Rivaud et al.
  2024) for ResNet-18/34/50 and, with a final ReLU, for the residual function of its RevNets.

Every module here is plain PyTorch. Convolutions have no bias (each is followed by BN).
"""

from __future__ import annotations

from collections import OrderedDict

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = [
    "conv1x1",
    "conv3x3",
    "PreActBasic",
    "PreActBottleneck",
    "PostActBasic",
    "PostActBottleneck",
    "PadShortcut",
    "Stem",
    "ClassifierHead",
    "init_weights",
]


def conv3x3(in_channels: int, out_channels: int, stride: int = 1) -> nn.Conv2d:
    """3x3 convolution with 'same' padding and no bias."""
    return nn.Conv2d(in_channels, out_channels, 3, stride=stride, padding=1, bias=False)


def conv1x1(in_channels: int, out_channels: int, stride: int = 1) -> nn.Conv2d:
    """Point-wise convolution with no bias."""
    return nn.Conv2d(in_channels, out_channels, 1, stride=stride, bias=False)


def _bn_relu(channels: int) -> list[tuple[str, nn.Module]]:
    return [("bn", nn.BatchNorm2d(channels)), ("relu", nn.ReLU(inplace=True))]


def _numbered(layers: list[tuple[str, nn.Module]]) -> OrderedDict[str, nn.Module]:
    """Name layers by kind and count: ``bn1, relu1, conv1, bn2, ...``."""
    named: OrderedDict[str, nn.Module] = OrderedDict()
    counts: dict[str, int] = {}
    for kind, layer in layers:
        counts[kind] = counts.get(kind, 0) + 1
        named[f"{kind}{counts[kind]}"] = layer
    return named


class PreActBasic(nn.Sequential):
    """Pre-activation basic residual function ``c3(c3(x))``: [BN-ReLU]-conv3x3-BN-ReLU-conv3x3.

    Args:
        in_channels: Input channels.
        out_channels: Output channels.
        stride: Stride of the first convolution.
        preact: Start with BN-ReLU. False for the first unit after the stem, whose input has
            just been through BN-ReLU (the authors' ``no_activation``).
    """

    def __init__(self, in_channels: int, out_channels: int, stride: int = 1, preact: bool = True):
        layers: list[tuple[str, nn.Module]] = _bn_relu(in_channels) if preact else []
        layers += [("conv", conv3x3(in_channels, out_channels, stride))]
        layers += _bn_relu(out_channels) + [("conv", conv3x3(out_channels, out_channels))]
        super().__init__(_numbered(layers))


class PreActBottleneck(nn.Sequential):
    """Pre-activation bottleneck ``c1(c3(c1(x)))`` with a 4x narrower middle.

    [BN-ReLU]-conv1x1(stride)-BN-ReLU-conv3x3-BN-ReLU-conv1x1. The stride sits on the first
    1x1 convolution, as in the RevNet authors' code. Arguments as :class:`PreActBasic`.
    """

    def __init__(self, in_channels: int, out_channels: int, stride: int = 1, preact: bool = True):
        mid = out_channels // 4
        layers: list[tuple[str, nn.Module]] = _bn_relu(in_channels) if preact else []
        layers += [("conv", conv1x1(in_channels, mid, stride))]
        layers += _bn_relu(mid) + [("conv", conv3x3(mid, mid))]
        layers += _bn_relu(mid) + [("conv", conv1x1(mid, out_channels))]
        super().__init__(_numbered(layers))


class PostActBasic(nn.Sequential):
    """Post-activation basic residual function: conv3x3(stride)-BN-ReLU-conv3x3-BN[-ReLU].

    Args:
        in_channels: Input channels.
        out_channels: Output channels.
        stride: Stride of the first convolution.
        final_relu: End with a ReLU. torchvision's ResNet applies it after the addition
            instead (False); PETRA's reversible residual function ends with it (True).
    """

    def __init__(
        self, in_channels: int, out_channels: int, stride: int = 1, final_relu: bool = False
    ):
        layers: list[tuple[str, nn.Module]] = [("conv", conv3x3(in_channels, out_channels, stride))]
        layers += _bn_relu(out_channels)
        layers += [("conv", conv3x3(out_channels, out_channels)), ("bn", nn.BatchNorm2d(out_channels))]
        if final_relu:
            layers += [("relu", nn.ReLU(inplace=True))]
        super().__init__(_numbered(layers))


class PostActBottleneck(nn.Sequential):
    """Post-activation bottleneck: conv1x1-BN-ReLU-conv3x3(stride)-BN-ReLU-conv1x1-BN[-ReLU].

    The stride sits on the 3x3 convolution (torchvision's "ResNet v1.5", PETRA's code).

    Args:
        in_channels: Input channels.
        mid_channels: Channels of the 3x3 convolution.
        out_channels: Output channels.
        stride: Stride of the 3x3 convolution.
        final_relu: As in :class:`PostActBasic`.
    """

    def __init__(
        self,
        in_channels: int,
        mid_channels: int,
        out_channels: int,
        stride: int = 1,
        final_relu: bool = False,
    ):
        layers: list[tuple[str, nn.Module]] = [("conv", conv1x1(in_channels, mid_channels))]
        layers += _bn_relu(mid_channels) + [("conv", conv3x3(mid_channels, mid_channels, stride))]
        layers += _bn_relu(mid_channels) + [("conv", conv1x1(mid_channels, out_channels))]
        layers += [("bn", nn.BatchNorm2d(out_channels))]
        if final_relu:
            layers += [("relu", nn.ReLU(inplace=True))]
        super().__init__(_numbered(layers))


class PadShortcut(nn.Module):
    """Parameter-free shortcut: average-pool by ``stride``, zero-pad channels on both sides.

    The RevNet authors' ``_possible_downsample`` ("option A" of He et al. 2015). Pooling uses
    ``ceil_mode`` so the output size equals that of a stride-``stride`` 3x3 convolution with
    padding 1 for every input size, odd or as small as 1x1 (the 8x8 digits).
    """

    def __init__(self, in_channels: int, out_channels: int, stride: int = 1):
        super().__init__()
        if out_channels < in_channels or (out_channels - in_channels) % 2:
            raise ValueError(
                f"PadShortcut pads channels symmetrically: out_channels ({out_channels}) must be "
                f"in_channels ({in_channels}) plus an even number"
            )
        self.stride = stride
        self.pad = (out_channels - in_channels) // 2

    def forward(self, x: Tensor) -> Tensor:
        if self.stride > 1:
            x = F.avg_pool2d(x, self.stride, self.stride, ceil_mode=True, count_include_pad=False)
        if self.pad:
            x = F.pad(x, (0, 0, 0, 0, self.pad, self.pad))  # (B, C, H, W): pad C only
        return x

    def extra_repr(self) -> str:
        return f"stride={self.stride}, pad_channels={self.pad}"


class Stem(nn.Sequential):
    """Input layer: conv-BN-ReLU, plus a 3x3/2 max-pool in the ImageNet variant.

    Args:
        in_channels: Image channels (3 for RGB, 1 for the digits).
        out_channels: Channels after the stem.
        imagenet: 7x7/2 convolution and max-pool (ImageNet) instead of a 3x3/1 convolution
            (CIFAR, digits).
    """

    def __init__(self, in_channels: int, out_channels: int, imagenet: bool):
        kernel, stride = (7, 2) if imagenet else (3, 1)
        layers: OrderedDict[str, nn.Module] = OrderedDict(
            conv=nn.Conv2d(in_channels, out_channels, kernel, stride, kernel // 2, bias=False),
            bn=nn.BatchNorm2d(out_channels),
            relu=nn.ReLU(inplace=True),
        )
        if imagenet:
            layers["pool"] = nn.MaxPool2d(3, stride=2, padding=1)
        super().__init__(layers)


class ClassifierHead(nn.Sequential):
    """[BN-ReLU]-global average pool-linear; the adaptive pool accepts any spatial size.

    Args:
        channels: Input channels.
        num_classes: Output logits.
        pre_activation: Start with BN-ReLU (pre-activation networks end their last unit with a
            convolution, so the head normalises first).
    """

    def __init__(self, channels: int, num_classes: int, pre_activation: bool):
        layers: OrderedDict[str, nn.Module] = OrderedDict()
        if pre_activation:
            layers["bn"] = nn.BatchNorm2d(channels)
            layers["relu"] = nn.ReLU(inplace=True)
        layers["pool"] = nn.AdaptiveAvgPool2d(1)
        layers["flatten"] = nn.Flatten(1)
        layers["fc"] = nn.Linear(channels, num_classes)
        super().__init__(layers)


@torch.no_grad()
def init_weights(model: nn.Module) -> None:
    """He-normal (fan-out) convolutions, unit BN scales, zero BN shifts (as both codebases)."""
    for module in model.modules():
        if isinstance(module, nn.Conv2d):
            nn.init.kaiming_normal_(module.weight, mode="fan_out", nonlinearity="relu")
        elif isinstance(module, nn.BatchNorm2d):
            nn.init.ones_(module.weight)
            nn.init.zeros_(module.bias)
