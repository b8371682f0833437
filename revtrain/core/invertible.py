"""``Invertible``: the base of every layer that can drop its input and rebuild it (M/C modes).

A reversible coupling block, an invertible BatchNorm + LeakyReLU (In-place ABN), an invertible
1×1 convolution: each is a layer whose input can be computed from its output. Subclassing
:class:`Invertible` puts such a layer into revtrain's mode system: ``layer.mode = "M"`` drops the
input in the forward and rebuilds it in backward, ``"C"`` is plain autograd; ``set_modes``,
plans and the planner find it like any reversible block.

Adding your own invertible layer::

    class Scale(Invertible):
        def __init__(self, channels):
            super().__init__()
            self.log_s = nn.Parameter(torch.zeros(channels, 1, 1))

        def forward_state(self, xs):          # plain autograd computation
            (x,) = xs
            return (x * self.log_s.exp(),)

        def inverse_state(self, ys):          # its exact inverse
            (y,) = ys
            return (y * (-self.log_s).exp(),)

The generic M-mode backward then rebuilds ``x`` with ``inverse_state`` and runs
``forward_state`` once more to build the graph it differentiates (inverse + forward + backward).
A layer that knows a cheaper way overrides :meth:`step_reverse` (``ReversibleBlock`` does:
RevNet's Algorithm 1 reuses the graphs built while inverting). Check a new layer with
:func:`revtrain.verify_invertible` and against C-mode gradients.
"""

from __future__ import annotations

import abc
import contextlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import Tensor, nn

from revtrain.core.function import check_state, run_reversible
from revtrain.core.replay import RngState
from revtrain.core.step import Grads, State, StepResult, autograd_grads

__all__ = ["Invertible", "Mode", "MODES", "normalize_mode", "trainable_params", "replay"]

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


def trainable_params(*modules: nn.Module) -> list[Tensor]:
    """The parameters of ``modules`` that require grad, each once, in module order."""
    seen: set[int] = set()
    out: list[Tensor] = []
    for module in modules:
        for p in module.parameters():
            if p.requires_grad and id(p) not in seen:
                seen.add(id(p))
                out.append(p)
    return out


def replay(state: RngState | None) -> contextlib.AbstractContextManager[None]:
    """Run the body with the captured random generators (no-op for ``None``)."""
    return state.replay() if state is not None else contextlib.nullcontext()


@dataclass
class _GenericRecord:
    rng: RngState | None


class Invertible(nn.Module, abc.ABC):
    """A layer whose input can be rebuilt from its output, with a memory mode.

    Args:
        mode: ``"M"`` (memory-centric: keep only the output, rebuild the input in backward) or
            ``"C"`` (compute-centric: plain autograd). Settable any time via ``layer.mode``.
        preserve_rng_state: Capture the random generators in the forward and replay them in the
            rebuild, so randomness inside the layer (dropout) rebuilds exactly. Turn off only
            when the layer uses no randomness.
        check_reconstruction: In M-mode, record a fingerprint of the input in the forward and
            compare it with the rebuilt input: a non-finite rebuild raises
            :class:`~revtrain.errors.ReconstructionError`; a relative difference above
            ``drift_tolerance`` warns, or raises when ``drift_action="raise"``.
        drift_tolerance: Relative rebuild error allowed by that check.
        drift_action: ``"warn"`` or ``"raise"``.
    """

    def __init__(
        self,
        mode: Mode = "M",
        *,
        preserve_rng_state: bool = True,
        check_reconstruction: bool = True,
        drift_tolerance: float = 1e-3,
        drift_action: Literal["warn", "raise"] = "warn",
    ) -> None:
        super().__init__()
        if drift_action not in ("warn", "raise"):
            raise ValueError(f"drift_action must be 'warn' or 'raise', got {drift_action!r}")
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

    # -- what a subclass implements ----------------------------------------------------------

    @abc.abstractmethod
    def forward_state(self, xs: State) -> State:
        """The layer's computation on a state, under the ambient autograd mode."""

    @abc.abstractmethod
    def inverse_state(self, ys: State) -> State:
        """Rebuild the input state from the output state (no graph needed)."""

    def to_state(self, value: Any) -> State:
        """One tensor is a one-tensor state; override for layers that map several tensors."""
        return (value,)

    def from_state(self, state: State) -> Any:
        return state[0] if len(state) == 1 else state

    def describe(self) -> str:
        return f"{type(self).__name__}({self.extra_repr()})"

    def extra_repr(self) -> str:
        return f"mode={self._mode!r}"

    # -- the entry point ---------------------------------------------------------------------

    def forward(self, x: Tensor) -> Any:
        xs = self.to_state(x)
        check_state(xs)
        if self._mode == "M" and torch.is_grad_enabled():
            return self.from_state(_as_state(run_reversible((self,), xs, join_dim=None)))
        return self.from_state(self.forward_state(xs))

    def inverse(self, y: Any) -> Any:
        """Rebuild the input from the output, under the ambient autograd mode."""
        return self.from_state(self.inverse_state(self.to_state(y)))

    # -- the reversible step (see revtrain.core.step.ReversibleStep) -------------------------

    def step_params(self) -> list[Tensor]:
        return trainable_params(self)

    def step_forward(self, xs: State) -> tuple[State, Any]:
        rng = RngState.capture(xs[0].device) if self.preserve_rng_state else None
        return self.forward_state(xs), _GenericRecord(rng)

    def step_reverse(
        self, ys: State, dys: Grads, record: Any, params: Sequence[Tensor], need_input_grad: bool
    ) -> StepResult:
        """Generic rebuild: invert, then run the forward once more to build its graph."""
        rng = record.rng if isinstance(record, _GenericRecord) else None
        with torch.no_grad():
            xs = tuple(x.detach() for x in self.inverse_state(ys))
        inputs = tuple(x.requires_grad_(need_input_grad) for x in xs)
        with replay(rng):
            outs = self.forward_state(inputs)
        wrt = [*inputs, *params] if need_input_grad else list(params)
        grads = autograd_grads(list(outs), wrt, list(dys))
        n = len(inputs) if need_input_grad else 0
        dxs = tuple(grads[:n]) if need_input_grad else (None,) * len(inputs)
        return StepResult(tuple(x.detach() for x in inputs), dxs, grads[n:])


def _as_state(value: Tensor | State) -> State:
    return value if isinstance(value, tuple) else (value,)
