"""A reversible ViT-style encoder for image classification, and its plain twin.

The image is cut into ``patch × patch`` patches, each mapped to a ``D``-vector by one strided
convolution, plus a learned position vector per patch. The reversible model duplicates the
patch tokens into two streams and runs reversible blocks with bidirectional (not causal)
attention as ``F`` and a feed-forward as ``G`` (the same modules as the language models,
:mod:`revtrain.models.transformer_layers`); the streams are merged by their mean. The head is
a LayerNorm, the mean over patches and a linear classifier (no class token, so nothing but the
patches flows through the reversible stack). The plain twin :class:`ViT` uses ordinary pre-LN
residuals and has the same parameters.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from revtrain.core import ReversibleBlock, ReversibleSequence
from revtrain.models.registry import register_model
from revtrain.models.transformer import ResidualLayer
from revtrain.models.transformer_layers import (
    FeedForward,
    SelfAttention,
    check_heads,
    init_transformer_weights,
    run_stack,
)

__all__ = ["PatchEmbedding", "RevViT", "ViT", "ViTConfig"]


@dataclass(kw_only=True)
class ViTConfig:
    """The shape and options of a ViT-style classifier (both twins)."""

    image_size: int = 32
    """Height and width of the (square) input images."""
    patch_size: int = 4
    """Side of a patch; must divide ``image_size``. Tokens = (image_size / patch_size)²."""
    in_channels: int = 3
    """Channels of the input images."""
    num_classes: int = 10
    """Logits of the classifier."""
    width: int = 128
    """Features ``D`` of a stream (the reversible model carries two)."""
    depth: int = 6
    """Layers: one attention and one feed-forward each."""
    heads: int = 4
    """Attention heads; must divide ``width``."""
    ff_mult: int = 4
    """Hidden features of the feed-forward, as a multiple of ``width``."""
    dropout: float = 0.0
    """Dropout on the patch embedding, the attention probabilities and both residual branches."""

    def __post_init__(self) -> None:
        for name in ("image_size", "patch_size", "in_channels", "num_classes", "depth", "ff_mult"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"ViTConfig.{name} must be a positive integer, got {value!r}")
        if self.image_size % self.patch_size:
            raise ValueError(
                f"patch_size={self.patch_size} does not divide image_size={self.image_size}; use an image size "
                f"that is a multiple of {self.patch_size} (or build the model from a ViTConfig whose patch size "
                "tiles the image)"
            )
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {self.dropout!r}")
        check_heads(self.width, self.heads, rotary=False, owner="ViTConfig")

    @property
    def num_patches(self) -> int:
        return (self.image_size // self.patch_size) ** 2

    def layer(self) -> tuple[SelfAttention, FeedForward]:
        """One layer's residual functions: bidirectional attention and feed-forward."""
        attn = SelfAttention(self.width, self.heads, causal=False, dropout=self.dropout)
        ff = FeedForward(self.width, self.ff_mult * self.width, dropout=self.dropout)
        return attn, ff


class PatchEmbedding(nn.Module):
    """Images ``(B, C, H, W)`` to patch tokens ``(B, N, D)`` with learned positions."""

    def __init__(self, config: ViTConfig) -> None:
        super().__init__()
        self.image_shape = (config.in_channels, config.image_size, config.image_size)
        p = config.patch_size
        self.proj = nn.Conv2d(config.in_channels, config.width, kernel_size=p, stride=p)
        self.positions = nn.Parameter(torch.zeros(config.num_patches, config.width))
        self.drop = nn.Dropout(config.dropout)

    def forward(self, x: Tensor) -> Tensor:
        if x.dim() != 4 or tuple(x.shape[1:]) != self.image_shape:
            raise ValueError(
                f"this ViT takes images of shape (batch, {', '.join(map(str, self.image_shape))}); "
                f"got {tuple(x.shape)}. Build it for your images with "
                "create_model(name, in_channels=..., image_size=...)"
            )
        h = self.proj(x).flatten(2).transpose(1, 2)  # (B, N, D)
        return self.drop(h + self.positions)


class _Classifier(nn.Module):
    """LayerNorm, mean over patches, linear classifier."""

    def __init__(self, config: ViTConfig) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(config.width)
        self.fc = nn.Linear(config.width, config.num_classes)

    def forward(self, h: Tensor) -> Tensor:
        return self.fc(self.norm(h).mean(dim=1))  # (B, classes)


