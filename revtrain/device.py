"""Turn a device argument ("auto", "cpu", "cuda:1", a torch.device) into a usable device."""

from __future__ import annotations

import torch

__all__ = ["resolve_device"]


def resolve_device(device: torch.device | str = "auto") -> torch.device:
    """``"auto"``: CUDA when available, else CPU; any other value as ``torch.device`` reads it.

    Raises:
        ValueError: a CUDA device was asked for but CUDA is not available in this process.
    """
    if str(device) == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {str(device)!r} was asked for but CUDA is not available; use 'cpu' or 'auto'")
    return dev
