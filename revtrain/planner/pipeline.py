"""The planner end to end: verify, profile, solve (Jiang et al. 2021, §3.3, Fig. 3).

Stage 4, training with the plan, is ``plan.apply(model)`` followed by ordinary training::

    plan = plan_for_model(model, (x, y), "6GiB", device=device)
    plan.apply(model)
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from revtrain.core import verify_invertible
from revtrain.planner.budget import resolve_budget
from revtrain.planner.measure import (
    LossFn,
    OptimizerFactory,
    batch_to,
    measure_step,
    measure_step_stats,
    resolve_device,
)
from revtrain.planner.plan import Plan, Profile, make_plan
from revtrain.planner.profile import profile_model

__all__ = ["plan_for_model", "refine_plan"]


def plan_for_model(
    model: nn.Module,
    example_batch: tuple[Any, Tensor],
    budget: int | str | None = None,
    *,
    loss_fn: LossFn = F.cross_entropy,
    make_optimizer: OptimizerFactory | None = None,
    device: torch.device | str | None = None,
    repeats: int = 3,
    warmup: int = 2,
    verify: bool = True,
    measure: bool = False,
    model_name: str | None = None,
    profile: Profile | None = None,
    refine: int = 4,
) -> Plan:
    """Choose a mode per reversible block of ``model`` for the fastest step within ``budget``.

    Runs stage 1 (:func:`revtrain.core.verify_invertible` on the example inputs), stage 2
    (:func:`~revtrain.planner.profile.profile_model` at the example batch's size) and stage 3
    (:func:`~revtrain.planner.make_plan`, trusting a measured baseline-C that fits). The model
    is left as it was, apart from being moved to ``device``; apply the plan with
    ``plan.apply(model)``.

    Args:
        model: A model with reversible blocks.
        example_batch: ``(inputs, targets)`` at the batch size training will use; a plan holds
            only for that batch size, dtype and device.
        budget: Peak memory of a training step: bytes, ``"6GiB"``, ``"0.5"`` / ``"50%"`` of the
            device's memory, or None for all the device can give
            (:func:`~revtrain.planner.budget.resolve_budget`).
        loss_fn: ``loss_fn(model(inputs), targets)``; default cross-entropy.
        make_optimizer: The training's optimizer factory, whose state counts in the peak;
            default SGD with momentum.
        device: Where training runs; ``"auto"`` picks CUDA when present; default the model's
            device. The model is moved there (``model.to(device)``).
        repeats: Timed repetitions per measurement; medians are used.
        warmup: Untimed repetitions before each measurement.
        verify: Run stage 1 first.
        measure: Also train one more set of steps with the plan and record the measured step
            time and peak in the plan.
        model_name: Name recorded in the profile and plan; default the model's class name.
        profile: A profile of this model, batch size and device made earlier; skips stage 2.
        refine: Up to this many extra plans to measure, looking for a faster one that still
            fits (:func:`refine_plan`); 0 keeps the paper's plan as solved.

    Returns:
        The plan, with predicted (and, with ``measure``, measured) step time and peak, and
        ``budget_source`` saying how the budget was read.

    Raises:
        BudgetTooSmallError: even all-M-mode needs more than the budget; the message gives the
            numbers and the largest batch size that fits.
        NotInvertibleError: a block does not rebuild its input (``verify``).
        ValueError: a malformed budget, or a model without reversible blocks.
    """
    dev = resolve_device(model, device)
    model.to(dev)
    budget_bytes, explanation = resolve_budget(budget, dev)
    inputs, targets = batch_to(example_batch, dev)
    if verify:
        verify_invertible(model, inputs)
    if profile is None:
        profile = profile_model(
            model, (inputs, targets), loss_fn=loss_fn, make_optimizer=make_optimizer, device=dev,
            repeats=repeats, warmup=warmup, model_name=model_name,
        )
    plan = make_plan(profile, budget_bytes, use_measured_baseline_c=True)
    if refine > 0:
        plan = refine_plan(
            model, (inputs, targets), profile, plan, steps=refine, loss_fn=loss_fn,
            make_optimizer=make_optimizer, device=dev,
        )
    plan.budget_source = explanation
    if measure:
        plan.measured_step_time_s, plan.measured_peak_bytes = measure_step(
            model, (inputs, targets), loss_fn=loss_fn, make_optimizer=make_optimizer,
            device=dev, modes=plan.modes, repeats=repeats, warmup=warmup,
        )
    return plan


def refine_plan(
    model: nn.Module,
    batch: tuple[Any, Tensor],
    profile: Profile,
    plan: Plan,
    *,
    steps: int = 4,
    loss_fn: LossFn = F.cross_entropy,
    make_optimizer: OptimizerFactory | None = None,
    device: torch.device | str | None = None,
    warmup: int = 1,
) -> Plan:
    """Use the headroom the paper's memory model leaves: try richer plans, keep the fastest that fits.

    The knapsack's constraint ``m_o + sum(m over C-mode blocks) <= budget`` adds every C-mode
    block's bytes to baseline-M's peak, as if they were all live at that moment. They are not
    when baseline-M peaks elsewhere (late in backward, after most blocks have freed what they
    kept, or in the optimizer step), so a plan's real peak is often well below the model's.
    This bisects the knapsack's capacity between ``budget - m_o`` (the plan as solved) and the
    bytes of every block worth switching, solving at each capacity and *measuring* the plan's
    peak on a real step; a plan is kept only if its measured peak fits the budget and it is
    predicted faster. The returned plan's ``predicted_peak_bytes`` is then that measured peak.

    Args:
        model, batch, profile: As for :func:`plan_for_model`; ``plan`` was solved from ``profile``.
        plan: The plan as solved (its budget is the budget to meet).
        steps: Most plans to measure (each costs ``warmup + 1`` training steps).
        loss_fn, make_optimizer, device: As :func:`plan_for_model`.
        warmup: Steps before each measured one; one creates the optimizer state, which is all
            a peak needs.

    Returns:
        ``plan`` itself when nothing better fits, else a new plan for the same budget.
    """
    budget = plan.budget_bytes
    worth = [b for b in profile.blocks if b.t_e_s > 0]
    lo, hi = budget - profile.m_o_bytes, sum(b.m_bytes for b in worth)
    if steps <= 0 or hi <= lo or all(plan.modes[b.name] == "C" for b in worth):
        return plan  # every block worth switching is in C-mode already
    peaks: dict[tuple[str, ...], int] = {}

    def peak_of(candidate: Plan) -> int:
        key = tuple(candidate.modes.values())
        if key not in peaks:
            peaks[key] = measure_step_stats(
                model, batch, loss_fn=loss_fn, make_optimizer=make_optimizer, device=device,
                modes=candidate.modes, repeats=0, warmup=warmup,
            ).peak_bytes
        return peaks[key]

    best = plan
    for _ in range(steps):
        mid = (lo + hi) // 2
        if mid <= lo:
            break
        candidate = make_plan(profile, profile.m_o_bytes + mid)
        if candidate.modes == best.modes:
            lo = mid  # the same plan as the best so far, which fits
            continue
        peak = peak_of(candidate)
        if peak <= budget:
            lo = mid
            if candidate.predicted_step_time_s < best.predicted_step_time_s:
                best = dataclasses.replace(candidate, budget_bytes=budget, predicted_peak_bytes=peak)
        else:
            hi = mid
    return best
