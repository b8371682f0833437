"""``torch.compile`` for models with reversible layers, without breaking their rebuild.

Compiling the whole model would have to trace through M-mode's autograd function, whose
forward and backward run Python (random-generator capture, rebuild checks) that dynamo cannot
put in one graph. So :func:`compile_model` compiles the parts where the arithmetic is:

- ``F`` and ``G`` of every :class:`~revtrain.core.ReversibleBlock` (each runs in the forward
  without a graph and again, with one, in the M-mode rebuild; both are compiled graphs);
- every largest submodule that holds no reversible layer and has parameters (stems,
  downsampling units, heads).

Each is compiled in place: its ``forward`` becomes the compiled class function bound to the
module, so parameter names, ``state_dict`` keys and checkpoints are unchanged, and a
``copy.deepcopy`` of the model runs its own parameters (a compiled *bound* method would keep
calling the original's). ``nn.Module.compile()`` is not used: in torch 2.13 it compiles
nothing (measured). Other reversible layers
(``Invertible`` such as In-place ABN) stay eager. Gradients equal eager mode's to rounding
(tested in float64); random numbers differ from eager's inside compiled code unless
``torch._inductor.config.fallback_random`` is set, but M-mode's replay still reproduces the
forward's draws in the rebuild, since the compiled code draws its seed from torch's generator.

Dynamo compiles one graph per module structure, tensor shape and grad mode; a RevNet has a few
of each, more than dynamo's default limit of 8 per code object, so the limit is raised to
:data:`RECOMPILE_LIMIT` (otherwise the extra variants silently run eager).
"""

from __future__ import annotations

import types
from typing import Any

import torch
from torch import nn

from revtrain.core import Invertible, ReversibleBlock

__all__ = ["compile_model", "uncompile_model", "RECOMPILE_LIMIT"]

RECOMPILE_LIMIT = 64
"""Graphs dynamo may keep per compiled code object (shapes × grad modes × structures)."""

_MARK = "_revtrain_compiled"


def compile_model(model: nn.Module, **compile_kwargs: Any) -> list[str]:
    """Compile ``model``'s F/G functions and reversible-free parts in place; return their names.

    Args:
        model: Any model; its modes can still be changed afterwards.
        **compile_kwargs: Passed to :func:`torch.compile` (``mode``, ``backend``, ``dynamic``...).

    Returns:
        The module names compiled, in module order (``"1.blocks.0.f"``, ``"0"``, ...).
    """
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, RECOMPILE_LIMIT)
    names: list[str] = []
    compiled: dict[type, Any] = {}  # one compiled function per class, bound to each module

    def compile_one(name: str, module: nn.Module) -> None:
        if getattr(module, _MARK, False):
            return
        cls = type(module)
        if cls not in compiled:
            compiled[cls] = torch.compile(cls.forward, **compile_kwargs)
        module.forward = types.MethodType(compiled[cls], module)  # type: ignore[method-assign]
        setattr(module, _MARK, True)
        names.append(name)

    def visit(prefix: str, module: nn.Module) -> None:
        if isinstance(module, ReversibleBlock):
            compile_one(_join(prefix, "f"), module.f)
            compile_one(_join(prefix, "g"), module.g)
            return
        if isinstance(module, Invertible):
            return  # its own M-mode step runs eager
        if not _holds_reversible(module):
            if any(True for _ in module.parameters()):
                compile_one(prefix or "<model>", module)
            return
        for child_name, child in module.named_children():
            visit(_join(prefix, child_name), child)

    visit("", model)
    return names


def uncompile_model(model: nn.Module) -> int:
    """Undo :func:`compile_model`: every compiled module runs eager again; returns how many."""
    count = 0
    for module in model.modules():
        if getattr(module, _MARK, False):
            del module.forward
            delattr(module, _MARK)
            count += 1
    return count


def _holds_reversible(module: nn.Module) -> bool:
    return any(isinstance(m, Invertible) for m in module.modules())


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name
