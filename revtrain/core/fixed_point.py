"""A fixed-point grid on which additive couplings rebuild their input exactly (RevNet §3.2).

The halves are kept as multiples of ``2**-f`` in their own float dtype: ``q(t) = round(t * 2**f)
/ 2**f``. Such a value is exact while ``|value| <= 2**(p - f)`` (``p`` = 24 significant bits in
float32, 53 in float64), and sums of two of them are computed exactly within that range, so
``y = x + q(h)`` and ``x = y - q(h)`` are exact inverses while every half stays in range (else
:class:`~revtrain.errors.GridOverflowError`) and ``F`` is deterministic. ``f = 12``: step 2.4e-4,
range ±4096 in float32.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from revtrain.errors import GridOverflowError, ReversibilityError

__all__ = ["FixedPointGrid", "SIGNIFICANT_BITS"]

SIGNIFICANT_BITS = {torch.float32: 24, torch.float64: 53}
"""Significant bits (with the implicit one) of the dtypes a grid can live in."""

_MARK = "_revtrain_grid"


class _RoundToGrid(torch.autograd.Function):
    """``round(t * scale) / scale`` with the gradient passed straight through."""

    @staticmethod
    def forward(ctx, t: Tensor, scale: float) -> Tensor:  # type: ignore[override]
        return t.mul(scale).round_().div_(scale)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None]:  # type: ignore[override]
        return grad, None


@dataclass(frozen=True)
class FixedPointGrid:
    """Multiples of ``2**-fraction_bits``, stored in float32 or float64 tensors."""

    fraction_bits: int = 12
    """Bits after the binary point: the grid step is ``2**-fraction_bits``; the range shrinks
    by the same factor (``±2**(24 - fraction_bits)`` in float32)."""

    def __post_init__(self) -> None:
        if not isinstance(self.fraction_bits, int) or not 0 <= self.fraction_bits <= 40:
            raise ValueError(
                f"fraction_bits must be an integer from 0 to 40, got {self.fraction_bits!r} "
                "(12 gives a grid step of 2.4e-4 and a float32 range of ±4096)"
            )

    @property
    def scale(self) -> float:
        return float(2**self.fraction_bits)

    @property
    def step(self) -> float:
        """The distance between neighbouring grid values."""
        return 2.0**-self.fraction_bits

    def bound(self, dtype: torch.dtype) -> float:
        """Largest magnitude a half may reach in ``dtype`` and stay exact."""
        bits = SIGNIFICANT_BITS.get(dtype)
        if bits is None:
            raise ReversibilityError(
                f"exact (fixed-point) couplings need float32 or float64 halves, got {dtype}: "
                f"{dtype} has too few significant bits for a useful grid. Keep the reversible "
                "stack in float32 (autocast may still run F and G in lower precision)"
            )
        if bits <= self.fraction_bits:
            raise ReversibilityError(
                f"fraction_bits={self.fraction_bits} leaves no integer range in {dtype} "
                f"({bits} significant bits); use fewer fraction bits"
            )
        return float(2 ** (bits - self.fraction_bits))

    def quantize(self, t: Tensor) -> Tensor:
        """``t`` rounded to the grid (straight-through gradient when ``t`` requires grad)."""
        if t.requires_grad and torch.is_grad_enabled():
            return _RoundToGrid.apply(t, self.scale)
        return t.mul(self.scale).round_().div_(self.scale)

    def check(self, tensors: Sequence[Tensor], where: str) -> None:
        """Raise unless every value is finite and within :meth:`bound` (one device sync)."""
        peak = torch.stack([t.detach().abs().amax() for t in tensors if t.numel()]).amax()
        bound = self.bound(tensors[0].dtype)
        value = float(peak)
        if value <= bound:
            return
        if not math.isfinite(value):
            raise GridOverflowError(
                f"{where}: F or G returned non-finite values (NaN or inf) in the forward pass; "
                "the network diverged before any rebuild. Lower the learning rate or check the "
                "input"
            )
        raise GridOverflowError(
            f"{where}: an activation reached {value:.4g}, beyond the fixed-point grid's range "
            f"±{bound:g} (fraction_bits={self.fraction_bits} in {tensors[0].dtype}), where sums "
            "stop being exact. Use fewer fraction bits (a coarser grid with a wider range: "
            f"fraction_bits={max(self.fraction_bits - math.ceil(math.log2(value / bound)) - 1, 0)} "
            "fits this value), normalise the activations, or use float64"
        )

    def mark(self, t: Tensor) -> None:
        """Note that ``t`` is on this grid (until it is modified in place)."""
        setattr(t, _MARK, (self.fraction_bits, t._version))

    def marked(self, t: object) -> bool:
        """Whether ``t`` was marked by :meth:`mark` on this grid and not modified since."""
        return isinstance(t, Tensor) and getattr(t, _MARK, None) == (self.fraction_bits, t._version)
