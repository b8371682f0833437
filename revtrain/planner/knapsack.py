"""Exact 0/1 knapsack by dynamic programming, on byte-sized weights.

Stage 3 ("solve") of the planner (Jiang et al. 2021, Problem 6 and Algorithm 1). This module
knows nothing about models: it maximises ``sum(values[chosen])`` subject to
``sum(weights[chosen]) <= capacity``. :func:`revtrain.planner.make_plan` maps blocks onto items.

Weights are bytes and may be huge (an 80 GiB budget), so the table is built over *units* of
``g`` bytes. Rounding is one-sided so that every answer is feasible in exact bytes:

* an item's weight in units is ``ceil(w / g)`` (rounded up),
* the capacity in units is ``floor(capacity / g)`` (rounded down).

When ``g`` divides every weight (``g == 1`` in particular) nothing is lost and the answer is
optimal for the exact problem. Otherwise the answer is at least as good as the exact optimum
for the capacity reduced by ``(n + 1) * (g - 1)`` bytes, where ``n`` is the number of items,
and a final greedy pass adds any left-out item that still fits in the exact bytes remaining.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

__all__ = ["KnapsackSolution", "solve_knapsack"]

# Work bound for the automatic granularity: table cells (items x capacity units). Each cell costs
# a few numpy element operations; 2**26 cells take ~0.05-0.1 s on one CPU core.
_MAX_CELLS = 2**26
# Upper bound on capacity units whatever the item count (two float64 rows of this length).
_MAX_UNITS = 2**20
# Refuse an explicit granularity whose table would not fit in memory: ~1 GiB of float64 rows,
# ~1 GiB of bit-packed keep matrix.
_LIMIT_UNITS = 2**26
_LIMIT_CELLS = 2**33


@dataclass(frozen=True)
class KnapsackSolution:
    """The answer of :func:`solve_knapsack`."""

    chosen: tuple[int, ...]
    """Indices of the chosen items, sorted ascending."""
    total_value: float
    """Sum of the values of the chosen items."""
    total_weight: int
    """Sum of the weights of the chosen items, in exact (undiscretised) units; ``<= capacity``."""
    granularity: int
    """Bytes per table unit ``g`` that the dynamic programme used (1: no discretisation)."""
    exact: bool
    """True when no weight was rounded (``g`` divides every weight that could fit), so the
    solution is optimal for the exact problem, not only for the discretised one."""


def solve_knapsack(
    values: Sequence[float],
    weights: Sequence[int],
    capacity: int,
    *,
    granularity: int | None = None,
) -> KnapsackSolution:
    """Solve the 0/1 knapsack problem exactly (up to the reported discretisation).

    An item whose value is zero or negative is never chosen (it would only cost weight); one
    with zero weight and positive value always is. Among equally valuable sets, which one is
    returned is unspecified.

    Args:
        values: Value of each item (any finite float).
        weights: Weight of each item, a non-negative integer (bytes in the planner).
        capacity: Largest total weight allowed, a non-negative integer.
        granularity: Units of ``g`` weight per table cell. ``None`` picks the smallest ``g``
            that keeps the table within a fixed work bound (well under a second for hundreds
            of items): 1 when the capacity is small enough, else the greatest common divisor
            of the weights if that suffices (still exact), else ``ceil(capacity / units)``.

    Returns:
        The chosen items, their total value and exact total weight, and ``g``.

    Raises:
        ValueError: on a negative capacity or weight, a non-finite value, lengths that
            differ, a granularity below 1, or one so fine that the table would not fit in
            memory (the message names the smallest acceptable one).
        TypeError: on a weight, capacity or granularity that is not an integer.
    """
    vals, wts, cap, g_user = _validate(values, weights, capacity, granularity)
    n = len(vals)

    free = [i for i in range(n) if vals[i] > 0 and wts[i] == 0]
    # Items worth considering: positive value, positive weight, fit alone.
    cand = [i for i in range(n) if vals[i] > 0 and 0 < wts[i] <= cap]
    cand_weight = sum(wts[i] for i in cand)
    if cand_weight <= cap:
        # Everything worth having fits: no table needed, and the answer is exact.
        g = 1 if g_user is None else g_user
        exact = True
        chosen = set(cand)
    else:
        g = _auto_granularity([wts[i] for i in cand], cap) if g_user is None else g_user
        exact = all(wts[i] % g == 0 for i in cand)
        units = [-(-wts[i] // g) for i in cand]
        cap_units = min(cap // g, sum(units))  # more units than all items need change nothing
        if cap_units > _LIMIT_UNITS or cap_units * len(cand) > _LIMIT_CELLS:
            smallest = max(-(-cap // _LIMIT_UNITS), -(-cap * len(cand) // _LIMIT_CELLS))
            raise ValueError(
                f"granularity {g} makes a table of {len(cand)} items x {cap_units} capacity units, "
                f"too large to hold in memory; pass granularity >= {smallest}, or None to choose one"
            )
        taken = _dp_choose([vals[i] for i in cand], units, cap_units)
        chosen = {cand[k] for k in taken}

    if not exact:
        # Rounding may have left exact bytes free; fill them greedily, best value first.
        room = cap - sum(wts[i] for i in chosen)
        for i in sorted(set(cand) - chosen, key=lambda i: (-vals[i], wts[i], i)):
            if wts[i] <= room:
                chosen.add(i)
                room -= wts[i]

    chosen.update(free)
    order = tuple(sorted(chosen))
    total_weight = sum(wts[i] for i in order)
    assert total_weight <= cap, "knapsack solution exceeds the capacity"  # invariant of the DP
    return KnapsackSolution(
        chosen=order,
        total_value=math.fsum(vals[i] for i in order),
        total_weight=total_weight,
        granularity=g,
        exact=exact,
    )


def _validate(
    values: Sequence[float], weights: Sequence[int], capacity: int, granularity: int | None
) -> tuple[list[float], list[int], int, int | None]:
    if len(values) != len(weights):
        raise ValueError(f"values and weights differ in length: {len(values)} != {len(weights)}")
    cap = _as_int(capacity, "capacity")
    if cap < 0:
        raise ValueError(
            f"capacity must be >= 0, got {cap}; a negative capacity means that even choosing "
            "nothing does not fit"
        )
    g = None if granularity is None else _as_int(granularity, "granularity")
    if g is not None and g < 1:
        raise ValueError(f"granularity must be >= 1, got {g}")
    vals = [float(v) for v in values]
    bad = [i for i, v in enumerate(vals) if not math.isfinite(v)]
    if bad:
        raise ValueError(f"values must be finite; item(s) {bad[:5]} are not")
    wts = [_as_int(w, f"weights[{i}]") for i, w in enumerate(weights)]
    neg = [i for i, w in enumerate(wts) if w < 0]
    if neg:
        raise ValueError(f"weights must be >= 0; item(s) {neg[:5]} are negative")
    return vals, wts, cap, g


def _as_int(x: object, name: str) -> int:
    if isinstance(x, bool):
        raise TypeError(f"{name} must be an integer, got a bool")
    try:
        return operator.index(x)  # type: ignore[arg-type]
    except TypeError:
        raise TypeError(f"{name} must be an integer (bytes), got {x!r}") from None


def _auto_granularity(weights: list[int], capacity: int) -> int:
    max_units = max(1, min(_MAX_UNITS, _MAX_CELLS // max(1, len(weights))))
    if capacity <= max_units:
        return 1
    g0 = math.gcd(*weights)  # lossless: every weight is a whole number of g0-byte units
    if capacity // g0 <= max_units:
        return g0
    return -(-capacity // max_units)


def _dp_choose(values: list[float], units: list[int], capacity: int) -> list[int]:
    """Classic DP over capacity, one numpy pass per item; returns the chosen item indices.

    ``best[j]`` is the best value with total units ``<= j``. Row ``k`` of ``keep`` (bit-packed,
    n x (C + 1) bits) records where item ``k`` improved ``best``; backtracking from ``j = C``
    reads it in reverse item order.
    """
    n, c = len(values), capacity
    if n == 0 or c == 0:
        return []
    best = np.zeros(c + 1, dtype=np.float64)
    cand = np.empty(c + 1, dtype=np.float64)
    row = np.zeros(c + 1, dtype=bool)
    keep = np.zeros((n, (c + 8) // 8), dtype=np.uint8)
    for k, (v, w) in enumerate(zip(values, units)):
        if w > c:
            continue
        span = c + 1 - w
        np.add(best[:span], v, out=cand[:span])
        row[:w] = False
        # Strictly greater: on a tie keep the lighter solution without this item.
        np.greater(cand[:span], best[w:], out=row[w:])
        np.copyto(best[w:], cand[:span], where=row[w:])
        keep[k] = np.packbits(row)
    taken = []
    j = c
    for k in range(n - 1, -1, -1):
        if (keep[k, j >> 3] >> (7 - (j & 7))) & 1:
            taken.append(k)
            j -= units[k]
    return taken
