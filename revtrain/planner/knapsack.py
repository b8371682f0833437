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

__all__ = ["KnapsackSolution", "MultipleChoiceSolution", "solve_knapsack", "solve_multiple_choice"]

# Work bound for the automatic granularity: table cells (items x capacity units). Each cell costs
# a few numpy element operations, so this bound keeps solving well under a second.
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


@dataclass(frozen=True)
class MultipleChoiceSolution:
    """The answer of :func:`solve_multiple_choice`."""

    choice: tuple[int, ...]
    """Per group, the index of the chosen option."""
    total_value: float
    """Sum of the values of the chosen options."""
    total_weight: int
    """Sum of the weights of the chosen options, exact; ``<= capacity``."""
    granularity: int
    """Bytes per table unit (1: no discretisation)."""
    exact: bool
    """True when no weight was rounded, so the solution is optimal for the exact problem."""


def solve_multiple_choice(
    groups: Sequence[Sequence[tuple[float, int]]],
    capacity: int,
    *,
    granularity: int | None = None,
) -> MultipleChoiceSolution:
    """Solve the multiple-choice knapsack exactly: one option per group, the most total value
    whose total weight is at most ``capacity``.

    Each group is a list of ``(value, weight)`` options (a layer's modes: value the seconds an
    option saves, weight the bytes it adds; both may be negative, e.g. recomputation saves bytes
    and costs time). Weights are shifted by each group's lightest option, so the table runs over
    what the options add above the lightest choice of every group; rounding is one-sided as in
    :func:`solve_knapsack` (weights up, capacity down), and when it is not exact a greedy pass
    then upgrades groups to better options that still fit in exact bytes.

    Raises:
        ValueError: an empty group, more than 255 options in a group, a non-finite value, or a
            capacity below the sum of every group's lightest option (no choice fits; the message
            gives that sum).
        TypeError: a weight, capacity or granularity that is not an integer.
    """
    cap = _as_int(capacity, "capacity")
    g_user = None if granularity is None else _as_int(granularity, "granularity")
    if g_user is not None and g_user < 1:
        raise ValueError(f"granularity must be >= 1, got {g_user}")
    vals: list[list[float]] = []
    wts: list[list[int]] = []
    for k, group in enumerate(groups):
        if not group:
            raise ValueError(f"group {k} has no option; every group needs at least one")
        if len(group) > 255:
            raise ValueError(f"group {k} has {len(group)} options; at most 255 are supported")
        v = [float(o[0]) for o in group]
        if not all(math.isfinite(x) for x in v):
            raise ValueError(f"values must be finite; group {k} has {v}")
        vals.append(v)
        wts.append([_as_int(o[1], f"groups[{k}] weight") for o in group])
    base = sum(min(w) for w in wts)
    room = cap - base
    if room < 0:
        raise ValueError(
            f"capacity {cap} is below {base}, the weight of the lightest option of every group: no choice fits"
        )
    extra = [[w - min(ws) for w in ws] for ws in wts]
    top = sum(max(e) for e in extra)
    if top <= room:
        g = 1 if g_user is None else g_user
        exact = True
        choice = [max(range(len(v)), key=lambda j: (v[j], -extra[k][j])) for k, v in enumerate(vals)]
    else:
        # Options worth a table cell: they fit, and beat their group's lightest option (others
        # are never chosen, so their rounding cannot cost the optimum).
        light = [min(range(len(es)), key=lambda j: (es[j], -vals[k][j])) for k, es in enumerate(extra)]
        relevant = [
            e for k, es in enumerate(extra) for j, e in enumerate(es) if 0 < e <= room and vals[k][j] > vals[k][light[k]]
        ]
        g = _auto_granularity(relevant or [1], room) if g_user is None else g_user
        exact = all(e % g == 0 for e in relevant)
        units = [[-(-e // g) for e in es] for es in extra]
        cap_units = min(room // g, sum(max(u) for u in units))
        if cap_units > _LIMIT_UNITS or cap_units * len(vals) > _LIMIT_CELLS:
            smallest = max(-(-room // _LIMIT_UNITS), -(-room * len(vals) // _LIMIT_CELLS))
            raise ValueError(
                f"granularity {g} makes a table of {len(vals)} groups x {cap_units} capacity units, too large to "
                f"hold in memory; pass granularity >= {smallest}, or None to choose one"
            )
        choice = _mc_dp(vals, units, cap_units)
        if not exact:
            left = room - sum(extra[k][j] for k, j in enumerate(choice))
            order = sorted(range(len(vals)), key=lambda k: -max(vals[k]))
            for k in order:
                here = choice[k]
                for j in sorted(range(len(vals[k])), key=lambda j: -vals[k][j]):
                    if vals[k][j] <= vals[k][here]:
                        break
                    if extra[k][j] - extra[k][here] <= left:
                        left -= extra[k][j] - extra[k][here]
                        choice[k] = j
                        break
    total_weight = sum(wts[k][j] for k, j in enumerate(choice))
    assert total_weight <= cap, "multiple-choice solution exceeds the capacity"  # invariant of the DP
    return MultipleChoiceSolution(
        choice=tuple(choice),
        total_value=math.fsum(vals[k][j] for k, j in enumerate(choice)),
        total_weight=total_weight,
        granularity=g,
        exact=exact,
    )


def _mc_dp(values: list[list[float]], units: list[list[int]], capacity: int) -> list[int]:
    """DP over capacity, one group at a time: ``best[c]`` is the best value with at most ``c``
    units above every group's lightest option; ``pick[k, c]`` the option group ``k`` took there."""
    c = capacity
    best = np.zeros(c + 1, dtype=np.float64)
    pick = np.zeros((len(values), c + 1), dtype=np.uint8)
    for k, (vs, us) in enumerate(zip(values, units)):
        new = np.full(c + 1, -np.inf)
        for j, (v, u) in enumerate(zip(vs, us)):
            if u > c:
                continue
            cand = np.full(c + 1, -np.inf)
            cand[u:] = best[: c + 1 - u] + v
            better = cand > new
            new[better] = cand[better]
            pick[k][better] = j
        best = new
    choice = [0] * len(values)
    j = c
    for k in range(len(values) - 1, -1, -1):
        choice[k] = int(pick[k, j])
        j -= units[k][choice[k]]
    return choice
