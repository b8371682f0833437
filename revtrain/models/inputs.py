"""What a model eats: the input specification every registered model carries.

A model's :class:`InputSpec` says the shape of one sample (without the batch dimension), its
dtype and value range, and what its targets are. Everything that needs an input without real
data (the planner, the benchmarks, the zoo tests, ``revtrain plan``) builds it from here
through :func:`revtrain.models.example_batch`, so nothing outside a model guesses channels,
sizes or dtypes (timm keeps ``input_size`` in each model's config for the same reason).

Two kinds exist today:

- ``"image"``: float tensors ``(C, H, W)``, values drawn from a standard normal (what a
  normalised image looks like), targets are class indices below ``num_classes``;
- ``"tokens"``: integer ids ``(T,)`` below ``vocab_size``, targets are the next ids,
  ``(T,)`` as well (language modelling).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Literal

import torch
from torch import Tensor

__all__ = ["InputKind", "InputSpec", "image_input", "token_input"]

InputKind = Literal["image", "tokens"]


@dataclass(frozen=True, kw_only=True)
class InputSpec:
    """The input of one sample and its target."""

    kind: InputKind
    """``"image"`` (float C×H×W, class targets) or ``"tokens"`` (ids, next-id targets)."""
    shape: tuple[int, ...]
    """Shape of one sample, without the batch dimension: ``(C, H, W)`` or ``(T,)``."""
    dtype: torch.dtype = torch.float32
    """Input dtype: a float dtype for images, ``torch.long`` for token ids."""
    num_classes: int
    """Classes of an image model's output, or the vocabulary size of a token model."""

    def __post_init__(self) -> None:
        if self.kind not in ("image", "tokens"):
            raise ValueError(f"InputSpec.kind must be 'image' or 'tokens', got {self.kind!r}")
        if not self.shape or any(int(s) < 1 for s in self.shape):
            raise ValueError(f"InputSpec.shape must be positive sizes, got {self.shape}")
        if self.num_classes < 1:
            raise ValueError(f"InputSpec.num_classes must be >= 1, got {self.num_classes}")
        if self.kind == "tokens" and (self.dtype.is_floating_point or len(self.shape) != 1):
            raise ValueError("a 'tokens' input is a 1-d sequence of integer ids: shape (T,), dtype torch.long")
        if self.kind == "image" and not self.dtype.is_floating_point:
            raise ValueError(f"an 'image' input must have a float dtype, got {self.dtype}")

    @property
    def vocab_size(self) -> int:
        """For token inputs: ids are below this (the same number as ``num_classes``)."""
        return self.num_classes

    def with_changes(
        self,
        *,
        shape: tuple[int, ...] | None = None,
        num_classes: int | None = None,
        dtype: torch.dtype | None = None,
    ) -> InputSpec:
        """A copy with some fields replaced (e.g. 1×8×8 digits for a CIFAR model)."""
        changes: dict[str, object] = {}
        if shape is not None:
            changes["shape"] = tuple(int(s) for s in shape)
        if num_classes is not None:
            changes["num_classes"] = int(num_classes)
        if dtype is not None:
            changes["dtype"] = dtype
        return replace(self, **changes)

    def example(
        self, batch_size: int, device: torch.device | str = "cpu", *, seed: int = 0
    ) -> tuple[Tensor, Tensor]:
        """A random ``(inputs, targets)`` batch of this spec, the same for the same seed.

        Images: inputs ``(B, C, H, W)`` from a standard normal, targets ``(B,)`` class ids.
        Tokens: ids ``(B, T)`` uniform below the vocabulary, targets ``(B, T)``: the inputs
        shifted by one, with one more random id at the end (what a language model predicts).
        """
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        gen = torch.Generator().manual_seed(seed)
        if self.kind == "image":
            x = torch.randn(batch_size, *self.shape, generator=gen).to(self.dtype)  # (B, C, H, W)
            y = torch.randint(0, self.num_classes, (batch_size,), generator=gen)
        else:
            (length,) = self.shape
            ids = torch.randint(0, self.num_classes, (batch_size, length + 1), generator=gen)
            x, y = ids[:, :-1].to(self.dtype), ids[:, 1:].clone()  # (B, T) each
        return x.to(device), y.to(device)


def image_input(channels: int, height: int, width: int, num_classes: int) -> InputSpec:
    """The spec of an image classifier on ``channels × height × width`` float images."""
    return InputSpec(kind="image", shape=(channels, height, width), num_classes=num_classes)


def token_input(context: int, vocab_size: int) -> InputSpec:
    """The spec of a language model on sequences of ``context`` ids below ``vocab_size``."""
    return InputSpec(kind="tokens", shape=(context,), dtype=torch.long, num_classes=vocab_size)
