"""solve_knapsack against exhaustive search, exact and discretised, plus its edge cases."""

from __future__ import annotations

import math
import random
import time

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from revtrain.planner import KnapsackSolution, solve_knapsack
from revtrain.planner.knapsack import _dp_choose

GiB = 2**30
MiB = 2**20

# Totals of up to 14 float64 values summed in different orders agree to a few ulps.
REL = 1e-12


def check_consistent(sol: KnapsackSolution, values, weights, capacity) -> None:
    """Invariants every answer must satisfy, whatever the granularity."""
    assert list(sol.chosen) == sorted(set(sol.chosen))
    assert all(0 <= i < len(values) for i in sol.chosen)
    assert sol.total_weight == sum(int(weights[i]) for i in sol.chosen)
    assert sol.total_weight <= capacity  # feasible in exact bytes
    assert sol.total_value == pytest.approx(sum(values[i] for i in sol.chosen), rel=REL, abs=1e-12)
    assert sol.granularity >= 1
    for i, (v, w) in enumerate(zip(values, weights)):
        if v <= 0:
            assert i not in sol.chosen, f"item {i} of value {v} was chosen"
        elif w == 0:
            assert i in sol.chosen, f"free item {i} of value {v} was left out"


def random_instance(rng: random.Random, n: int, w_max: int) -> tuple[list[float], list[int], int]:
    values = [rng.uniform(-0.2, 1.0) * 10 ** rng.uniform(-3, 3) for _ in range(n)]
    weights = [rng.choice([0, rng.randint(1, w_max), rng.randint(1, w_max)]) for _ in range(n)]
    capacity = rng.randint(0, max(1, sum(weights)))
    return values, weights, capacity


@pytest.mark.parametrize("seed", range(4))
def test_exact_instances_match_brute_force(seed, brute_force):
    rng = random.Random(seed)
    for _ in range(100):
        n = rng.randint(0, 14)
        values, weights, capacity = random_instance(rng, n, w_max=rng.choice([5, 100, 5000]))
        sol = solve_knapsack(values, weights, capacity)
        check_consistent(sol, values, weights, capacity)
        # Small capacities get an exact table: the answer is the true optimum.
        assert sol.granularity == 1 and sol.exact
        assert sol.total_value == pytest.approx(brute_force(values, weights, capacity), rel=REL, abs=1e-12)


