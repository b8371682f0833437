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
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import Tensor, nn

from revtrain.core.arguments import NO_ARGS, ExtraArgs
from revtrain.core.function import check_state, run_reversible
from revtrain.core.replay import RngState
from revtrain.core.step import Grads, ReversibleStep, State, StepResult, autograd_grads

__all__ = [
    "Invertible",
    "InverseStep",
    "Mode",
    "MODES",
    "normalize_mode",
    "trainable_params",
    "replay",
    "generic_reverse",
    "route_extra_grads",
]

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
    return list({id(p): p for module in modules for p in module.parameters() if p.requires_grad}.values())


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
            rebuild, so randomness (dropout) rebuilds exactly. Off only where the layer draws
            no random numbers.
        check_reconstruction: In M-mode, compare the rebuilt input with a sketch of the input
            taken in the forward (``core/checks.py``) on the calls ``check_every`` samples: a
            non-finite rebuild raises :class:`~revtrain.errors.ReconstructionError`; a relative
            error above the tolerance warns, or raises with ``drift_action="raise"``.
        drift_tolerance: That tolerance; None: by the precision ``F`` and ``G`` compute in
            (``checks.TOLERANCES``, the autocast dtype where autocast is on).
        drift_action: ``"warn"`` or ``"raise"``.
        check_every: None: the first ``FIRST_CHECKS`` calls, then one in ``DEFAULT_EVERY``
            (a late drift is reported within that many steps); ``k``: one call in ``k``; 1:
            every call. Counted per layer; ``set_rebuild_checks(model, k)`` sets it model-wide.
    """

    def __init__(
        self,
        mode: Mode = "M",
        *,
        preserve_rng_state: bool = True,
        check_reconstruction: bool = True,
        drift_tolerance: float | None = None,
        drift_action: Literal["warn", "raise"] = "warn",
        check_every: int | None = None,
    ) -> None:
        super().__init__()
        if drift_action not in ("warn", "raise"):
            raise ValueError(f"drift_action must be 'warn' or 'raise', got {drift_action!r}")
        if check_every is not None and (not isinstance(check_every, int) or check_every < 1):
            raise ValueError(
                f"check_every must be None (the default schedule) or a positive integer (1: check "
                f"every rebuild), got {check_every!r}"
            )
        self.check_every = check_every
        self.mode = mode
        self.preserve_rng_state = preserve_rng_state
        self.check_reconstruction = check_reconstruction
        self.drift_tolerance = None if drift_tolerance is None else float(drift_tolerance)
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

    def forward(self, x: Any, *args: Any, **kwargs: Any) -> Any:
        """Map ``x``; extra arguments go to :meth:`forward_state` after the state."""
        xs = self.to_state(x)
        check_state(xs)
        extra = ExtraArgs.of(args, kwargs)
        if self._mode == "M" and torch.is_grad_enabled():
            return self.from_state(_as_state(run_reversible((self,), xs, None, extra, source=x)))
        return self.from_state(extra.call(self.forward_state, xs))

    def inverse(self, y: Any, *args: Any, **kwargs: Any) -> Any:
        """Rebuild the input from the output.

        In M-mode with gradients enabled the inverse saves memory too (memcnn's
        ``keep_input_inverse=False``): it keeps only its own output and rebuilds its input ``y``
        in backward by running the forward. In C-mode it is plain autograd.
        """
        ys = self.to_state(y)
        check_state(ys)
        extra = ExtraArgs.of(args, kwargs)
        if self._mode == "M" and torch.is_grad_enabled():
            step = self.inverse_step()
            return self.from_state(_as_state(run_reversible((step,), ys, None, extra, source=y)))
        return self.from_state(extra.call(self.inverse_state, ys))

    def inverse_step(self) -> ReversibleStep:
        """This layer's inverse as a reversible step of its own (what M-mode ``inverse`` runs)."""
        return InverseStep(self)

    # -- the reversible step (see revtrain.core.step.ReversibleStep) -------------------------

    def step_params(self) -> list[Tensor]:
        return trainable_params(self)

    def step_forward(self, xs: State, extra: ExtraArgs = NO_ARGS) -> tuple[State, Any]:
        if not self.preserve_rng_state:
            return extra.call(self.forward_state, xs), _GenericRecord(None)
        ys, rng = RngState.around(xs[0].device, extra.call, self.forward_state, xs)
        return ys, _GenericRecord(rng)

    def step_reverse(
        self,
        ys: State,
        dys: Grads,
        record: Any,
        params: Sequence[Tensor],
        need_input_grad: bool,
        extra: ExtraArgs = NO_ARGS,
    ) -> StepResult:
        """Generic rebuild: invert, then run the forward once more to build its graph."""
        return generic_reverse(self.forward_state, self.inverse_state, ys, dys, record, params, need_input_grad, extra)


