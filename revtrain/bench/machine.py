"""What machine a measurement ran on: enough to tell two results files apart."""

from __future__ import annotations

import datetime as _dt
import os
import platform
from pathlib import Path
from typing import Any

import torch

__all__ = ["machine_info", "cpu_model", "load_average", "BUSY_LOAD_PER_CORE"]

BUSY_LOAD_PER_CORE = 0.5
"""Load average per core above which other processes are taken to have shared the cores."""

_TIMING_ENV = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "GLIBC_TUNABLES", "LD_PRELOAD", "OMP_WAIT_POLICY")


def cpu_model() -> str:
    """The CPU's model name from ``/proc/cpuinfo``, else :func:`platform.processor`."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.lower().startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown"


def load_average() -> tuple[float, float, float] | None:
    """The 1/5/15-minute load averages, or ``None`` where the OS does not report them."""
    try:
        one, five, fifteen = os.getloadavg()
    except (OSError, AttributeError):
        return None
    return round(one, 2), round(five, 2), round(fifteen, 2)


def machine_info(device: torch.device | str) -> dict[str, Any]:
    """Plain data (JSON-serialisable) describing the software, the hardware and the load.

    Args:
        device: The device the measurement runs on; for CUDA its name and capability are added.
    """
    dev = torch.device(device)
    info: dict[str, Any] = {
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpu": cpu_model(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "device": str(dev),
        "load_average": load_average(),
        # Settings that change CPU timings: thread counts and glibc's allocator.
        "env": {k: v for k, v in os.environ.items() if k in _TIMING_ENV or k.startswith("MALLOC_")},
    }
    if dev.type == "cuda":
        index = dev.index if dev.index is not None else torch.cuda.current_device()
        props = torch.cuda.get_device_properties(index)
        info.update(
            gpu=props.name,
            gpu_memory_bytes=props.total_memory,
            gpu_capability=f"{props.major}.{props.minor}",
            cuda=torch.version.cuda,
            cudnn=torch.backends.cudnn.version(),
        )
    return info
