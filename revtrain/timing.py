"""Wall-clock time of work on a device, and the spread of repeated timings: one place.

On CUDA a timing starts and stops with CUDA events, so it covers the kernels queued in between
and not only their launch; on CPU it is ``time.perf_counter``. The planner and the benchmarks
time with :func:`timer`, describe the spread of repeated timings with :func:`iqr`, and decide
when enough repetitions were timed with :func:`median_is_stable`.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Sequence

import torch

__all__ = ["iqr", "median_is_stable", "median_stderr", "stderr_from_iqr", "timed", "timer"]

# The standard error of the median of n normal samples is sqrt(pi/2) * sigma / sqrt(n), and a
# normal sample's IQR is 1.349 sigma: se(median) = 0.929 * IQR / sqrt(n). The IQR makes the
# estimate robust to the occasional slow repetition a shared machine produces.
_SE_OF_MEDIAN_PER_IQR = math.sqrt(math.pi / 2) / 1.349

Stopwatch = Callable[[], float]
"""``stop()`` -> seconds since the timer was started."""


def timer(device: torch.device) -> Callable[[], Stopwatch]:
    """``stop = timer(dev)(); ...; seconds = stop()``: CUDA events on a GPU, else perf_counter."""
    if device.type == "cuda":

        def start_cuda() -> Stopwatch:
            begin = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            begin.record()

            def stop() -> float:
                end.record()
                end.synchronize()
                return begin.elapsed_time(end) / 1000.0

            return stop

        return start_cuda

    def start_cpu() -> Stopwatch:
        begin = time.perf_counter()
        return lambda: time.perf_counter() - begin

    return start_cpu


def timed(fn: Callable[[], object], device: torch.device) -> float:
    """Seconds one call of ``fn`` takes on ``device`` (work queued before it is waited for first)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    stop = timer(device)()
    fn()
    return stop()


def iqr(values: Sequence[float]) -> float:
    """Interquartile range (inclusive quartiles) of ``values``; 0 for fewer than two."""
    if len(values) < 2:
        return 0.0
    q1, _, q3 = statistics.quantiles(values, n=4, method="inclusive")
    return q3 - q1


def stderr_from_iqr(spread: float, n: int) -> float:
    """Standard error of a median of ``n`` values whose interquartile range is ``spread``."""
    return _SE_OF_MEDIAN_PER_IQR * spread / math.sqrt(n)


def median_stderr(values: Sequence[float]) -> float:
    """Standard error of the median of ``values``, estimated robustly: ``0.929 * IQR / sqrt(n)``."""
    return stderr_from_iqr(iqr(values), len(values)) if values else math.inf


def median_is_stable(values: Sequence[float], precision: float) -> bool:
    """Whether the median of ``values`` is known to ``precision`` of itself (its standard error,
    :func:`median_stderr`, is at most ``precision * |median|``)."""
    return bool(values) and median_stderr(values) <= precision * abs(statistics.median(values))
