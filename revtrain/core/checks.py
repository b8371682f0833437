"""Checks on every rebuild: does the rebuilt input match the one the forward saw?

The forward records a small *fingerprint* of each layer's input state; backward computes the
same fingerprint of the rebuilt state and compares, with one device sync for a whole run of
layers. A non-finite rebuild of a finite input raises :class:`ReconstructionError`; a relative
difference above the layer's ``drift_tolerance`` warns, or raises with ``drift_action="raise"``.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Sequence

import torch
from torch import Tensor

from revtrain.errors import ReconstructionDriftWarning, ReconstructionError

__all__ = ["fingerprint", "check_rebuilds"]


def fingerprint(state: Sequence[Tensor]) -> Tensor:
    """One number per tensor of ``state``: its norm, reduced in its own precision (float32 at
    least for half types), with no upcast copy."""

    def norm(x: Tensor) -> Tensor:
        low = x.dtype in (torch.float16, torch.bfloat16)
        return torch.linalg.vector_norm(x.detach(), dtype=torch.float32 if low else None)

    return torch.stack([norm(x).to(torch.float64) for x in state])


def check_rebuilds(checks: Sequence[tuple[object, str, Tensor, Tensor]]) -> None:
    """Compare forward and rebuilt fingerprints of many layers; one device sync in all.

    Args:
        checks: ``(layer, where, forward_fingerprint, rebuilt_fingerprint)`` per layer; the
            layer gives ``drift_tolerance`` and ``drift_action``, ``where`` names it.
    """
    if not checks:
        return
    values = torch.stack([torch.stack([f, r]) for _, _, f, r in checks]).tolist()
    for (layer, where, _, _), (before_all, after_all) in zip(checks, values):
        for part, (before, after) in enumerate(zip(before_all, after_all)):
            if not math.isfinite(before):
                continue  # the forward itself was not finite; the loss shows that already
            name = f"x{part + 1}" if len(before_all) > 1 else "x"
            if not math.isfinite(after):
                raise ReconstructionError(
                    f"rebuilding the input of {where} produced non-finite values (input {name})"
                    " although the forward input was finite: the inverse overflowed or divided by "
                    "~0. Run this layer in C-mode (layer.mode = 'C'), use a bounded coupling "
                    "scale, a smaller learning rate, or check it with revtrain.verify_invertible"
                )
            drift = abs(after - before) / max(before, 1e-30)
            tolerance = float(getattr(layer, "drift_tolerance"))
            if drift > tolerance:
                message = (
                    f"the rebuilt input of {where} drifted from the forward's by {drift:.2e} "
                    f"(relative norm, input {name}) > drift_tolerance={tolerance:g}; gradients "
                    "may be inaccurate. Use float64, fewer consecutive M-mode layers, or C-mode "
                    "for this layer; raise drift_tolerance to accept it"
                )
                if getattr(layer, "drift_action") == "raise":
                    raise ReconstructionError(message)
                warnings.warn(message, ReconstructionDriftWarning, stacklevel=3)
