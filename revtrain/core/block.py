"""``ReversibleBlock``: one RevNet/MemCNN coupling block with a memory mode."""

from __future__ import annotations

from typing import Literal

import torch
from torch import Tensor, nn

from revtrain.core.coupling import Coupling, CouplingLike, FOut, get_coupling
from revtrain.errors import ReversibilityError

__all__ = ["ReversibleBlock", "Mode", "MODES", "split_halves"]

Mode = Literal["M", "C"]
MODES: tuple[str, ...] = ("M", "C")


def normalize_mode(mode: str) -> Mode:
    """Return ``"M"`` or ``"C"``; accept lower case; raise a clear error otherwise."""
    if isinstance(mode, str) and mode.upper() in MODES:
        return mode.upper()  # type: ignore[return-value]
    raise ValueError(
        f"unknown mode {mode!r}: use 'M' (memory-centric: drop the input, rebuild it in backward) "
        "or 'C' (compute-centric: keep what backward needs, like an ordinary layer)"
    )


def split_halves(x: Tensor, split_dim: int) -> tuple[Tensor, Tensor]:
    """Split ``x`` into two equal halves along ``split_dim`` (views, no copy)."""
    if x.dim() == 0 or not -x.dim() <= split_dim < x.dim():
        raise ReversibilityError(
            f"cannot split a tensor of shape {tuple(x.shape)} along dim {split_dim}; pass a "
            "tensor that has that dimension or set split_dim to the channel dimension"
        )
    size = x.shape[split_dim]
    if size % 2:
        raise ReversibilityError(
            f"cannot split dim {split_dim} of size {size} (shape {tuple(x.shape)}) into two equal "
            f"halves; use an even size there (e.g. a 1x1 conv to {size + 1} channels before the "
            "block), or call the block on a pair (x1, x2)"
        )
    x1, x2 = x.chunk(2, dim=split_dim)
    return x1, x2


