"""The reversible step: what the M-mode machinery knows of a layer, and the public rebuild step.

Every layer that can drop its input and rebuild it in backward — a two-branch coupling block,
an invertible layer such as In-place ABN, a whole sequence of them — implements the small
:class:`ReversibleStep` protocol. The autograd function of M-mode (``core/function.py``) knows
layers only through it, and so does :func:`reverse_step`, the documented public step
"rebuild this layer's input from its output and backpropagate through it", which
stage-parallel training (PETRA) calls outside any autograd graph.

A layer's *state* is a tuple of tensors: ``(x1, x2)`` for a coupling block, ``(x,)`` for a
single-tensor invertible layer. ``step_forward`` maps input state to output state without
building a graph and returns a *record*: whatever the layer's rebuild needs from the forward
(random generator states for dropout replay). ``step_reverse`` takes the output state, its
gradient and the record, rebuilds the input state while building the graph it needs once, and
returns the input state, its gradient and the parameter gradients. Both take the layer's
:class:`~revtrain.core.arguments.ExtraArgs` (what the caller passed besides the state, handed on
to ``F`` and ``G``); ``step_reverse`` also returns the gradients of the tensors among them.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol, Union

import torch
from torch import Tensor, nn
from torch.overrides import has_torch_function

from revtrain.core.arguments import NO_ARGS, ExtraArgs
from revtrain.core.replay import AutocastState, no_running_stat_updates

__all__ = ["ReversibleStep", "StepResult", "State", "reverse_step", "autograd_grads", "owner_module", "walk_gives_params", "gives_owner_params"]

State = tuple[Tensor, ...]
"""The tensors a reversible layer maps: ``(x1, x2)`` for coupling blocks, ``(x,)`` otherwise."""

Grads = tuple[Union[Tensor, None], ...]
"""Gradients of a state; ``None`` where that tensor does not reach the loss."""


@dataclass
class StepResult:
    """What one reverse step returns."""

    inputs: State
    """The rebuilt input state, detached from any graph."""
    grad_inputs: Grads
    """The gradient of the loss with respect to each input tensor (None where not needed)."""
    param_grads: list[Tensor | None]
    """Gradients of the layer's :meth:`ReversibleStep.step_params`, in the same order."""
    extra_grads: list[Tensor | None] = field(default_factory=list)
    """Gradients of the tensors of the extra arguments (``ExtraArgs.tensors`` order); empty
    when the layer got none."""


class ReversibleStep(Protocol):
    """What a layer provides to take part in M-mode (memory-centric) execution.

    ``revtrain.core.ReversibleBlock``, ``ReversibleSequence`` and every
    ``revtrain.core.Invertible`` implement it; a new kind of invertible layer subclasses
    ``Invertible`` (which supplies a generic :meth:`step_reverse`) rather than implementing
    this protocol from scratch.
    """

    check_reconstruction: bool
    """Compare a fingerprint of the input taken in the forward with the rebuilt input."""
    drift_tolerance: float
    """Relative rebuild error allowed by that check."""
    drift_action: Literal["warn", "raise"]
    """What a larger error does."""

    def step_params(self) -> list[Tensor]:
        """The trainable tensors this layer's output depends on, in a fixed order."""
        ...

    def step_forward(self, xs: State, extra: ExtraArgs = NO_ARGS) -> tuple[State, Any]:
        """Compute the output state without a graph; return it and the record backward needs."""
        ...

    def step_reverse(
        self,
        ys: State,
        dys: Grads,
        record: Any,
        params: Sequence[Tensor],
        need_input_grad: bool,
        extra: ExtraArgs = NO_ARGS,
    ) -> StepResult:
        """Rebuild the input state from ``ys`` and backpropagate ``dys`` through the layer.

        Runs with grad mode enabled by the caller. ``record`` is what :meth:`step_forward`
        returned, or ``None`` (no replay of random generators: e.g. PETRA, whose backward runs
        with parameters that changed since the forward). ``params`` are the tensors to
        differentiate with respect to (what :meth:`step_params` returned at forward time).
        ``need_input_grad=False`` lets a layer skip the gradient of its input. ``extra`` holds
        the forward's extra arguments; the gradients of its tensors that require grad go to
        :attr:`StepResult.extra_grads`.
        """
        ...

    def to_state(self, value: Any) -> State:
        """The state of a user-facing value (split one tensor into halves, or wrap it)."""
        ...

    def from_state(self, state: State) -> Any:
        """The user-facing value of a state (concatenate halves, or unwrap)."""
        ...

    def describe(self) -> str:
        """A short description for error messages."""
        ...


def owner_module(layer: object) -> nn.Module | None:
    """The module whose parameters, buffers and norm layers a step uses: the layer itself, or
    the ``module`` a step object works for (e.g. the inverse of a block)."""
    if isinstance(layer, nn.Module):
        return layer
    module = getattr(layer, "module", None)
    return module if isinstance(module, nn.Module) else None


_OWNER_PARAMS: set[Any] = set()
"""``step_params`` functions that return their module's trainable parameters in module order."""
_MODULE_OWNER_PARAMS: set[Any] = set()
"""``step_params`` functions that return ``self.module.step_params()``."""


def gives_owner_params(function: Any, *, of_module: bool = False) -> Any:
    """Register a ``step_params`` function as returning exactly ``trainable_params`` of the
    layer's owner module (``of_module``: the ``step_params`` of the module it works for) — see
    :func:`walk_gives_params`. Returns the function (a decorator). Registered by identity, so a
    wrapper around a registered function is not registered."""
    (_MODULE_OWNER_PARAMS if of_module else _OWNER_PARAMS).add(function)
    return function


