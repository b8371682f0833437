"""``ReversibleBlock``: one RevNet/MemCNN coupling block with a memory mode."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import Tensor, nn

from revtrain.core.coupling import Coupling, CouplingLike, FOut, get_coupling
from revtrain.core.function import check_state, run_reversible
from revtrain.core.invertible import MODES, Invertible, Mode, normalize_mode, replay, trainable_params
from revtrain.core.replay import RngState
from revtrain.core.step import Grads, State, StepResult, autograd_grads
from revtrain.errors import ReversibilityError

__all__ = ["ReversibleBlock", "Mode", "MODES", "normalize_mode", "split_halves"]


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


@dataclass
class _CouplingRecord:
    """What the forward leaves for one block's rebuild: the generators before F and before G."""

    rng_f: RngState | None
    rng_g: RngState | None


class ReversibleBlock(Invertible):
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
        super().__init__(
            mode,
            preserve_rng_state=preserve_rng_state,
            check_reconstruction=check_reconstruction,
            drift_tolerance=drift_tolerance,
            drift_action=drift_action,
        )
        if not isinstance(f, nn.Module) or not isinstance(g, nn.Module):
            raise TypeError(
                "ReversibleBlock needs F and G as nn.Module instances (wrap a function in a small "
                f"nn.Module); got {type(f).__name__} and {type(g).__name__}"
            )
        self.f = f
        self.g = g
        self.coupling: Coupling = get_coupling(coupling, split_dim)
        self.split_dim = split_dim

    def extra_repr(self) -> str:
        return f"mode={self._mode!r}, coupling={self.coupling.name!r}, split_dim={self.split_dim}"

    # -- the coupling itself, shared by every path ------------------------------------------

    def checked_call(self, fn: nn.Module, fn_name: str, inp: Tensor, other: Tensor) -> FOut:
        """``fn(inp)``, refusing an ``fn`` that edits its input in place or whose output does
        not fit the coupling with ``other`` (the half it is coupled into)."""
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
        y1 = self.coupling.forward(x1, self.checked_call(self.f, "F", x2, x1))
        y2 = self.coupling.forward(x2, self.checked_call(self.g, "G", y1, x2))
        return y1, y2

    def inverse_pair(self, y1: Tensor, y2: Tensor) -> tuple[Tensor, Tensor]:
        """Rebuild ``(x1, x2)`` from ``(y1, y2)`` under the ambient autograd mode."""
        x2 = self.coupling.inverse(y2, self.g(y1))
        x1 = self.coupling.inverse(y1, self.f(x2))
        return x1, x2

    def inverse(self, y: Tensor, y2: Tensor | None = None) -> Tensor | tuple[Tensor, Tensor]:  # type: ignore[override]
        """Rebuild the input from the output: one tensor in, one out; a pair in, a pair out."""
        if y2 is not None:
            return self.inverse_pair(y, y2)
        x1, x2 = self.inverse_pair(*split_halves(y, self.split_dim))
        return torch.cat([x1, x2], dim=self.split_dim)

    # -- Invertible: states are pairs of halves ----------------------------------------------

    def forward_state(self, xs: State) -> State:
        return self.forward_pair(*xs)

    def inverse_state(self, ys: State) -> State:
        return self.inverse_pair(*ys)

    def to_state(self, value: Any) -> State:
        if isinstance(value, (tuple, list)):
            return tuple(value)
        return split_halves(value, self.split_dim)

    def from_state(self, state: State) -> Any:
        return torch.cat(list(state), dim=self.split_dim)

    def describe(self) -> str:
        return self.extra_repr()

    # -- entry point -------------------------------------------------------------------------

    def forward(self, x: Tensor, x2: Tensor | None = None) -> Tensor | tuple[Tensor, Tensor]:  # type: ignore[override]
        pair = x2 is not None
        xs = (x, x2) if pair else split_halves(x, self.split_dim)
        check_state(xs)  # type: ignore[arg-type]
        if self._mode == "M" and torch.is_grad_enabled():
            return run_reversible((self,), xs, join_dim=None if pair else self.split_dim)  # type: ignore[arg-type,return-value]
        y1, y2 = self.forward_pair(*xs)  # type: ignore[misc]
        return (y1, y2) if pair else torch.cat([y1, y2], dim=self.split_dim)

    # -- the reversible step: RevNet Algorithm 1 ---------------------------------------------

    def step_params(self) -> list[Tensor]:
        return trainable_params(self.f, self.g)

    def step_forward(self, xs: State) -> tuple[State, Any]:
        x1, x2 = xs
        device = x1.device
        rng_f = RngState.capture(device) if self.preserve_rng_state else None
        y1 = self.coupling.forward(x1, self.checked_call(self.f, "F", x2, x1))
        rng_g = RngState.capture(device) if self.preserve_rng_state else None
        y2 = self.coupling.forward(x2, self.checked_call(self.g, "G", y1, x2))
        return (y1, y2), _CouplingRecord(rng_f, rng_g)

    def step_reverse(
        self, ys: State, dys: Grads, record: Any, params: Sequence[Tensor], need_input_grad: bool
    ) -> StepResult:
        """Rebuild ``(x1, x2)`` from ``(y1, y2)`` and backpropagate, building each graph once.

        ``G`` runs once on ``y1`` building its graph: ``x2 = c⁻¹(y2, G(y1))`` is rebuilt and
        ``dy2`` backpropagated through that graph; then ``F`` runs once on the rebuilt ``x2``
        building its graph: ``x1 = c⁻¹(y1, F(x2))``, and ``dz1`` is backpropagated.
        """
        rng_f = record.rng_f if isinstance(record, _CouplingRecord) else None
        rng_g = record.rng_g if isinstance(record, _CouplingRecord) else None
        coupling = self.coupling
        y1, y2 = ys
        dy1, dy2 = dys
        params = list(params)
        # A gradient of None means "this output was not used": like plain autograd, the
        # functions that only feed it then get no gradient (None, not zeros), and their graph
        # is not built.
        z1 = y1.detach().requires_grad_(dy2 is not None)
        with replay(rng_g), torch.set_grad_enabled(dy2 is not None):
            h_g = self.g(z1)
        h_g_value = _detached(h_g)
        with torch.no_grad():
            x2 = coupling.inverse(y2, h_g_value)
        dx2: Tensor | None = None
        grads: list[Tensor | None] = [None] * len(params)
        dz1 = dy1
        if dy2 is not None:
            dx2, dh_g = coupling.vjp(x2, h_g_value, dy2)
            dz1_g, *grads = autograd_grads([h_g], [z1, *params], [dh_g])
            dz1 = dz1_g if dy1 is None else _add(dy1, dz1_g)
            del dh_g
        del h_g, h_g_value

        build_f = dz1 is not None
        x2 = x2.detach().requires_grad_(need_input_grad and build_f)
        with replay(rng_f), torch.set_grad_enabled(build_f):
            h_f = self.f(x2)
        h_f_value = _detached(h_f)
        with torch.no_grad():
            x1 = coupling.inverse(z1.detach(), h_f_value)
        dx1: Tensor | None = None
        if build_f:
            dx1, dh_f = coupling.vjp(x1, h_f_value, dz1)  # type: ignore[arg-type]
            f_inputs = [x2, *params] if need_input_grad else params
            f_grads = autograd_grads([h_f], f_inputs, [dh_f])
            if need_input_grad:
                dx2_f = f_grads.pop(0)
                dx2 = dx2_f if dx2 is None else _add(dx2, dx2_f)
            grads = [_sum(a, b) for a, b in zip(grads, f_grads)]
        return StepResult((x1, x2.detach()), (dx1, dx2), grads)


def _detached(h: FOut) -> FOut:
    return tuple(t.detach() for t in h) if isinstance(h, tuple) else h.detach()


def _add(a: Tensor, b: Tensor | None) -> Tensor:
    return a if b is None else a + b


def _sum(a: Tensor | None, b: Tensor | None) -> Tensor | None:
    if a is None:
        return b
    return a if b is None else a + b
