"""What machine a measurement ran on: enough to tell two results files apart."""

from __future__ import annotations

import datetime as _dt
import os
import platform
from pathlib import Path
from typing import Any

import torch

__all__ = ["machine_info", "machine_line", "cpu_model", "load_average", "busy_machine_note", "BUSY_LOAD_PER_CORE"]

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
        # Settings that change CPU timings: thread counts and glibc's allocator (see benchmarks/README).
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


def machine_line(before: dict[str, Any], after: dict[str, Any], wall_s: float) -> str:
    """The results files' machine line from :func:`machine_info` records taken around a run."""
    return (
        f"- torch {before['torch']}, {before['torch_threads']} threads, {before['cpu_count']} CPUs; "
        f"load average before {before['load_average']}, after {after['load_average']}; wall "
        f"{wall_s:.0f} s"
    )


def busy_machine_note(before: dict[str, Any], after: dict[str, Any], advice: str) -> str | None:
    """A warning for a results file when other processes shared the cores, else ``None``.

    ``before`` and ``after`` are :func:`machine_info` records taken around the measurement. The
    load before counts as is; the load after includes the measurement's own threads, which are
    subtracted, so that a run on an idle machine is not reported as busy because of itself.
    """
    cores = before.get("cpu_count") or 1
    own = before.get("torch_threads") or 1
    loads = [i["load_average"][0] for i in (before, after) if i.get("load_average")]
    others = []
    if before.get("load_average"):
        others.append(before["load_average"][0])
    if after.get("load_average"):
        others.append(max(0.0, after["load_average"][0] - own))
    if not others or max(others) <= BUSY_LOAD_PER_CORE * cores:
        return None
    return (
        f"The machine was busy: 1-minute load average {', '.join(f'{x:.2f}' for x in loads)} "
        f"(before, after; the run itself adds up to {own}) on {cores} cores. {advice}"
    )