class ReversibleBlock(nn.Module):
    """A reversible coupling block ``y1 = c(x1, F(x2)), y2 = c(x2, G(y1))``.

    The block works under plain ``loss.backward()`` and ``torch.autograd.grad``. Its mode
    decides what backward costs:

    - ``"M"`` (memory-centric): the input is not kept; backward rebuilds it from the output
      with the inverse, building the graphs of ``F`` and ``G`` once and reusing them for the
      gradients (RevNet Algorithm 1: ``F`` and ``G`` run once more each). Consecutive M-mode
      blocks inside a :class:`~revtrain.core.ReversibleSequence` keep only their last output.
    - ``"C"`` (compute-centric): plain autograd; keeps what backward needs, no extra compute.

    Args:
        f: Module applied to the second half; its output is coupled into the first half.
        g: Module applied to the new first half; its output is coupled into the second half.
        coupling: ``"additive"`` (``y = x + h``), ``"affine"`` (``y = x * exp(s) + t``), or a
            :class:`~revtrain.core.Coupling` instance.
        split_dim: Dimension along which a single input tensor is split in halves.
        mode: ``"M"`` or ``"C"``; can be changed any time through ``block.mode``.
        preserve_rng_state: Capture the random generators before ``F`` and ``G`` in the forward
            and replay them in the rebuild, so dropout inside ``F``/``G`` rebuilds exactly. Turn
            off only when ``F`` and ``G`` use no randomness.
        check_reconstruction: In M-mode, record the norm of each input half in the forward
            (two scalars) and compare it with the rebuilt half in backward: a non-finite rebuild
            raises :class:`~revtrain.errors.ReconstructionError`; a relative drift above
            ``drift_tolerance`` warns, or raises when ``drift_action="raise"``.
        drift_tolerance: Relative difference of norms allowed between input and rebuild.
        drift_action: ``"warn"`` or ``"raise"``.

    Call it on one tensor (split in halves along ``split_dim``, output concatenated) or on a
    pair ``block(x1, x2) -> (y1, y2)``. Forward hooks on the block do not fire for blocks run
    inside an M-mode run of a sequence.
    """

    def __init__(
        self,
        f: nn.Module,
        g: nn.Module,
        coupling: CouplingLike = "additive",
        split_dim: int = 1,
        mode: Mode = "M",
        *,
        preserve_rng_state: bool = True,
        check_reconstruction: bool = True,
        drift_tolerance: float = 1e-3,
        drift_action: Literal["warn", "raise"] = "warn",
    ) -> None:
        super().__init__()
        if not isinstance(f, nn.Module) or not isinstance(g, nn.Module):
            raise TypeError(
                "ReversibleBlock needs F and G as nn.Module instances (wrap a function in a small "
                f"nn.Module); got {type(f).__name__} and {type(g).__name__}"
            )
        if drift_action not in ("warn", "raise"):
            raise ValueError(f"drift_action must be 'warn' or 'raise', got {drift_action!r}")
        self.f = f
        self.g = g
        self.coupling: Coupling = get_coupling(coupling, split_dim)
        self.split_dim = split_dim
        self.mode = mode
        self.preserve_rng_state = preserve_rng_state
        self.check_reconstruction = check_reconstruction
        self.drift_tolerance = float(drift_tolerance)
        self.drift_action = drift_action

    @property
    def mode(self) -> Mode:
        return self._mode

    @mode.setter
    def mode(self, value: str) -> None:
        self._mode = normalize_mode(value)

    def extra_repr(self) -> str:
        return f"mode={self._mode!r}, coupling={self.coupling.name!r}, split_dim={self.split_dim}"

    # -- the coupling itself, shared by every path ------------------------------------------

    def _apply_fn(self, fn: nn.Module, fn_name: str, inp: Tensor, other: Tensor) -> FOut:
        version = inp._version
        h = fn(inp)
        if inp._version != version:
            raise ReversibilityError(
                f"{fn_name} modified its input in place (e.g. nn.ReLU(inplace=True) or x.add_() "
                f"as its first operation), so the block's input cannot be rebuilt; make the first "
                f"operation of {fn_name} out-of-place"
            )
        self.coupling.check_shapes(other, h, self.split_dim, fn_name)
        return h

    def forward_pair(self, x1: Tensor, x2: Tensor) -> tuple[Tensor, Tensor]:
        """The coupling computed directly, under the ambient autograd mode."""
        y1 = self.coupling.forward(x1, self._apply_fn(self.f, "F", x2, x1))
        y2 = self.coupling.forward(x2, self._apply_fn(self.g, "G", y1, x2))
        return y1, y2

    def inverse_pair(self, y1: Tensor, y2: Tensor) -> tuple[Tensor, Tensor]:
        """Rebuild ``(x1, x2)`` from ``(y1, y2)`` under the ambient autograd mode."""
        x2 = self.coupling.inverse(y2, self.g(y1))
        x1 = self.coupling.inverse(y1, self.f(x2))
        return x1, x2

    def inverse(self, y: Tensor, y2: Tensor | None = None) -> Tensor | tuple[Tensor, Tensor]:
        """Rebuild the input from the output: one tensor in, one out; a pair in, a pair out."""
        if y2 is not None:
            return self.inverse_pair(y, y2)
        x1, x2 = self.inverse_pair(*split_halves(y, self.split_dim))
        return torch.cat([x1, x2], dim=self.split_dim)

    # -- entry point -------------------------------------------------------------------------

    def forward(self, x: Tensor, x2: Tensor | None = None) -> Tensor | tuple[Tensor, Tensor]:
        from revtrain.core.function import check_pair, run_m_mode

        pair = x2 is not None
        x1, x2 = (x, x2) if pair else split_halves(x, self.split_dim)
        check_pair(x1, x2)
        if self._mode == "M" and torch.is_grad_enabled():
            return run_m_mode((self,), x1, x2, concat_dim=None if pair else self.split_dim)
        y1, y2 = self.forward_pair(x1, x2)
        return (y1, y2) if pair else torch.cat([y1, y2], dim=self.split_dim)