def walk_gives_params(layer: object) -> bool:
    """Whether ``layer.step_params()`` is exactly the trainable parameters of its owner module
    (:func:`owner_module`) in module order, as :class:`~revtrain.core.replay.ModuleTensors`
    collects them in its walk: the M-mode run then takes them from there instead of walking the
    modules a second time (one walk less per layer in every forward). True only for the
    registered functions (:func:`gives_owner_params`), so a subclass or an instance that
    overrides ``step_params`` is asked instead."""
    if "step_params" in getattr(layer, "__dict__", {}):
        return False
    function = type(layer).step_params
    if function in _MODULE_OWNER_PARAMS:
        layer = owner_module(layer)
        if layer is None or "step_params" in layer.__dict__:
            return False
        function = type(layer).step_params
    return function in _OWNER_PARAMS


def autograd_grads(
    outputs: Sequence[Tensor | tuple[Tensor, ...]],
    inputs: Sequence[Tensor],
    grad_outputs: Sequence[Tensor | tuple[Tensor, ...] | None],
) -> list[Tensor | None]:
    """``torch.autograd.grad`` over outputs that may be tuples or not need gradients.

    Outputs with a ``None`` gradient, or that do not require grad, are skipped (like plain
    autograd, the functions that only feed them get ``None``); each gradient is cast to its
    output's dtype (autocast may have changed it).
    """
    outs: list[Tensor] = []
    douts: list[Tensor] = []
    for out, dout in zip(outputs, grad_outputs):
        if dout is None:
            continue
        pairs = zip(out, dout) if isinstance(out, tuple) else ((out, dout),)
        for o, d in pairs:
            if o.requires_grad and d is not None:
                outs.append(o)
                douts.append(d if d.dtype == o.dtype else d.to(o.dtype))
    if not outs or not inputs:
        return [None] * len(inputs)
    inputs = tuple(inputs)
    if _ENGINE is None or has_torch_function(inputs) or has_torch_function(tuple(outs)):
        return list(torch.autograd.grad(outs, inputs, douts, allow_unused=True))
    # What torch.autograd.grad(outs, inputs, douts, allow_unused=True) runs, without its
    # argument handling (~15 µs a call, two calls per block in every M-mode backward): the
    # gradients are already tensors of the outputs' shapes and dtypes, and the engine
    # validates them again.
    return list(_ENGINE.run_backward(tuple(outs), tuple(douts), False, False, inputs, True, False))


# The engine torch.autograd.grad calls (private; where a torch lacks it, the public call runs).
_ENGINE = getattr(torch.autograd.Variable, "_execution_engine", None)


def reverse_step(
    layer: ReversibleStep,
    outputs: Any,
    grad_outputs: Any,
    *,
    args: tuple[Any, ...] = (),
    kwargs: dict[str, Any] | None = None,
    record: Any = None,
    accumulate: bool = True,
    update_running_stats: bool = False,
    autocast: AutocastState | None = None,
) -> tuple[Any, Any]:
    """Rebuild ``layer``'s input from its output and backpropagate through it, outside autograd.

    This is the step M-mode backward runs for every layer, offered on its own for code that
    drives backward itself: a PETRA stage receives ``(y, dL/dy)`` from the stage above, calls
    this with its *current* parameters, and sends the returned ``(x, dL/dx)`` down.

    Args:
        layer: A ``ReversibleBlock``, ``ReversibleSequence`` or ``Invertible`` layer.
        outputs: The layer's output as the layer returns it (one tensor, or a pair for blocks
            called on pairs); used detached.
        grad_outputs: ``dL/d outputs``, the same structure (None entries mean "unused").
        args: Extra positional arguments the forward passed on to ``F`` and ``G`` (masks,
            positions); tensors among them are treated as constants here (no gradient).
        kwargs: Extra keyword arguments, likewise.
        record: The record of the forward that produced ``outputs`` (replays its random
            numbers); None to run the rebuild with the generators as they are.
        accumulate: Add the parameter gradients into ``p.grad`` (like ``backward()``);
            with False they are only returned.
        update_running_stats: Let batch-norm layers in training mode update their running
            statistics during the rebuild (PETRA updates them in its backward recompute);
            by default the rebuild leaves them alone, as M-mode backward does.
        autocast: Autocast settings to run the rebuild under (default: none).

    Returns:
        ``(inputs, grad_inputs)`` in the layer's user-facing structure: the rebuilt input
        (detached) and ``dL/d inputs``.
    """
    ys = tuple(t.detach() for t in layer.to_state(outputs))
    if isinstance(grad_outputs, (tuple, list)):
        dys = tuple(grad_outputs)
    else:
        dys = tuple(layer.to_state(grad_outputs))
    extra = ExtraArgs.of(args, kwargs or {})
    if extra:
        extra = extra.with_tensors([t.detach() for t in extra.tensors])
    params = layer.step_params()
    module = owner_module(layer)
    frozen = () if update_running_stats or module is None else (module,)
    with torch.enable_grad(), autocast.context() if autocast else contextlib.nullcontext(), \
            no_running_stat_updates(*frozen):
        result = layer.step_reverse(ys, dys, record, params, True, extra)
    if accumulate:
        with torch.no_grad():
            for p, g in zip(params, result.param_grads):
                if g is None:
                    continue
                if p.grad is None:
                    p.grad = g.detach().clone() if g.requires_grad else g
                else:
                    p.grad.add_(g)
    if isinstance(outputs, (tuple, list)):  # the caller works on states: answer in states
        return tuple(result.inputs), tuple(result.grad_inputs)
    dxs = result.grad_inputs
    grad_in = None if any(g is None for g in dxs) else layer.from_state(tuple(dxs))  # type: ignore[arg-type]
    return layer.from_state(result.inputs), grad_in
