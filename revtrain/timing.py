"""Wall-clock time of work on a device, and the spread of repeated timings: one place.

On CUDA a timing starts and stops with CUDA events, so it covers the kernels queued in between
and not only their launch; on CPU it is ``time.perf_counter``. The planner and the benchmarks
time with :func:`timer` and describe the spread of repeated timings with :func:`iqr`.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence

import torch

__all__ = ["iqr", "timed", "timer"]

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
