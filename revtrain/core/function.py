"""The autograd function behind M-mode: a run of reversible layers that keeps one output.

One :class:`_ReversibleRun` covers a run of consecutive M-mode layers. Its forward runs them
without building a graph (each layer's :meth:`~revtrain.core.step.ReversibleStep.step_forward`)
and saves only the run's output. Its backward walks the layers in reverse and calls each
layer's :meth:`~revtrain.core.step.ReversibleStep.step_reverse`: rebuild the layer's input from
its output while building the graph it needs once, backpropagate, hand the rebuilt input to the
layer below. For a coupling block that is RevNet's Algorithm 1 (``F`` and ``G`` run once more
each: about 4N in all, against 3N for plain autograd, never the 5N of "rebuild, then run the
forward again").

The function knows layers only through the :class:`~revtrain.core.step.ReversibleStep`
protocol. Nothing outlives a step: everything the backward needs lives on ``ctx``; the rebuilt
input of a layer is the output of the layer below and dies as soon as that layer is done.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor, nn

from revtrain.core.checks import check_rebuilds, fingerprint
from revtrain.core.replay import AutocastState, no_running_stat_updates
from revtrain.core.sharding import unsharded
from revtrain.core.step import ReversibleStep, State
from revtrain.errors import ReconstructionError, ReversibilityError

__all__ = ["run_reversible", "check_state"]


def check_state(xs: State) -> None:
    """Raise a clear error when the tensors of a state cannot be mapped together."""
    first = xs[0]
    for i, x in enumerate(xs[1:], start=2):
        if x.device != first.device or x.dtype != first.dtype:
            raise ReversibilityError(
                f"the two halves differ: x1 is {first.dtype} on {first.device}, x{i} is {x.dtype} "
                f"on {x.device}; move both to one device and dtype (e.g. x2 = x2.to(x1)) before "
                "the block"
            )


class _ReversibleRun(torch.autograd.Function):
    """Forward: a run of M-mode layers without a graph. Backward: rebuild and backpropagate."""

    @staticmethod
    def forward(ctx, layers, join_dim, param_lists, n_state, *tensors):  # type: ignore[override]
        xs: State = tensors[:n_state]
        records: list[tuple[Any, Tensor | None]] = []
        for layer in layers:
            prints = fingerprint(xs) if layer.check_reconstruction else None
            xs, record = layer.step_forward(xs)
            records.append((record, prints))
        ctx.layers = layers
        ctx.records = records
        ctx.param_lists = param_lists
        ctx.n_state = n_state
        ctx.join_dim = join_dim
        ctx.autocast = AutocastState.capture(xs[0].device)
        ctx.set_materialize_grads(False)
        if join_dim is None:
            ctx.save_for_backward(*xs)
            return xs if n_state > 1 else xs[0]
        y = torch.cat(xs, dim=join_dim)
        ctx.save_for_backward(y)
        return y

    @staticmethod
    def backward(ctx, *grads):  # type: ignore[override]
        if torch.is_grad_enabled():  # autograd enables grad mode in backward only for create_graph
            raise ReconstructionError(
                "double backward (create_graph=True) through M-mode reversible blocks is not "
                "supported; run those blocks in C-mode (revtrain.set_modes(model, 'C')) when you "
                "need higher-order gradients"
            )
        try:
            saved = ctx.saved_tensors
        except RuntimeError as err:
            if "inplace" not in str(err):
                raise
            raise ReconstructionError(
                "the output of an M-mode reversible block was modified in place before backward, "
                "so its input can no longer be rebuilt; use an out-of-place op on the block's "
                "output (e.g. torch.relu(y) instead of y.relu_(), or nn.ReLU(inplace=False) right "
                "after the block), or run that block in C-mode"
            ) from err
        n_state = ctx.n_state
        if ctx.join_dim is None:
            ys: State = tuple(t.detach() for t in saved)
            dys: tuple[Tensor | None, ...] = grads
        else:
            ys = saved[0].detach().chunk(n_state, dim=ctx.join_dim)
            dys = (None,) * n_state if grads[0] is None else grads[0].chunk(n_state, dim=ctx.join_dim)

        layers: Sequence[ReversibleStep] = ctx.layers
        n = len(layers)
        param_grads: list[list[Tensor | None]] = [[] for _ in range(n)]
        checks = []
        need_first = any(ctx.needs_input_grad[4 : 4 + n_state])
        # Backward runs with grad mode off; the rebuild needs graphs.
        with torch.enable_grad(), ctx.autocast.context():
            for i in reversed(range(n)):
                layer = layers[i]
                record, prints = ctx.records[i]
                with no_running_stat_updates(*_modules(layer)), unsharded((layer,)):
                    result = layer.step_reverse(ys, dys, record, ctx.param_lists[i], i > 0 or need_first)
                param_grads[i] = result.param_grads
                if prints is not None:
                    where = f"block {i} of a run of {n} M-mode blocks ({layer.describe()})"
                    checks.append((layer, where, prints, fingerprint(result.inputs)))
                ys, dys = result.inputs, result.grad_inputs
        check_rebuilds(checks)
        dxs = tuple(d if ctx.needs_input_grad[4 + k] else None for k, d in enumerate(dys))
        flat = [g for layer_grads in param_grads for g in layer_grads]
        return (None, None, None, None, *dxs, *flat)


def _modules(layer: object) -> tuple[nn.Module, ...]:
    return (layer,) if isinstance(layer, nn.Module) else ()


def run_reversible(
    layers: Sequence[ReversibleStep], xs: State, join_dim: int | None
) -> Tensor | State:
    """Run consecutive M-mode layers on the state ``xs``.

    Returns the output state (one tensor for a one-tensor state), or, with ``join_dim``, the
    state's tensors concatenated along it (saved once, inside the function).
    """
    # Parameters are inputs of the function so that autograd routes their gradients; the
    # lists are collected once here and reused by backward. FSDP2-sharded layers are made
    # whole first, so the lists hold the parameters F and G really use (core/sharding.py).
    with unsharded(layers):
        param_lists = tuple(layer.step_params() for layer in layers)
        params = [p for plist in param_lists for p in plist]
        return _ReversibleRun.apply(tuple(layers), join_dim, param_lists, len(xs), *xs, *params)
