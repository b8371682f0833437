"""The memory budget a plan must meet: bytes, units, or a fraction of the device's memory.

Accepted forms (:func:`resolve_budget`):

* an ``int``: bytes;
* a size with a unit, ``"6GiB"``, ``"512 MB"`` (see :func:`revtrain.memory.parse_bytes`), or a bare
  integer string ``"4096"`` (bytes);
* a fraction of the device's memory: ``"0.5"`` (a bare number with a decimal point, in (0, 1]) or
  ``"50%"`` (in (0, 100]). On CUDA it is a fraction of the device's total memory; on CPU a
  fraction of the RAM available now (``MemAvailable`` of ``/proc/meminfo``);
* ``None``: all the memory the device can give this process now — on CUDA the driver's free
  memory plus what this process's allocator already holds, on CPU the available RAM.

The budget bounds the peak *tensor* bytes of a training step as :mod:`revtrain.planner.measure`
counts them (CUDA: bytes allocated on the device; CPU: bytes of the model, optimizer state,
batch and everything a step allocates). It is not the process's resident size: leave room for
the interpreter and, on CUDA, for the allocator's cache and the CUDA context.
"""

from __future__ import annotations

import os
import re

import torch

from revtrain.device import resolve_device
from revtrain.memory import format_bytes, parse_bytes

__all__ = ["available_memory_bytes", "check_budget", "resolve_budget"]

_BARE_NUMBER = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*$")
_PERCENT = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*%\s*$")


def available_memory_bytes(device: torch.device | str | None = None) -> tuple[int, str]:
    """Memory the device can give this process now, with a description of where it came from.

    CUDA: the driver's free memory (``torch.cuda.mem_get_info``) plus what this process's caching
    allocator already reserves (it can reuse that). CPU: ``MemAvailable`` of ``/proc/meminfo``, or
    ``os.sysconf`` available pages where there is no ``/proc``.

    Raises:
        ValueError: CUDA is asked for but not available, or the CPU's free memory cannot be read.
    """
    dev = _device(device)
    if dev.type == "cuda":
        index = _cuda_index(dev)
        free, total = torch.cuda.mem_get_info(index)
        held = torch.cuda.memory_reserved(index)
        return free + held, (
            f"memory free on cuda:{index} ({format_bytes(free)} free of {format_bytes(total)}, plus "
            f"{format_bytes(held)} this process's allocator holds)"
        )
    if dev.type != "cpu":
        raise ValueError(f"cannot tell the free memory of device {dev}; give the budget in bytes (e.g. '6GiB')")
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    kib = int(line.split()[1])
                    return kib * 1024, "available RAM (MemAvailable in /proc/meminfo)"
    except OSError:
        pass
    try:
        pages = os.sysconf("SC_AVPHYS_PAGES")
        page = os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        raise ValueError(
            "cannot read the available RAM on this system; give the budget in bytes (e.g. '6GiB')"
        ) from None
    return int(pages) * int(page), "available RAM (os.sysconf SC_AVPHYS_PAGES)"


def _total_memory_bytes(dev: torch.device) -> tuple[int, str]:
    """What a fraction is taken of: CUDA total memory, or the CPU's available RAM."""
    if dev.type == "cuda":
        index = _cuda_index(dev)
        props = torch.cuda.get_device_properties(index)
        return int(props.total_memory), f"the total memory of cuda:{index} ({props.name})"
    return available_memory_bytes(dev)


