"""Batched image transforms in plain torch (no torchvision).

Each transform acts on a whole batch ``(B, C, H, W)`` with vectorised ops and draws its
randomness from an explicit :class:`torch.Generator`, so a batch is a pure function of
(the stored images, the indices, the generator's seed). That is what lets
:class:`~revtrain.data.loader.ResumableLoader` reproduce any batch of any epoch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

__all__ = ["BatchTransform", "random_crop", "random_hflip", "normalize"]


def random_crop(x_bchw: torch.Tensor, padding: int, generator: torch.Generator | None = None) -> torch.Tensor:
    """Zero-pad each image by ``padding`` pixels and crop back to its size at a random offset.

    Equivalent to torchvision's ``RandomCrop(size, padding=padding)`` applied per image, with
    the offset drawn independently for every image in the batch.

    Args:
        x_bchw: Images, shape ``(B, C, H, W)``; padding is with zeros in this tensor's scale.
        padding: Pixels added on every side; ``0`` returns ``x_bchw`` unchanged.
        generator: Source of the offsets.
    """
    if padding <= 0:
        return x_bchw
    b, c, h, w = x_bchw.shape
    padded = F.pad(x_bchw, (padding, padding, padding, padding))  # (B, C, H+2p, W+2p)
    offsets = torch.randint(0, 2 * padding + 1, (2, b), generator=generator)
    windows = padded.unfold(2, h, 1).unfold(3, w, 1)  # view (B, C, 2p+1, 2p+1, H, W)
    return windows[torch.arange(b), :, offsets[0], offsets[1]]  # (B, C, H, W)


def random_hflip(
    x_bchw: torch.Tensor, generator: torch.Generator | None = None, p: float = 0.5
) -> torch.Tensor:
    """Mirror each image left-right with probability ``p``, independently per image."""
    flip = torch.rand(x_bchw.shape[0], generator=generator) < p
    return torch.where(flip[:, None, None, None], x_bchw.flip(-1), x_bchw)


def normalize(x_bchw: torch.Tensor, mean: Sequence[float], std: Sequence[float]) -> torch.Tensor:
    """Per-channel ``(x - mean) / std``; ``mean`` and ``std`` have one entry per channel."""
    m = torch.tensor(mean, dtype=x_bchw.dtype).view(1, -1, 1, 1)
    s = torch.tensor(std, dtype=x_bchw.dtype).view(1, -1, 1, 1)
    return (x_bchw - m) / s


@dataclass(frozen=True, kw_only=True)
class BatchTransform:
    """Turn a batch of stored images into network inputs.

    The result equals, in order: cast to float32 and multiply by ``scale`` (``1/255`` for
    uint8 storage); only when ``train`` is true, random crop with ``crop_padding`` and random
    horizontal flip if ``hflip``; per-channel normalisation. Padded pixels are black (zero
    before normalisation), as with torchvision's ``RandomCrop(padding=...)`` then ``Normalize``.
    """

    scale: float = 1.0
    """Multiplier applied after the cast to float32 (``1/255`` for uint8 images)."""
    mean: tuple[float, ...] | None = None
    """Per-channel mean subtracted last; ``None`` skips normalisation."""
    std: tuple[float, ...] | None = None
    """Per-channel standard deviation divided last; required with ``mean``."""
    train: bool = False
    """Apply the random augmentations below; evaluation transforms leave this false."""
    crop_padding: int = 0
    """Zero padding for the random crop; 0 disables it."""
    hflip: bool = False
    """Random horizontal flip with probability 1/2."""

    def __post_init__(self) -> None:
        if (self.mean is None) != (self.std is None):
            raise ValueError("BatchTransform needs both mean and std, or neither")
        if self.crop_padding < 0:
            raise ValueError(f"crop_padding must be >= 0, got {self.crop_padding}")

    @property
    def is_random(self) -> bool:
        """Whether this transform draws random numbers."""
        return self.train and (self.crop_padding > 0 or self.hflip)

    def __call__(self, x: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
        """Transform a batch ``(B, C, H, W)`` (or ``(B, *shape)`` without augmentation and normalisation).

        Returns a new float32 tensor; ``x`` is never modified.
        """
        if self.is_random:
            # Crop and flip in the stored dtype (1 byte per pixel for uint8): zero padding is
            # black in any scale, so this commutes with the scaling below.
            x = random_crop(x, self.crop_padding, generator)
            if self.hflip:
                x = random_hflip(x, generator)
        out = x.to(torch.float32, copy=True)
        if self.mean is not None and self.std is not None:
            # (x * scale - mean) / std as one in-place multiply-subtract per element.
            gain = torch.tensor([self.scale / s for s in self.std]).view(1, -1, 1, 1)
            shift = torch.tensor([m / s for m, s in zip(self.mean, self.std, strict=True)]).view(1, -1, 1, 1)
            out.mul_(gain).sub_(shift)
        elif self.scale != 1.0:
            out.mul_(self.scale)
        return out

    def for_eval(self) -> BatchTransform:
        """The same scaling and normalisation without augmentation."""
        return BatchTransform(scale=self.scale, mean=self.mean, std=self.std)
