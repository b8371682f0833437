"""The process a run trains in: its device, its seeds, and a warning about busy CPUs."""

from __future__ import annotations

import os
import random

import numpy as np
import torch

from revtrain.device import resolve_device as _resolve
from revtrain.train.config import ConfigError

__all__ = ["resolve_device", "seed_everything", "busy_cpu_note"]


def resolve_device(name: str) -> torch.device:
    """``"auto"``: CUDA when available, else CPU; ``"cuda"`` and ``"cuda:N"`` must be available."""
    try:
        device = _resolve(name)
    except ValueError as e:
        raise ConfigError(f"--device {name} was asked for but CUDA is not available; use --device cpu or auto") from e
    if device.type == "cuda" and device.index is not None and device.index >= torch.cuda.device_count():
        raise ConfigError(f"--device {name}: this machine has {torch.cuda.device_count()} GPU(s), indices 0 to "
                          f"{torch.cuda.device_count() - 1}; pick one of them")
    return device


def seed_everything(seed: int) -> None:
    """Seed Python's ``random``, NumPy's global generator and torch (CPU and every CUDA device)."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def busy_cpu_note(device: torch.device) -> str | None:
    """A hint when other processes compete for the cores this run's OpenMP threads need.

    OpenMP threads spin at every barrier while waiting for each other; when another process holds
    one of the cores, each barrier waits for a time slice, and a small run can take ten times
    longer. One thread, or ``OMP_WAIT_POLICY=PASSIVE`` (set before torch is imported), avoids it.
    """
    threads, cores = torch.get_num_threads(), os.cpu_count() or 1
    try:
        load = os.getloadavg()[0]
    except (AttributeError, OSError):
        return None
    if device.type != "cpu" or threads < 2 or load < cores + 0.5:
        return None
    return (f"note: the machine is busy (load {load:.1f} on {cores} cores); {threads} torch threads may "
            "spend their time waiting for each other. If training is slow, pass --threads 1, or set "
            "OMP_WAIT_POLICY=PASSIVE in the environment before starting")
