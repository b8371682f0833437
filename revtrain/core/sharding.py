"""FSDP2 and M-mode: make the parameters of ``fully_shard``-ed layers whole while M-mode runs them.

FSDP2 makes a module's parameters whole around its ``__call__`` (hooks); an M-mode run calls its
layers' steps directly and rebuilds them inside its autograd function, where no hook fires.
:func:`unsharded` does what the hooks would: ``unshard()`` before and ``reshard()`` after, for
each FSDP-managed layer not already whole. The gradients land on the unsharded parameters and
FSDP's end-of-backward callback (root ``fully_shard``-ed too) reduce-scatters them. Nothing here
imports FSDP.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterable, Iterator
from typing import Any

__all__ = ["unsharded", "any_sharded"]


def any_sharded(layers: Iterable[Any]) -> bool:
    """Whether any of ``layers`` is FSDP2-managed (a run asks once, not per layer)."""
    module_type = getattr(sys.modules.get("torch.distributed.fsdp"), "FSDPModule", None)
    return module_type is not None and any(isinstance(layer, module_type) for layer in layers)


@contextlib.contextmanager
def unsharded(layers: Iterable[Any]) -> Iterator[None]:
    """Run the body with the parameters of every FSDP2-managed layer in ``layers`` whole."""
    module_type = getattr(sys.modules.get("torch.distributed.fsdp"), "FSDPModule", None)
    if module_type is None:
        yield
        return
    opened = [layer for layer in layers if isinstance(layer, module_type) and not _is_whole(layer)]
    for layer in opened:
        layer.unshard()
    try:
        yield
    finally:
        for layer in opened:
            layer.reshard()


def _is_whole(layer: Any) -> bool:
    return all(group.is_unsharded for group in _param_groups(layer._get_fsdp_state()))


def _param_groups(state: Any) -> list[Any]:
    """The FSDP parameter groups of a module's state: a list in recent PyTorch
    (``_fsdp_param_groups``), one or None before (``_fsdp_param_group``; torch 2.11 on an H100
    machine, where reading only the list took every block for whole and F met DTensors)."""
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is not None:
        return list(groups)
    group = getattr(state, "_fsdp_param_group", None)
    return [] if group is None else [group]