class InverseStep:
    """The inverse of an :class:`Invertible` as a reversible step: its forward is the layer's
    inverse, its rebuild runs the layer's forward (generic: rebuild, then build the graph of the
    inverse once more and differentiate it)."""

    def __init__(self, layer: Invertible) -> None:
        self.module = layer

    def __getattr__(self, name: str) -> Any:
        if name in ("check_reconstruction", "drift_tolerance", "drift_action", "check_every"):
            return getattr(self.module, name)  # the layer's rebuild check settings
        raise AttributeError(name)

    def step_params(self) -> list[Tensor]:
        return self.module.step_params()

    def step_forward(self, ys: State, extra: ExtraArgs = NO_ARGS) -> tuple[State, Any]:
        if not self.module.preserve_rng_state:
            return extra.call(self.module.inverse_state, ys), _GenericRecord(None)
        xs, rng = RngState.around(ys[0].device, extra.call, self.module.inverse_state, ys)
        return xs, _GenericRecord(rng)

    def step_reverse(
        self,
        xs: State,
        dxs: Grads,
        record: Any,
        params: Sequence[Tensor],
        need_input_grad: bool,
        extra: ExtraArgs = NO_ARGS,
    ) -> StepResult:
        layer = self.module
        return generic_reverse(layer.inverse_state, layer.forward_state, xs, dxs, record, params, need_input_grad, extra)

    def to_state(self, value: Any) -> State:
        return self.module.to_state(value)

    def from_state(self, state: State) -> Any:
        return self.module.from_state(state)

    def describe(self) -> str:
        return f"inverse of {self.module.describe()}"


def generic_reverse(
    forward_fn: Callable[..., State],
    inverse_fn: Callable[..., State],
    ys: State,
    dys: Grads,
    record: Any,
    params: Sequence[Tensor],
    need_input_grad: bool,
    extra: ExtraArgs,
) -> StepResult:
    """Rebuild ``xs = inverse_fn(ys)`` without a graph, run ``forward_fn(xs)`` once more with
    one, and backpropagate ``dys`` through it."""
    rng = record.rng if isinstance(record, _GenericRecord) else None
    with torch.no_grad():
        xs = tuple(x.detach() for x in extra.call(inverse_fn, ys))
    inputs = tuple(x.requires_grad_(need_input_grad) for x in xs)
    with replay(rng):
        outs = extra.call(forward_fn, inputs)
    extra_wrt = [t for t in extra.tensors if t.requires_grad]
    wrt = [*inputs, *params, *extra_wrt] if need_input_grad else [*params, *extra_wrt]
    grads = autograd_grads(list(outs), wrt, list(dys))
    n = len(inputs) if need_input_grad else 0
    dxs = tuple(grads[:n]) if need_input_grad else (None,) * len(inputs)
    param_grads = grads[n : n + len(params)]
    return StepResult(tuple(x.detach() for x in inputs), dxs, param_grads, route_extra_grads(extra, grads[n + len(params) :]))


def route_extra_grads(extra: ExtraArgs, grads: Sequence[Tensor | None]) -> list[Tensor | None]:
    """Gradients of the extra tensors that require grad, spread over all extra tensors."""
    if not extra:
        return []
    it = iter(grads)
    return [next(it) if t.requires_grad else None for t in extra.tensors]


def _as_state(value: Tensor | State) -> State:
    return value if isinstance(value, tuple) else (value,)
