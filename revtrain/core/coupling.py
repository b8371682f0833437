"""Couplings: how the output of ``F``/``G`` is combined with one half of the input.

A coupling is the invertible map ``y = c(x, h)`` of one half ``x`` given ``h``, the output
of ``F`` or ``G`` on the *other* half. A reversible block applies it twice::

    y1 = c(x1, F(x2))        x2 = c⁻¹(y2, G(y1))
    y2 = c(x2, G(y1))        x1 = c⁻¹(y1, F(x2))

Writing your own coupling means subclassing :class:`Coupling` and implementing
:meth:`Coupling.forward` and :meth:`Coupling.inverse`; :meth:`Coupling.vjp` (the gradient
through the coupling itself) and :meth:`Coupling.check_shapes` have generic defaults.
Couplings hold no parameters: put learnable parts in ``F`` and ``G``.

:class:`ExactAdditiveCoupling` keeps the halves on a fixed-point grid so that the rebuild is
bit-exact (``core/fixed_point.py``); :class:`InverseCoupling` is any coupling run backwards
(what a block's memory-saving inverse uses).
"""

from __future__ import annotations

import abc
import math
from collections.abc import Sequence
from typing import Any, Union

import torch
from torch import Tensor

from revtrain.core.fixed_point import FixedPointGrid
from revtrain.errors import ReversibilityError

__all__ = [
    "Coupling",
    "AdditiveCoupling",
    "AffineCoupling",
    "ExactAdditiveCoupling",
    "InverseCoupling",
    "get_coupling",
    "CouplingLike",
]

# What F or G may return: a tensor, or a tuple of tensors for couplings that take several.
FOut = Union[Tensor, tuple[Tensor, ...]]


class Coupling(abc.ABC):
    """Base class of couplings; subclasses implement ``forward`` and ``inverse``."""

    name: str = "custom"

    @abc.abstractmethod
    def forward(self, x: Tensor, h: FOut) -> Tensor:
        """Return ``y = c(x, h)``; ``h`` is the output of F or G on the other half."""

    @abc.abstractmethod
    def inverse(self, y: Tensor, h: FOut) -> Tensor:
        """Return ``x`` such that ``forward(x, h) == y``."""

    def vjp(self, x: Tensor, h: FOut, dy: Tensor) -> tuple[Tensor, FOut]:
        """Return ``(dL/dx, dL/dh)`` given ``dL/dy``; the default differentiates ``forward``."""
        return _vjp_of(self.forward, x, h, dy)

    def inverse_vjp(self, y: Tensor, h: FOut, dx: Tensor) -> tuple[Tensor, FOut]:
        """Return ``(dL/dy, dL/dh)`` given ``dL/dx`` for ``x = inverse(y, h)``; the default
        differentiates ``inverse`` (what a block's memory-saving inverse backpropagates)."""
        return _vjp_of(self.inverse, y, h, dx)

    def prepare_input(self, xs: tuple[Tensor, ...], source: Any) -> tuple[tuple[Tensor, ...], Any]:
        """The state a block maps, from the state it was called with (identity by default).

        Returns the state and ``source`` (what the block was called with) or None when the state
        is no longer just a split of it.
        """
        return xs, source

    def mark_output(self, out: Any) -> None:
        """Note facts about a block's output for the next block (nothing by default)."""

    def check_range(self, ys: Sequence[Tensor], where: str) -> None:
        """Raise when a block's output cannot be inverted exactly (never, by default)."""

    def check_shapes(self, x: Tensor, h: FOut, split_dim: int, fn_name: str) -> None:
        """Raise :class:`ReversibilityError` unless ``h`` fits ``x``; default: same shape."""
        if not isinstance(h, Tensor) or h.shape != x.shape:
            got = _describe(h)
            raise ReversibilityError(
                f"{fn_name} returned {got} for an input half of shape {tuple(x.shape)}; the "
                f"{self.name} coupling needs {fn_name} to return one tensor of the same shape as "
                f"its input half. Make {fn_name} map C/2 channels to C/2 channels and keep the "
                "spatial size (padding='same', stride 1)."
            )

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


class AdditiveCoupling(Coupling):
    """RevNet's coupling ``y = x + h``; exact to rounding, no extra work in backward."""

    name = "additive"

    def forward(self, x: Tensor, h: FOut) -> Tensor:
        return x + h

    def inverse(self, y: Tensor, h: FOut) -> Tensor:
        return y - h

    def vjp(self, x: Tensor, h: FOut, dy: Tensor) -> tuple[Tensor, FOut]:
        return dy, dy

    def inverse_vjp(self, y: Tensor, h: FOut, dx: Tensor) -> tuple[Tensor, FOut]:
        return dx, -dx


