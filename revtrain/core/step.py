"""The reversible step: what the M-mode machinery knows of a layer, and the public rebuild step.

Every layer that can drop its input and rebuild it in backward (a coupling block, an invertible
layer, a sequence of them) implements :class:`ReversibleStep`. M-mode's autograd function
(``core/function.py``) knows layers only through it, and so does :func:`reverse_step`, the public
"rebuild this layer's input and backpropagate" that PETRA calls outside any autograd graph.

A *state* is a tuple of tensors: ``(x1, x2)`` for a coupling block, ``(x,)`` otherwise.
``step_forward`` maps input to output state without a graph and returns a *record* (what the
rebuild needs: generator states); ``step_reverse`` rebuilds the input state from the output
state and backpropagates its gradient.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol, Union

import torch
from torch import Tensor, nn

from revtrain.core.arguments import NO_ARGS, ExtraArgs
from revtrain.core.replay import AutocastState, no_running_stat_updates

__all__ = ["ReversibleStep", "StepResult", "State", "reverse_step", "autograd_grads", "owner_module", "add_grads"]

State = tuple[Tensor, ...]
"""The tensors a reversible layer maps: ``(x1, x2)`` for coupling blocks, ``(x,)`` otherwise."""

Grads = tuple[Union[Tensor, None], ...]
"""Gradients of a state; ``None`` where that tensor does not reach the loss."""


@dataclass
class StepResult:
    """What one reverse step returns."""

    inputs: State  # the rebuilt input state, detached
    grad_inputs: Grads  # dL/d input tensor (None where not needed)
    param_grads: list[Tensor | None]  # in step_params order
    extra_grads: list[Tensor | None] = field(default_factory=list)  # ExtraArgs.tensors order


class ReversibleStep(Protocol):
    """What a layer provides to take part in M-mode execution (a new invertible layer subclasses
    ``Invertible``, which supplies it)."""

    check_reconstruction: bool  # the rebuild check (core/checks.py) and its settings
    drift_tolerance: float | None
    drift_action: Literal["warn", "raise"]

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
        """Rebuild the input state from ``ys`` and backpropagate ``dys`` (grad mode on).

        ``record``: what :meth:`step_forward` returned, or None (no replay: PETRA). ``params``:
        what to differentiate (:meth:`step_params` at forward time); ``need_input_grad=False``
        skips the input's gradient; gradients of ``extra``'s tensors go to ``extra_grads``.
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


def add_grads(a: Tensor | None, b: Tensor | None) -> Tensor | None:
    """``a + b``, or whichever is not None (None: no gradient reached that tensor)."""
    if a is None:
        return b
    return a if b is None else a + b


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
    return list(torch.autograd.grad(outs, tuple(inputs), douts, allow_unused=True))


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
    """Rebuild ``layer``'s input from its output and backpropagate through it, outside autograd:
    the step M-mode backward runs per layer, for code that drives backward itself (a PETRA
    stage, with its *current* parameters).

    Args:
        layer: A ``ReversibleBlock``, ``ReversibleSequence`` or ``Invertible`` layer.
        outputs: The layer's output as it returns it (a tensor, or a pair); used detached.
        grad_outputs: ``dL/d outputs``, the same structure (None: unused).
        args, kwargs: The extra arguments the forward passed to ``F`` and ``G`` (constants here).
        record: The forward's record (replays its random numbers); None: generators as they are.
        accumulate: Add the parameter gradients into ``p.grad``; False: only return them.
        update_running_stats: Let batch norm update its statistics in the rebuild (PETRA does).
        autocast: Autocast settings for the rebuild (default: none).

    Returns:
        ``(inputs, grad_inputs)`` in the layer's user-facing structure.
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