@pytest.mark.parametrize("seed", range(4))
def test_huge_byte_weights_are_discretised_safely(seed, brute_force):
    """Byte-sized weights force g > 1: feasible in bytes, optimal in units, near-optimal in bytes."""
    rng = random.Random(100 + seed)
    lossy = 0
    for _ in range(60):
        n = rng.randint(1, 14)
        values, weights, capacity = random_instance(rng, n, w_max=rng.choice([40 * GiB, 2**45]))
        capacity = max(capacity, 10**10)  # keep g > 1 even when the random capacity is small
        sol = solve_knapsack(values, weights, capacity)
        check_consistent(sol, values, weights, capacity)
        g = sol.granularity
        if not sol.exact:
            lossy += 1
            assert g > 1
        exact_best = brute_force(values, weights, capacity)
        units = [-(-w // g) for w in weights]
        units_best = brute_force(values, units, capacity // g)
        # Optimal for the discretised problem (the greedy fill can only add to it) ...
        assert sol.total_value >= units_best * (1 - REL) - 1e-12
        # ... never better than the exact optimum (it is feasible in bytes) ...
        assert sol.total_value <= exact_best * (1 + REL) + 1e-12
        # ... and at least the exact optimum of a capacity smaller by (n + 1)(g - 1) bytes.
        shrunk_best = brute_force(values, weights, capacity - (n + 1) * (g - 1))
        assert sol.total_value >= shrunk_best * (1 - REL) - 1e-12
    assert lossy > 20, "the test meant to exercise lossy discretisation barely did"


@pytest.mark.parametrize("seed", range(3))
def test_dp_core_is_optimal_in_units(seed, brute_force):
    """The table itself (before the greedy fill) finds the discretised optimum."""
    rng = np.random.default_rng(seed)
    for _ in range(150):
        n = int(rng.integers(1, 15))
        values = rng.uniform(0.01, 10.0, n).tolist()
        units = rng.integers(1, 60, n).tolist()
        capacity = int(rng.integers(0, sum(units) + 1))
        taken = _dp_choose(values, units, capacity)
        assert sum(units[k] for k in taken) <= capacity
        assert len(set(taken)) == len(taken)
        got = math.fsum(values[k] for k in taken)
        assert got == pytest.approx(brute_force(values, units, capacity), rel=REL)


@settings(max_examples=300, deadline=None)
@given(
    data=st.lists(
        st.tuples(
            st.floats(-5, 50, allow_nan=False),
            st.one_of(st.integers(0, 1000), st.integers(0, 2**42)),
        ),
        max_size=10,
    ),
    capacity=st.one_of(st.integers(0, 3000), st.integers(0, 2**44)),
    granularity=st.one_of(st.none(), st.integers(1, 2**36)),
)
def test_any_granularity_stays_within_capacity(data, capacity, granularity, brute_force):
    # A table too fine to hold in memory is refused (tested below); keep to sane ones here.
    assume(granularity is None or capacity // granularity <= 2**22)
    values = [v for v, _ in data]
    weights = [w for _, w in data]
    sol = solve_knapsack(values, weights, capacity, granularity=granularity)
    check_consistent(sol, values, weights, capacity)
    if granularity is not None:
        assert sol.granularity == granularity
    g, n = sol.granularity, len(values)
    shrunk_best = brute_force(values, weights, capacity - (n + 1) * (g - 1))
    assert sol.total_value >= shrunk_best * (1 - REL) - 1e-9
    if sol.exact:
        assert sol.total_value == pytest.approx(brute_force(values, weights, capacity), rel=REL, abs=1e-9)


def test_common_divisor_keeps_huge_instances_exact(brute_force):
    """Allocator-rounded sizes (multiples of 2 MiB) solve exactly even against 80 GiB."""
    rng = random.Random(7)
    for _ in range(20):
        values = [rng.uniform(0.001, 0.05) for _ in range(12)]
        weights = [2 * MiB * rng.randint(1, 6000) for _ in range(12)]
        capacity = 80 * GiB + rng.randint(0, 2 * MiB - 1)
        capacity = min(capacity, sum(weights) - 1)
        sol = solve_knapsack(values, weights, capacity)
        assert sol.exact and sol.granularity > 1 and sol.granularity % (2 * MiB) == 0
        check_consistent(sol, values, weights, capacity)
        assert sol.total_value == pytest.approx(brute_force(values, weights, capacity), rel=REL)


def test_two_hundred_blocks_against_80_gib_in_under_a_second():
    """The planner's speed claim (SPEC §3): 200 layers, 80 GiB, well under a second."""
    rng = np.random.default_rng(0)
    weights = rng.integers(16 * MiB, 2 * GiB, 200).tolist()  # ~200 GiB of activations in all
    values = rng.uniform(1e-4, 5e-3, 200).tolist()
    capacity = 80 * GiB
    times = []
    for _ in range(3):
        start = time.perf_counter()
        sol = solve_knapsack(values, weights, capacity)
        times.append(time.perf_counter() - start)
    print(
        f"\nsolve_knapsack: 200 items, 80 GiB: best {min(times) * 1e3:.1f} ms, "
        f"g = {sol.granularity} B, {len(sol.chosen)} chosen, "
        f"{sol.total_weight / GiB:.3f} GiB used, slack {(capacity - sol.total_weight) / MiB:.1f} MiB"
    )
    check_consistent(sol, values, weights, capacity)
    assert sol.granularity > 1  # the test is about the discretised path
    assert min(times) < 1.0
    # Discretisation costs at most (n + 1)(g - 1) bytes of capacity: the plan uses the rest.
    assert capacity - sol.total_weight < 201 * sol.granularity + max(weights)


def test_everything_fits_needs_no_table():
    sol = solve_knapsack([1.0, 2.0, -1.0], [10**12, 3 * 10**12, 1], 10**13)
    assert sol.chosen == (0, 1) and sol.exact and sol.granularity == 1
    assert sol.total_weight == 4 * 10**12 and sol.total_value == 3.0


def test_empty_input():
    sol = solve_knapsack([], [], 100)
    assert sol == KnapsackSolution(chosen=(), total_value=0.0, total_weight=0, granularity=1, exact=True)


def test_zero_capacity_takes_only_free_items():
    sol = solve_knapsack([1.0, 2.0, 0.0, -3.0], [0, 1, 0, 0], 0)
    assert sol.chosen == (0,) and sol.total_weight == 0


def test_item_heavier_than_capacity_is_never_taken():
    sol = solve_knapsack([100.0, 1.0], [11, 10], 10)
    assert sol.chosen == (1,)


def test_negative_and_zero_values_are_never_taken_even_with_room():
    sol = solve_knapsack([-1.0, 0.0, 0.5], [1, 1, 1], 100)
    assert sol.chosen == (2,)


def test_numpy_inputs_are_accepted():
    values, weights = np.array([3.0, 4.0]), np.array([2, 3], dtype=np.int64)
    sol = solve_knapsack(values, weights, np.int64(4), granularity=np.int64(1))
    assert sol.chosen == (1,) and type(sol.granularity) is int and type(sol.total_weight) is int


@pytest.mark.parametrize(
    ("values", "weights", "capacity", "granularity", "error", "match"),
    [
        ([1.0], [1], -1, None, ValueError, "capacity must be >= 0"),
        ([1.0], [-1], 5, None, ValueError, "weights must be >= 0"),
        ([1.0, 2.0], [1], 5, None, ValueError, "differ in length"),
        ([float("nan")], [1], 5, None, ValueError, "finite"),
        ([float("inf")], [1], 5, None, ValueError, "finite"),
        ([1.0], [1.5], 5, None, TypeError, "integer"),
        ([1.0], [1], 5.0, None, TypeError, "integer"),
        ([1.0], [1], 5, 0, ValueError, "granularity must be >= 1"),
    ],
)
def test_bad_input_is_rejected_clearly(values, weights, capacity, granularity, error, match):
    with pytest.raises(error, match=match):
        solve_knapsack(values, weights, capacity, granularity=granularity)


def test_explicit_granularity_too_fine_for_memory_is_refused():
    with pytest.raises(ValueError, match=r"too large to hold in memory; pass granularity >= 64"):
        solve_knapsack([1.0, 1.0], [1, 2**32], 2**32, granularity=1)
    sol = solve_knapsack([1.0, 1.0], [1, 2**32], 2**32, granularity=2**12)
    assert sol.chosen == (1,) or sol.chosen == (0,)
