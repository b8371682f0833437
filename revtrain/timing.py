"""Wall-clock time of work on a device, and the spread of repeated timings: one place.

On CUDA a timing starts and stops with CUDA events, so it covers the kernels queued in between
and not only their launch; on CPU it is ``time.perf_counter``. The planner and the benchmarks
time with :func:`timer`, describe the spread of repeated timings with :func:`iqr`, and decide
when enough repetitions were timed with :func:`median_is_stable`. Whether one method is faster
than another is read from paired ratios (the two timed in the same round) through
:func:`median_interval`, a confidence interval that assumes nothing about their distribution.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch

__all__ = [
    "MedianInterval", "block_ratios", "iqr", "median_interval", "median_is_stable", "median_stderr", "stderr_from_iqr",
    "timed", "timer",
]

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


class MedianInterval(NamedTuple):
    """A confidence interval for the median of some values, from their order statistics."""

    median: float
    low: float
    high: float
    coverage: float
    """The probability that the interval holds the true median: at least the confidence asked
    for, or the most that so few values can give (``1 - 2^(1-n)``, for min to max)."""

    def verdict(self, reference: float = 1.0) -> str:
        """``"below"`` or ``"above"`` ``reference`` where the whole interval is, else ``"tie"``
        (the values do not show a difference)."""
        if self.high < reference:
            return "below"
        return "above" if self.low > reference else "tie"


def median_interval(values: Sequence[float], confidence: float = 0.95) -> MedianInterval:
    """The median of ``values`` and a distribution-free confidence interval for it.

    The interval runs from the ``j``-th smallest to the ``j``-th largest value, with ``j`` as
    large as the confidence allows: the true median lies below the ``j``-th smallest of ``n``
    independent values with probability ``P(Binomial(n, 1/2) <= j - 1)``, and likewise above the
    ``j``-th largest. Nothing is assumed about the distribution (timings on a shared machine
    have long tails), only that the values are independent: paired ratios of two methods timed
    round by round are. With fewer than six values no interval reaches 95%; the interval is then
    min to max and ``coverage`` says what it reaches.
    """
    xs = sorted(values)
    n = len(xs)
    if not n:
        raise ValueError("median_interval needs at least one value")
    if not 0 < confidence < 1:
        raise ValueError(f"confidence must lie strictly between 0 and 1; got {confidence}")
    tail = (1 - confidence) / 2
    total = 2**n  # counts of the 2^n equally likely sign patterns, kept exact (no overflow at any n)
    j = 1  # the interval is the j-th smallest to the j-th largest value
    below = 1  # patterns with at most j - 1 values below the median: P(Binomial(n, 1/2) <= j - 1) * 2^n
    while 2 * (j + 1) <= n + 1:  # the next j still leaves an interval
        wider = below + math.comb(n, j)
        if wider / total > tail:  # int / int: correctly rounded
            break
        below, j = wider, j + 1
    return MedianInterval(statistics.median(xs), xs[j - 1], xs[n - j], 1 - 2 * (below / total))


def block_ratios(times: Sequence[float], reference: Sequence[float], block: int) -> list[float]:
    """Paired ratios of two methods timed round by round: per block of ``block`` consecutive
    rounds, the method's total time over the reference's (per round for ``block=1``); rounds past
    the last whole block are left out. A method whose steps are periodically dearer (a check on
    one step in 4) is compared by its mean over whole periods this way, what throughput sees,
    where per-round ratios would give the median step of a mixture."""
    if block < 1:
        raise ValueError(f"block must be at least 1, got {block}")
    n = min(len(times), len(reference)) // block * block
    return [sum(times[i : i + block]) / sum(reference[i : i + block]) for i in range(0, n, block)]
