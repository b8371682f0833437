"""Choices for the layers that cannot reverse: keep, recompute or offload, applied from outside.

A reversible layer (:class:`~revtrain.core.Invertible`) chooses between M-mode and C-mode. Every
other layer of a model — a stem, a downsampling transition, a classifier head, an embedding —
keeps what its backward needs; this module gives it two more options:

* ``"keep"`` — plain autograd (the default; nothing is wrapped);
* ``"recompute"`` — :func:`torch.utils.checkpoint.checkpoint` (``use_reentrant=False``) around
  the layer's forward: only its inputs are kept, and backward runs the forward again. Buffers the
  forward updates (batch-norm running statistics) are put back after the re-run, so they are
  updated once per step, as without recomputation; random operations replay exactly
  (``preserve_rng_state``);
* ``"offload"`` — :func:`torch.autograd.graph.save_on_cpu` around the forward: what backward needs
  is copied to host memory (pinned on CUDA) and back when backward uses it. It saves device
  memory on a GPU only; the planner offers it on CUDA.

The unit of choice, a **plain layer** (:func:`plain_layers`), is a largest submodule that holds no
reversible layer and sits outside every reversible layer: in a RevNet the stem, each transition
and the head; in a reversible Transformer the embedding and the head. The model is not changed:
an option is an instance attribute ``forward`` that wraps the class's forward, set and removed by
:func:`set_layer_options`, just as :func:`revtrain.core.set_modes` sets modes::

    set_layer_options(model, {"stem": "recompute", "stages.1.transition": "recompute"})
    set_layer_options(model, "keep")   # every plain layer back to plain autograd
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager, nullcontext
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from revtrain.core import Invertible
from revtrain.errors import unknown_names_error

__all__ = ["LAYER_OPTIONS", "get_layer_options", "plain_layers", "set_layer_options"]

LAYER_OPTIONS = ("keep", "recompute", "offload")
"""What a plain (non-reversible) layer can do with the tensors its backward needs."""


def plain_layers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The largest submodules of ``model`` that hold no reversible layer and are not inside one,
    in module order, with their ``named_modules`` names. Only modules whose parent holds a
    reversible layer count, so a model without reversible layers has none (plan it as a whole
    with :func:`torch.utils.checkpoint` instead)."""
    holds = _holds_invertible(model)
    out: list[tuple[str, nn.Module]] = []

    def walk(prefix: str, module: nn.Module) -> None:
        for child_name, child in module.named_children():
            name = f"{prefix}.{child_name}" if prefix else child_name
            if isinstance(child, Invertible):
                continue
            if holds[id(child)]:
                walk(name, child)
            else:
                out.append((name, child))

    if holds[id(model)] and not isinstance(model, Invertible):
        walk("", model)
    return out


def get_layer_options(model: nn.Module) -> dict[str, str]:
    """The option of every plain layer of ``model``, keyed by module name."""
    return {name: _option_of(layer) for name, layer in plain_layers(model)}


def set_layer_options(model: nn.Module, options: str | Mapping[str, str]) -> dict[str, str]:
    """Set every plain layer to one option, or layers by name from a mapping; returns the options
    now in force. A mapping must name only plain layers of ``model`` (:func:`plain_layers`);
    layers it does not name keep their option.

    Raises:
        ValueError: an unknown option, or names that are not plain layers of ``model`` (nothing
            is changed then).
    """
    layers = dict(plain_layers(model))
    if isinstance(options, str):
        wanted = dict.fromkeys(layers, options)
    else:
        wanted = dict(options)
        unknown = sorted(set(wanted) - set(layers))
        if unknown:
            raise unknown_names_error(unknown, list(layers), "layer", "plain (non-reversible) layers")
    bad = {name: opt for name, opt in wanted.items() if opt not in LAYER_OPTIONS}
    if bad:
        raise ValueError(f"layer options must be one of {LAYER_OPTIONS}; got {bad}")
    for name, option in wanted.items():
        _set_option(layers[name], option)
    return get_layer_options(model)


class _Wrapped:
    """The instance attribute ``forward`` of a layer that recomputes or offloads."""

    def __init__(self, module: nn.Module, option: str) -> None:
        self.module = module
        self.option = option

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        forward = type(self.module).forward.__get__(self.module)
        if not torch.is_grad_enabled():
            return forward(*args, **kwargs)
        if self.option == "recompute":
            return checkpoint(
                forward, *args, use_reentrant=False, preserve_rng_state=True,
                context_fn=lambda: (nullcontext(), _buffers_put_back(self.module)), **kwargs,
            )
        pin = any(t.is_cuda for t in tensors_in((args, kwargs)))
        with torch.autograd.graph.save_on_cpu(pin_memory=pin and torch.cuda.is_available()):
            return forward(*args, **kwargs)


@contextmanager
def _buffers_put_back(module: nn.Module) -> Iterator[None]:
    """Run a recomputation, then put the module's buffers back as they were (batch-norm running
    statistics are updated by the first forward only)."""
    saved = [(b, b.detach().clone()) for b in module.buffers()]
    try:
        yield
    finally:
        with torch.no_grad():
            for buf, value in saved:
                buf.copy_(value)


def _option_of(module: nn.Module) -> str:
    wrapped = module.__dict__.get("forward")
    return wrapped.option if isinstance(wrapped, _Wrapped) else "keep"


def _set_option(module: nn.Module, option: str) -> None:
    if isinstance(module.__dict__.get("forward"), _Wrapped):
        del module.forward
    if option != "keep":
        if "forward" in module.__dict__:
            raise ValueError(
                f"{type(module).__name__} has its own instance attribute 'forward'; the planner cannot wrap it "
                "to recompute or offload (keep this layer)"
            )
        module.forward = _Wrapped(module, option)  # type: ignore[method-assign]


def _holds_invertible(model: nn.Module) -> dict[int, bool]:
    holds: dict[int, bool] = {}

    def visit(m: nn.Module) -> bool:
        result = isinstance(m, Invertible)
        for child in m.children():
            result = visit(child) or result
        holds[id(m)] = result
        return result

    visit(model)
    return holds


def tensors_in(value: Any) -> list[Tensor]:
    """Every tensor in a layer's arguments or output: a tensor, or tuples, lists and dicts of them."""
    if isinstance(value, Tensor):
        return [value]
    if isinstance(value, (tuple, list)):
        return [t for v in value for t in tensors_in(v)]
    if isinstance(value, dict):
        return [t for v in value.values() for t in tensors_in(v)]
    return []