class ExactAdditiveCoupling(AdditiveCoupling):
    """RevNet's additive coupling on a fixed-point grid: ``y = x + q(h)``, rebuilt bit-exactly.

    ``q`` rounds to the nearest multiple of ``2**-fraction_bits`` (gradient passed straight
    through; ``core/fixed_point.py``). A block puts its input on the grid unless it comes from
    another exact block; ``x = y - q(F(x2))`` then rebuilds the input bit for bit at any depth
    if ``F`` and ``G`` are deterministic (on CUDA: ``torch.use_deterministic_algorithms``), so
    M-mode gradients equal C-mode's exactly. Out of range, a block raises
    :class:`~revtrain.errors.GridOverflowError` (one device sync per block).

    Args:
        fraction_bits: Bits after the binary point: grid step ``2**-fraction_bits``.
    """

    def __init__(self, fraction_bits: int = 12) -> None:
        self.grid = FixedPointGrid(fraction_bits=fraction_bits)
        self.name = "exact"

    def forward(self, x: Tensor, h: FOut) -> Tensor:
        return x + self.grid.quantize(_single(h, self.name).to(x.dtype))

    def inverse(self, y: Tensor, h: FOut) -> Tensor:
        return y - self.grid.quantize(_single(h, self.name).to(y.dtype))

    def prepare_input(self, xs: tuple[Tensor, ...], source: Any) -> tuple[tuple[Tensor, ...], Any]:
        sources = source if isinstance(source, (tuple, list)) else (source,)
        if all(self.grid.marked(t) for t in sources):
            return xs, source
        quantized = tuple(self.grid.quantize(x) for x in xs)
        self.grid.check(quantized, "the input of an exact block")
        return quantized, None

    def mark_output(self, out: Any) -> None:
        for t in out if isinstance(out, (tuple, list)) else (out,):
            self.grid.mark(t)

    def check_range(self, ys: Sequence[Tensor], where: str) -> None:
        self.grid.check(ys, where)

    def __repr__(self) -> str:
        return f"ExactAdditiveCoupling(fraction_bits={self.grid.fraction_bits})"


class InverseCoupling(Coupling):
    """A coupling run backwards: ``forward`` is the inner ``inverse`` and vice versa."""

    def __init__(self, inner: Coupling) -> None:
        self.inner = inner
        self.name = inner.name

    def forward(self, x: Tensor, h: FOut) -> Tensor:
        return self.inner.inverse(x, h)

    def inverse(self, y: Tensor, h: FOut) -> Tensor:
        return self.inner.forward(y, h)

    def vjp(self, x: Tensor, h: FOut, dy: Tensor) -> tuple[Tensor, FOut]:
        return self.inner.inverse_vjp(x, h, dy)

    def inverse_vjp(self, y: Tensor, h: FOut, dx: Tensor) -> tuple[Tensor, FOut]:
        return self.inner.vjp(y, h, dx)

    def check_shapes(self, x: Tensor, h: FOut, split_dim: int, fn_name: str) -> None:
        self.inner.check_shapes(x, h, split_dim, fn_name)

    def prepare_input(self, xs: tuple[Tensor, ...], source: Any) -> tuple[tuple[Tensor, ...], Any]:
        return self.inner.prepare_input(xs, source)

    def mark_output(self, out: Any) -> None:
        self.inner.mark_output(out)

    def check_range(self, ys: Sequence[Tensor], where: str) -> None:
        self.inner.check_range(ys, where)

    def __repr__(self) -> str:
        return f"InverseCoupling({self.inner!r})"


