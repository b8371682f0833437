"""Shared reference for the planner tests: exhaustive 0/1 knapsack."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import pytest

BruteForce = Callable[[Sequence[float], Sequence[int], int], float]


def brute_force_best(values: Sequence[float], weights: Sequence[int], capacity: int) -> float:
    """Best total value over all 2**n subsets with total weight <= capacity (0.0 if none)."""
    n = len(values)
    assert n <= 16, "exhaustive search is for small n only"
    if n == 0 or capacity < 0:
        return 0.0
    masks = (np.arange(2**n)[:, None] >> np.arange(n)) & 1  # (2**n, n) subset membership
    # Python-int weights can exceed int64 products only beyond ~9e18 bytes; object dtype is exact.
    total_w = masks.astype(object) @ np.array([int(w) for w in weights], dtype=object)
    total_v = masks @ np.asarray(values, dtype=np.float64)
    feasible = np.array([w <= capacity for w in total_w])
    return float(total_v[feasible].max())


@pytest.fixture(scope="session")
def brute_force() -> BruteForce:
    return brute_force_best