def resolve_budget(spec: str | int | None, device: torch.device | str | None = None) -> tuple[int, str]:
    """Turn a budget as a user writes it into bytes, with a sentence saying how.

    Args:
        spec: Bytes (``int``), a size (``"6GiB"``), a fraction (``"0.5"``, ``"50%"``), or None
            for all the memory the device can give now (see the module docstring).
        device: Where the training runs (``"cpu"``, ``"cuda"``, ``"cuda:1"``); None means CPU.

    Returns:
        ``(budget_bytes, explanation)``, e.g. ``(3221225472, "50% of the total memory of cuda:0
        (NVIDIA H100) = 3.00 GiB")``. The explanation also says when the budget is more than the
        device has.

    Raises:
        ValueError: a negative or malformed budget, a fraction outside (0, 1], a percentage outside
            (0, 100], or a device whose memory cannot be read for a fraction or a default.
    """
    dev = _device(device)
    if spec is None:
        avail, where = available_memory_bytes(dev)
        return avail, f"no budget given: using all the {where} = {format_bytes(avail)}"
    if isinstance(spec, bool) or not isinstance(spec, (int, str)):
        raise ValueError(_usage(f"got {type(spec).__name__} {spec!r}"))
    if isinstance(spec, int):
        if spec < 0:
            raise ValueError(_usage(f"a budget cannot be negative, got {spec}"))
        return spec, _with_capacity(spec, f"{format_bytes(spec)} ({spec} bytes), as given", dev)

    fraction = _fraction(spec)
    if fraction is not None:
        total, what = _total_memory_bytes(dev)
        budget = int(total * fraction)
        pct = f"{fraction * 100:g}%"
        return budget, f"{pct} of {what}, {format_bytes(total)} = {format_bytes(budget)}"
    try:
        budget = parse_bytes(spec)
    except ValueError as err:
        raise ValueError(_usage(str(err))) from None
    return budget, _with_capacity(budget, f"{format_bytes(budget)} ({budget} bytes), as given", dev)


def check_budget(spec: str | int | None) -> None:
    """Refuse a budget whose form :func:`resolve_budget` would refuse on any device, without
    reading any device's memory (for validating options before anything runs).

    Raises:
        ValueError: as :func:`resolve_budget` for a malformed or out-of-range budget.
    """
    if spec is None:
        return
    if isinstance(spec, bool) or not isinstance(spec, (int, str)):
        raise ValueError(_usage(f"got {type(spec).__name__} {spec!r}"))
    if isinstance(spec, int):
        if spec < 0:
            raise ValueError(_usage(f"a budget cannot be negative, got {spec}"))
        return
    if _fraction(spec) is None:
        try:
            parse_bytes(spec)
        except ValueError as err:
            raise ValueError(_usage(str(err))) from None


def _fraction(spec: str) -> float | None:
    """The fraction a string asks for, None when it is not a fraction; raise when out of range."""
    pct = _PERCENT.match(spec)
    if pct:
        value = float(pct.group(1))
        if not 0 < value <= 100:
            raise ValueError(_usage(f"a percentage of device memory must be in (0, 100], got {spec!r}"))
        return value / 100
    bare = _BARE_NUMBER.match(spec)
    if bare and "." in bare.group(1):
        value = float(bare.group(1))
        if not 0 < value <= 1:
            raise ValueError(
                _usage(
                    f"a bare decimal number is a fraction of device memory and must be in (0, 1], "
                    f"got {spec!r}; for bytes write an integer or a unit ('{spec.strip()}GiB')"
                )
            )
        return value
    return None


def _with_capacity(budget: int, text: str, dev: torch.device) -> str:
    """Append a warning when the budget exceeds what the device can give."""
    try:
        total, what = _total_memory_bytes(dev)
    except (ValueError, RuntimeError):
        return text
    if budget > total:
        text += f"; note: more than {what}, {format_bytes(total)}"
    return text


def _usage(problem: str) -> str:
    return (
        f"invalid memory budget: {problem}. Give bytes (4096), a size with a unit ('6GiB', "
        "'512MB'), a fraction of the device's memory ('0.5') or a percentage ('50%')"
    )


def _device(device: torch.device | str | None) -> torch.device:
    if device is None:
        return torch.device("cpu")
    return resolve_device(device)


def _cuda_index(dev: torch.device) -> int:
    return dev.index if dev.index is not None else torch.cuda.current_device()
