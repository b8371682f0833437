"""Stage 3 of the planner: solve the knapsack for a budget, then use the headroom it leaves.

:func:`make_plan` is the paper's solution (Jiang et al. 2021, §3.2-3.3, Problem 6). Take
baseline-M (every reversible block in M-mode) as the reference; then a block is an **item**,
chosen means **C-mode**, its **value** is ``t_e`` (the seconds per step C-mode saves), its
**weight** ``m`` (the bytes C-mode keeps) and the **capacity** ``budget - m_o``. The solver
maximises the time saved while the predicted peak ``m_o + sum(m over C-mode blocks)`` stays
within the budget, in exact bytes; the predicted step time is ``baseline-M step - sum(t_e over
C-mode blocks)``, the sum scaled by the profile's ``t_e_scale`` where it has one (what a second of
isolated ``t_e`` saves in a whole step, measured; it does not change which blocks are chosen).

:func:`refine_plan` measures: the additive memory model over-estimates real peaks, so richer
plans are tried and kept when their measured peak still fits (docs/planner.md, "Refinement").
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from revtrain.memory import format_bytes, parse_bytes
from revtrain.planner.data import Plan, Profile, _nonneg_int
from revtrain.planner.errors import BudgetTooSmallError
from revtrain.planner.knapsack import solve_multiple_choice
from revtrain.planner.measure import measure_steps, step_memory_floor
from revtrain.planner.setup import MeasurementSetup

__all__ = ["CHOICES", "check_budget_floor", "fit_plan", "make_plan", "refine_plan"]


CHOICES = ("all", "mc")
"""What the planner may choose: ``"all"`` (every layer's options: M/C for reversible layers, keep,
recompute and, on CUDA, offload for plain layers) or ``"mc"`` (Jiang et al.'s M/C choice for
reversible layers only; plain layers keep)."""


def make_plan(
    profile: Profile,
    budget_bytes: int | str,
    *,
    granularity: int | None = None,
    use_measured_baseline_c: bool = False,
    choices: str = "all",
) -> Plan:
    """Solve for the fastest choice per layer whose predicted peak fits ``budget_bytes``.

    A multiple-choice knapsack (:func:`~revtrain.planner.knapsack.solve_multiple_choice`), one
    group per layer, with baseline-M (every block in M-mode, every plain layer kept) as the
    reference: a reversible block offers M-mode ``(0 s, 0 bytes)`` and C-mode ``(t_e saved, m
    added)``; a plain layer offers keeping ``(0, 0)``, recomputing ``(-recompute_s, -bytes freed)``
    and, when profiled (CUDA), offloading. The solver maximises the seconds saved subject to
    ``m_o + sum(bytes added) <= budget``, in exact bytes. With ``choices="mc"`` plain layers keep
    (the paper's 0/1 knapsack).

    Args:
        profile: Measurements at one batch size.
        budget_bytes: Memory the training step may use at its peak: bytes, or a size such as
            ``"6GiB"`` (see :func:`revtrain.memory.parse_bytes`).
        granularity: Passed to the solver; None picks it.
        use_measured_baseline_c: When the profile's *measured* baseline-C peak
            (``peak_C_bytes``) fits the budget, run every block that C-mode speeds up in C-mode
            and keep every plain layer, with predicted peak ``min(m_o + sum(m), peak_C_bytes)``.
            ``m_o + sum(m)`` adds each block's bytes as if all were live at baseline-M's peak
            moment, which overestimates when they are not; the measured baseline-C peak is the
            tighter bound, on the assumption that moving a block from C-mode to M-mode never
            raises the peak.
        choices: ``"all"`` or ``"mc"`` (:data:`CHOICES`).

    Raises:
        BudgetTooSmallError: if the budget is below the smallest plan's predicted peak: baseline-M's
            ``m_o``, less what recomputing every plain layer frees with ``choices="all"``.
    """
    if choices not in CHOICES:
        raise ValueError(f"choices must be one of {CHOICES}, got {choices!r}")
    if isinstance(budget_bytes, str):
        budget = parse_bytes(budget_bytes)
    else:
        budget = _nonneg_int(budget_bytes, "budget_bytes")
    layers = profile.layers if choices == "all" else []
    capacity = budget - profile.m_o_bytes
    options = [layer.options() for layer in layers]
    floor = profile.m_o_bytes - sum(max(saves for _, saves in opts.values()) for opts in options)
    if budget < floor:
        raise _budget_too_small(profile, budget, floor if layers else None)
    measured_c = profile.peak_C_bytes
    if use_measured_baseline_c and measured_c is not None and profile.m_o_bytes <= measured_c <= budget:
        capacity = max(capacity, sum(b.m_bytes for b in profile.blocks))  # every useful block fits
    else:
        measured_c = None
    groups = [[(0.0, 0), (profile.saved_time_s(b.t_e_s), b.m_bytes)] for b in profile.blocks]
    names = [list(opts) for opts in options]
    groups += [[(-cost, -saves) for cost, saves in opts.values()] for opts in options]
    sol = solve_multiple_choice(groups, capacity, granularity=granularity)
    n = len(profile.blocks)
    chosen_layers = {layer.name: names[k][sol.choice[n + k]] for k, layer in enumerate(layers)}
    if measured_c is not None and any(opt != "keep" for opt in chosen_layers.values()):
        measured_c = None  # baseline-C keeps every plain layer; this plan does not
    cost = sum(options[k][opt][0] for k, opt in enumerate(chosen_layers.values()))
    peak = profile.m_o_bytes + sol.total_weight
    if measured_c is not None:
        peak = min(peak, measured_c)
    return Plan(
        modes={b.name: ("C" if sol.choice[i] == 1 else "M") for i, b in enumerate(profile.blocks)},
        budget_bytes=budget,
        granularity=sol.granularity,
        predicted_step_time_s=profile.step_time_M_s - sol.total_value,
        predicted_peak_bytes=peak,
        model=profile.model,
        batch_size=profile.batch_size,
        input_shape=tuple(profile.input_shape),
        layers=chosen_layers,
        recompute_cost_s=cost,
    )


def refine_plan(
    setup: MeasurementSetup,
    profile: Profile,
    plan: Plan,
    *,
    steps: int = 4,
    progress: Callable[[str], None] | None = None,
    choices: str = "all",
) -> Plan:
    """Use the headroom the paper's memory model leaves: try richer plans, keep the fastest that fits.

    The knapsack's constraint ``m_o + sum(m over C-mode blocks) <= budget`` adds every C-mode
    block's bytes to baseline-M's peak, as if they were all live at that moment. They are not
    when baseline-M peaks elsewhere (late in backward, after most blocks have freed what they
    kept, or in the optimizer step), so a plan's real peak is often well below the model's.
    This bisects the knapsack's capacity between ``budget - m_o`` (the plan as solved) and the
    bytes of every block worth switching, solving at each capacity and *measuring* the plan's
    peak on a real step; a plan is kept only if its measured peak fits the budget and it saves
    more ``t_e`` (is predicted faster). The returned plan's ``predicted_peak_bytes`` is then that
    measured peak.

    Args:
        setup: The prepared model and batch ``profile`` was measured on.
        profile: The profile ``plan`` was solved from.
        plan: The plan as solved (its budget is the budget to meet).
        steps: Most plans to measure (each costs one warm-up step and one measured step; the
            warm-up creates the optimizer state, which is all a peak needs).
        progress: Called with a line per measured candidate.
        choices: As :func:`make_plan`.

    Returns:
        ``plan`` itself when nothing better fits, else a new plan for the same budget.
    """
    budget = plan.budget_bytes
    worth = [b for b in profile.blocks if b.t_e_s > 0]
    lo, hi = budget - profile.m_o_bytes, sum(b.m_bytes for b in worth)
    if steps <= 0 or hi <= lo or (
        all(plan.modes[b.name] == "C" for b in worth) and not plan.recomputed_layers
    ):
        return plan  # every block worth switching is in C-mode already, every plain layer kept
    peaks: dict[tuple[str, ...], int] = {}

    def peak_of(candidate: Plan) -> int:
        key = (*candidate.modes.values(), *candidate.layers.values())
        if key not in peaks:
            peaks[key] = measure_steps(setup, {"plan": candidate.setting()}, repeats=0, warmup=1)["plan"].peak_bytes
            if progress is not None:
                fits = "fits" if peaks[key] <= budget else "over budget"
                progress(f"  refining: {len(candidate.c_mode_blocks)} blocks in C-mode peak at "
                         f"{format_bytes(peaks[key])} ({fits})")
        return peaks[key]

    def value(candidate: Plan) -> float:  # the knapsack's objective: the seconds saved
        return profile.step_time_M_s - candidate.predicted_step_time_s

    best = plan
    for _ in range(steps):
        mid = (lo + hi) // 2
        if mid <= lo:
            break
        candidate = make_plan(profile, profile.m_o_bytes + mid, choices=choices)
        if candidate.modes == best.modes and candidate.layers == best.layers:
            lo = mid  # the same plan as the best so far, which fits
            continue
        peak = peak_of(candidate)
        if peak <= budget:
            lo = mid
            if value(candidate) > value(best):
                best = dataclasses.replace(candidate, budget_bytes=budget, predicted_peak_bytes=peak)
        else:
            hi = mid
    return best


def fit_plan(
    setup: MeasurementSetup,
    profile: Profile,
    plan: Plan,
    *,
    tries: int = 4,
    choices: str = "all",
    progress: Callable[[str], None] | None = None,
) -> Plan:
    """Measure ``plan``'s peak on one real step and, while it is over the budget, solve again for
    a budget lowered by the excess; returns a plan whose measured peak fits, that peak recorded
    as its ``predicted_peak_bytes``.

    The additive memory model can under-estimate a plan that recomputes: the recomputation
    re-creates a layer's activations in backward, next to what is live there. Measuring is
    what makes a plan keep its budget.

    Raises:
        BudgetTooSmallError: no plan's measured peak fits within ``tries`` solves.
    """
    budget = plan.budget_bytes
    target = budget
    candidate = plan
    peak = budget + 1
    for _ in range(max(1, tries)):
        peak = measure_steps(setup, {"plan": candidate.setting()}, repeats=0, warmup=1)["plan"].peak_bytes
        if peak <= budget:
            return dataclasses.replace(candidate, budget_bytes=budget, predicted_peak_bytes=peak)
        if progress is not None:
            progress(f"  the plan measured {format_bytes(peak)}, over the budget: solving again for "
                     f"{format_bytes(target - (peak - budget))}")
        target -= peak - budget
        try:
            candidate = make_plan(profile, max(0, target), choices=choices)
        except BudgetTooSmallError:
            break
    raise BudgetTooSmallError(
        f"budget {format_bytes(budget)} is below what the smallest plan found measures ({format_bytes(peak)}) for "
        f"{profile.model!r} at batch size {profile.batch_size}; raise the budget to at least {format_bytes(peak)} "
        "or reduce the batch size",
        budget_bytes=budget, required_bytes=peak, batch_size=profile.batch_size, max_batch_size=None,
    )


def check_budget_floor(setup: MeasurementSetup, budget: int, profile: Profile | None = None) -> None:
    """Refuse, before anything runs, a budget below the known minimum: with a profile, its
    baseline-M peak ``m_o``; without, what any step of this model and batch holds, its
    parameters, their gradients, the buffers and the batch (the optimizer state and the
    activations come on top, so a budget that passes may still be refused once profiled).

    Raises:
        BudgetTooSmallError: the budget is below that minimum.
    """
    if profile is not None:
        floor = profile.floor_bytes
        if budget < floor:
            raise _budget_too_small(profile, budget, floor if profile.layers else None)
        return
    floor = step_memory_floor(setup)
    if budget < floor:
        raise BudgetTooSmallError(
            f"budget {format_bytes(budget)} is below the {format_bytes(floor)} that the parameters, "
            f"their gradients, the buffers and the batch of {setup.model_name!r} at batch size "
            f"{setup.batch_size} take before any activation or optimizer state; raise the budget "
            "well above that or reduce the batch size (refused before profiling)",
            budget_bytes=budget, required_bytes=floor, batch_size=setup.batch_size, max_batch_size=None,
        )


def _budget_too_small(profile: Profile, budget: int, floor: int | None = None) -> BudgetTooSmallError:
    need = profile.m_o_bytes if floor is None else floor
    b_max = profile.max_batch_size(budget)
    if floor is None:
        what = f"that even all-M-mode needs (baseline-M peak of {profile.model!r} at batch size {profile.batch_size})"
    else:
        what = (
            f"that even the smallest plan needs (all-M-mode and every plain layer recomputed: baseline-M peak of "
            f"{profile.model!r} at batch size {profile.batch_size}, {format_bytes(profile.m_o_bytes)}, less "
            f"{format_bytes(profile.m_o_bytes - floor)} that recomputing frees)"
        )
    msg = (
        f"budget {format_bytes(budget)} is below the {format_bytes(need)} {what}; raise "
        f"the budget to at least {format_bytes(need)} ({need} bytes) or reduce the batch size"
    )
    if profile.fixed_bytes is None:
        how = (
            "assuming all of the baseline-M peak grows with the batch size; record the profile's "
            "fixed_bytes for an estimate"
        )
        fits = f"the largest batch size that fits is at most {b_max}"
    else:
        per_sample = (profile.m_o_bytes - profile.fixed_bytes) / profile.batch_size
        how = (
            f"memory taken as linear in the batch size: {format_bytes(profile.fixed_bytes)} "
            f"fixed + {format_bytes(round(per_sample))} per sample"
        )
        fits = f"the largest batch size that fits is about {b_max}"
    if b_max < 1:
        fits = "not even batch size 1 fits"
    msg += f"; at this budget {fits} ({how})"
    return BudgetTooSmallError(
        msg, budget_bytes=budget, required_bytes=need, batch_size=profile.batch_size, max_batch_size=b_max
    )


# --- JSON ------------------------------------------------------------------------------------
