"""Shared by the planner tests: exhaustive 0/1 knapsack, and one profile of a tiny RevNet."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import pytest
import torch

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


@pytest.fixture(scope="package", autouse=True)
def one_thread():
    """Run the planner tests on one intra-op thread.

    Their tensors are tiny: on a small, busy machine two OpenMP threads mostly wait for each
    other (measured ~10x slower per op under load). Byte counts do not depend on it, and no test
    here asserts a time.
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="package")
def tiny_profiled(one_thread):
    """The tests' small RevNet, its batch, and its profile.

    Profiling is the slow part of these tests; one profile serves every test that only reads it
    (tests that change the model build their own).
    """
    from revtrain.planner import profile_model

    from .helpers import tiny_batch, tiny_model

    model, batch = tiny_model(), tiny_batch()
    profile = profile_model(model, batch, repeats=1, warmup=1, model_name="tiny")
    return model, batch, profile