class AffineCoupling(Coupling):
    """Affine coupling ``y = x * exp(s) + t`` (MemCNN, Glow); ``h`` holds ``(s_raw, t)``.

    ``h`` is either a tuple ``(s_raw, t)`` or one tensor with twice the channels of ``x``
    along the split dimension, read as ``s_raw`` then ``t``.

    Numerical safety: the log-scale is soft-clamped, ``s = b * tanh(s_raw / b)`` with
    ``b = scale_bound``, so ``exp(s)`` lies in ``[e^-b, e^b]``. The forward can neither
    overflow nor divide by a vanishing scale in the inverse, and the clamp is smooth, so
    gradients stay finite; ``s_raw ≈ s`` near zero, which keeps the identity easy to learn.
    """

    name = "affine"

    def __init__(self, scale_bound: float = 2.0, split_dim: int = 1) -> None:
        if not (scale_bound > 0 and math.isfinite(scale_bound)):
            raise ValueError(f"scale_bound must be a positive finite number, got {scale_bound}")
        self.scale_bound = float(scale_bound)
        self.split_dim = split_dim

    def _log_scale_and_shift(self, h: FOut) -> tuple[Tensor, Tensor]:
        if isinstance(h, tuple):
            s_raw, t = h
        else:
            s_raw, t = h.chunk(2, dim=self.split_dim)
        b = self.scale_bound
        return b * torch.tanh(s_raw / b), t

    def forward(self, x: Tensor, h: FOut) -> Tensor:
        s, t = self._log_scale_and_shift(h)
        return x * torch.exp(s) + t

    def inverse(self, y: Tensor, h: FOut) -> Tensor:
        s, t = self._log_scale_and_shift(h)
        return (y - t) * torch.exp(-s)

    def check_shapes(self, x: Tensor, h: FOut, split_dim: int, fn_name: str) -> None:
        fix = (
            f"Make {fn_name} return either a tuple (s, t) of two tensors shaped like its input "
            f"half, or one tensor with twice the channels along dim {split_dim} (s then t)."
        )
        if isinstance(h, tuple):
            if len(h) != 2 or any(not isinstance(p, Tensor) or p.shape != x.shape for p in h):
                raise ReversibilityError(
                    f"{fn_name} returned {_describe(h)} for an input half of shape "
                    f"{tuple(x.shape)}; the affine coupling needs (s, t). {fix}"
                )
            return
        expected = list(x.shape)
        expected[split_dim] *= 2
        if not isinstance(h, Tensor) or list(h.shape) != expected:
            raise ReversibilityError(
                f"{fn_name} returned {_describe(h)} for an input half of shape {tuple(x.shape)}; "
                f"the affine coupling needs shape {tuple(expected)}. {fix}"
            )

    def __repr__(self) -> str:
        return f"AffineCoupling(scale_bound={self.scale_bound})"


CouplingLike = Union[str, Coupling]


def get_coupling(coupling: CouplingLike, split_dim: int = 1) -> Coupling:
    """Return a :class:`Coupling` from a name (``"additive"``, ``"affine"``) or an instance."""
    if isinstance(coupling, Coupling):
        if isinstance(coupling, torch.nn.Module) and any(True for _ in coupling.parameters()):
            raise ReversibilityError("couplings must not hold parameters; move them into F or G")
        if isinstance(coupling, AffineCoupling):
            coupling.split_dim = split_dim
        return coupling
    if coupling == "additive":
        return AdditiveCoupling()
    if coupling == "affine":
        return AffineCoupling(split_dim=split_dim)
    if coupling == "exact":
        return ExactAdditiveCoupling()
    raise ValueError(
        f"unknown coupling {coupling!r}; use 'additive', 'affine', 'exact', or an instance of a "
        "revtrain.core.Coupling subclass implementing forward(x, h) and inverse(y, h)"
    )


def _vjp_of(fn: Any, x: Tensor, h: FOut, dy: Tensor) -> tuple[Tensor, FOut]:
    """``(d/dx, d/dh)`` of ``fn(x, h)`` against ``dy``, by autograd on the elementwise op."""
    with torch.enable_grad():
        x_ = x.detach().requires_grad_(True)
        hs = _as_tuple(h)
        hs_ = tuple(t.detach().requires_grad_(True) for t in hs)
        y = fn(x_, hs_ if isinstance(h, tuple) else hs_[0])
        grads = torch.autograd.grad(y, (x_, *hs_), dy, allow_unused=True)
    dx = grads[0] if grads[0] is not None else torch.zeros_like(x)
    dhs = tuple(g if g is not None else torch.zeros_like(t) for g, t in zip(grads[1:], hs))
    return dx, (dhs if isinstance(h, tuple) else dhs[0])


def _single(h: FOut, name: str) -> Tensor:
    if not isinstance(h, Tensor):
        raise ReversibilityError(f"the {name} coupling needs F and G to return one tensor, got {_describe(h)}")
    return h


def _as_tuple(h: FOut) -> tuple[Tensor, ...]:
    return h if isinstance(h, tuple) else (h,)


def _describe(h: object) -> str:
    if isinstance(h, Tensor):
        return f"a tensor of shape {tuple(h.shape)}"
    if isinstance(h, tuple):
        return "a tuple of " + ", ".join(_describe(p) for p in h)
    return f"a {type(h).__name__}"
