"""Where tensors live and what they hold: the device argument and the dtype names options use."""

from __future__ import annotations

import torch

__all__ = ["FLOAT_DTYPES", "float_dtype", "resolve_device", "synchronize"]

FLOAT_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float64": torch.float64,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}
"""The floating-point dtypes an option such as ``--dtype`` may name, by their torch names."""


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


def synchronize(device: torch.device | str) -> None:
    """Wait until ``device`` has run what was queued on it (CUDA); nothing to wait for elsewhere.
    What a timer around device work calls before reading the clock."""
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def float_dtype(name: str | torch.dtype) -> torch.dtype:
    """The torch dtype of a name in :data:`FLOAT_DTYPES` (a ``torch.dtype`` passes through).

    Raises:
        ValueError: the name is not one of :data:`FLOAT_DTYPES`.
    """
    if isinstance(name, torch.dtype):
        if name not in FLOAT_DTYPES.values():
            raise ValueError(f"dtype must name a floating-point dtype, one of {', '.join(FLOAT_DTYPES)}; got {name}")
        return name
    try:
        return FLOAT_DTYPES[name]
    except KeyError:
        raise ValueError(f"dtype must name a floating-point dtype, one of {', '.join(FLOAT_DTYPES)}; got {name!r}") from None