class _Encoder(nn.Module):
    def __init__(self, config: ViTConfig) -> None:
        super().__init__()
        self.config = config
        self.embed = PatchEmbedding(config)

    def _finish(self) -> None:
        self.head = _Classifier(self.config)
        init_transformer_weights(self, self.config.depth)
        nn.init.normal_(self.embed.positions, std=0.02)

    def forward(self, x: Tensor) -> Tensor:
        """Class logits ``(B, classes)`` for images ``(B, C, H, W)``."""
        return self.head(run_stack(self.layers, self.embed(x)))


class RevViT(_Encoder):
    """Reversible ViT: patch tokens in two streams through reversible attention/FF blocks.

    Module names: ``embed``, ``layers`` (a :class:`~revtrain.core.ReversibleSequence`, block
    ``i`` is ``layers.blocks.i``), ``head``.
    """

    def __init__(self, config: ViTConfig) -> None:
        super().__init__(config)
        self.layers = ReversibleSequence([ReversibleBlock(*config.layer(), split_dim=-1, preserve_rng_state=config.dropout > 0)
                                          for _ in range(config.depth)])  # replay dropout where there is some
        self._finish()


class ViT(_Encoder):
    """The plain twin of :class:`RevViT`: same modules, ordinary pre-LN residuals."""

    def __init__(self, config: ViTConfig) -> None:
        super().__init__(config)
        self.layers = nn.Sequential(*(ResidualLayer(*config.layer()) for _ in range(config.depth)))
        self._finish()


# ----------------------------------------------------------------------------- the zoo

_DIGITS = dict(image_size=8, patch_size=2, width=64, depth=4, heads=4)
_CIFAR = dict(image_size=32, patch_size=4, width=128, depth=6, heads=4)
_PAPER = "revtrain (ViT-style, Reformer blocks)"


def _vit(cls: type[_Encoder], shape: dict[str, int], num_classes: int, in_channels: int,
         image_size: int | None, dropout: float) -> _Encoder:
    config = ViTConfig(**{**shape, "image_size": image_size or shape["image_size"]},
                       num_classes=num_classes, in_channels=in_channels, dropout=dropout)
    return cls(config)


@register_model(reversible=True, dataset="digits", num_classes=10, input_size=(1, 8, 8), paper=_PAPER)
def revvit_digits(*, num_classes: int = 10, in_channels: int = 1, image_size: int | None = None,
                  dropout: float = 0.0) -> RevViT:
    """Reversible ViT for 8x8 digits: 2x2 patches (16 tokens), 4 layers, width 64, 4 heads."""
    return _vit(RevViT, _DIGITS, num_classes, in_channels, image_size, dropout)  # type: ignore[return-value]


@register_model(reversible=False, dataset="digits", num_classes=10, input_size=(1, 8, 8), paper=_PAPER)
def vit_digits(*, num_classes: int = 10, in_channels: int = 1, image_size: int | None = None,
               dropout: float = 0.0) -> ViT:
    """Plain twin of revvit_digits: 2x2 patches, 4 layers, width 64, 4 heads."""
    return _vit(ViT, _DIGITS, num_classes, in_channels, image_size, dropout)  # type: ignore[return-value]


@register_model(reversible=True, dataset="CIFAR-10", num_classes=10, input_size=(3, 32, 32), paper=_PAPER)
def revvit_cifar(*, num_classes: int = 10, in_channels: int = 3, image_size: int | None = None,
                 dropout: float = 0.0) -> RevViT:
    """Reversible ViT for 32x32 CIFAR: 4x4 patches (64 tokens), 6 layers, width 128, 4 heads."""
    return _vit(RevViT, _CIFAR, num_classes, in_channels, image_size, dropout)  # type: ignore[return-value]


@register_model(reversible=False, dataset="CIFAR-10", num_classes=10, input_size=(3, 32, 32), paper=_PAPER)
def vit_cifar(*, num_classes: int = 10, in_channels: int = 3, image_size: int | None = None,
              dropout: float = 0.0) -> ViT:
    """Plain twin of revvit_cifar: 4x4 patches, 6 layers, width 128, 4 heads."""
    return _vit(ViT, _CIFAR, num_classes, in_channels, image_size, dropout)  # type: ignore[return-value]
