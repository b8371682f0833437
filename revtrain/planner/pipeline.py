"""The planner end to end: verify, profile, solve (Jiang et al. 2021, §3.3, Fig. 3).

:func:`plan_for_model` is the entry: it prepares the model and the batch once
(:func:`~revtrain.planner.setup.prepare`) and runs :func:`run_pipeline` on them. ``revtrain
plan`` calls :func:`run_pipeline` itself, with a progress callback and the baselines measured
next to the plan. Stage 4, training with the plan, is ``plan.apply(model)`` followed by
ordinary training::

    plan = plan_for_model(model, (x, y), "6GiB", device=device)
    plan.apply(model)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from revtrain.planner.block_timing import TimingRule
from revtrain.planner.budget import resolve_budget
from revtrain.planner.data import Plan, Profile, describe_sample
from revtrain.planner.measure import StepMeasurement, measure_steps
from revtrain.planner.profile import profile_setup
from revtrain.planner.setup import LossFn, MeasurementSetup, Modes, OptimizerFactory, prepare
from revtrain.planner.solve import CHOICES, check_budget_floor, fit_plan, make_plan, refine_plan
from revtrain.planner.verify import verify_setup
from revtrain.timing import median_interval

__all__ = ["PlanningResult", "plan_for_model", "run_pipeline"]

Progress = Callable[[str], None]
"""Called with one line of text as each stage starts (``revtrain plan`` prints them)."""


@dataclass(kw_only=True)
class PlanningResult:
    """What one run of the pipeline produced."""

    plan: Plan
    """The plan (with its measured step time and peak when it was measured)."""
    profile: Profile
    """The profile it was solved from."""
    measured: dict[str, StepMeasurement] = field(default_factory=dict)
    """The final measurement, by setting: ``"plan"``, and with baselines ``"baseline-M"`` and,
    where its peak fits the budget, ``"baseline-C"``; empty when nothing was measured."""


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
    max_repeats: int | None = None,
    verify: bool = True,
    measure: bool = False,
    model_name: str | None = None,
    profile: Profile | None = None,
    refine: int = 4,
    timing: TimingRule | None = None,
    progress: Progress | None = None,
    choices: str = "all",
) -> Plan:
    """Choose a mode per reversible block of ``model`` for the fastest step within ``budget``.

    Runs stage 1 (:func:`revtrain.core.verify_invertible` on the example inputs), stage 2
    (:func:`~revtrain.planner.profile.profile_setup` at the example batch's size) and stage 3
    (:func:`~revtrain.planner.solve.make_plan`, trusting a measured baseline-C that fits, then
    :func:`~revtrain.planner.solve.refine_plan`). The model and the batch are prepared once
    (moved to ``device``, the model's state copied once); the model is left as it was, apart
    from being moved. Apply the plan with ``plan.apply(model)``.

    Args:
        model: A model with reversible blocks.
        example_batch: ``(inputs, targets)`` at the batch size training will use; a plan holds
            only for that batch size, dtype and device.
        budget: Step memory allowed: bytes, ``"6GiB"``, ``"0.5"`` / ``"50%"`` of the device's
            memory, or None for all the device can give
            (:func:`~revtrain.planner.budget.resolve_budget`).
        loss_fn: ``loss_fn(model(inputs), targets)``; default cross-entropy. A task's loss
            (``task.loss``, :class:`revtrain.tasks.Task`) fits.
        make_optimizer: The training's optimizer factory, whose state counts in the peak;
            default SGD with momentum.
        device: Where training runs; ``"auto"`` picks CUDA when present; default the model's
            device. The model is moved there (``model.to(device)``).
        repeats: Timed rounds per whole-step measurement, at least; medians are used.
        warmup: Untimed steps before each whole-step measurement.
        max_repeats: Timed rounds at most: rounds go on after ``repeats`` until every median step
            is known to 2% (:func:`~revtrain.planner.measure.measure_steps`); default
            ``4 * repeats``.
        verify: Run stage 1 first.
        measure: Also measure the plan's real step at the end and record its time and peak in
            the plan (``plan.summary()`` then prints them next to the prediction).
        model_name: Name recorded in the profile and plan; default the model's class name.
        profile: A profile of this model, batch size and device made earlier; skips stage 2.
        refine: Up to this many richer plans to measure, keeping the fastest that fits
            (:func:`~revtrain.planner.solve.refine_plan`); 0 keeps the paper's plan as solved.
        timing: When to stop timing each block's M/C pairs for ``t_e``
            (:class:`~revtrain.planner.block_timing.TimingRule`).
        progress: Called with a line as each stage starts.
        choices: ``"all"`` (default): every layer's options, recomputing (and on CUDA offloading)
            the plain layers included; ``"mc"``: Jiang et al.'s M/C choice for reversible layers
            only (:data:`~revtrain.planner.solve.CHOICES`).

    Returns:
        The plan, with predicted (and, with ``measure``, measured) step time and peak, and
        ``budget_source`` saying how the budget was read.

    Raises:
        BudgetTooSmallError: even all-M-mode needs more than the budget (refused before
            profiling when the parameters and the batch alone exceed it); the message gives the
            numbers and, once profiled, the largest batch size that fits.
        NotInvertibleError: a block does not rebuild its input (``verify``).
        ValueError: a malformed budget, or a model without reversible blocks.
    """
    with prepare(
        model, example_batch, loss_fn=loss_fn, make_optimizer=make_optimizer, device=device,
        repeats=repeats, warmup=warmup, max_repeats=max_repeats, model_name=model_name,
    ) as setup:
        result = run_pipeline(
            setup, budget, verify=verify, profile=profile, refine=refine, measure=measure,
            timing=timing, progress=progress, choices=choices,
        )
    return result.plan


def run_pipeline(
    setup: MeasurementSetup,
    budget: int | str | None = None,
    *,
    verify: bool = True,
    profile: Profile | None = None,
    refine: int = 4,
    measure: bool = False,
    baselines: bool = False,
    timing: TimingRule | None = None,
    progress: Progress | None = None,
    choices: str = "all",
) -> PlanningResult:
    """Stages 1-3 on a prepared model and batch, and optionally the final measurement.

    Args:
        setup: From :func:`~revtrain.planner.setup.prepare`.
        budget, verify, profile, refine, timing, progress, choices: As :func:`plan_for_model`.
        measure: Measure the plan's real step at the end (recorded in the plan).
        baselines: Measure baseline-M, and baseline-C where it fits the budget, in the same
            run as the plan (their timed steps alternate), for comparison; implies ``measure``.

    Raises:
        As :func:`plan_for_model`.
    """
    say = progress or (lambda line: None)
    if choices not in CHOICES:
        raise ValueError(f"choices must be one of {CHOICES}, got {choices!r}")
    budget_bytes, explanation = resolve_budget(budget, setup.device)
    say(f"budget: {explanation}")
    if profile is not None:
        _check_profile(setup, profile)
    check_budget_floor(setup, budget_bytes, profile if profile is None or choices == "all" else _mc_only(profile))
    if verify:
        say("verifying that every block rebuilds its input ...")
        verify_setup(setup)
    if profile is None:
        profile = profile_setup(setup, timing=timing, progress=progress, plain_layers=choices == "all")
    check_budget_floor(setup, budget_bytes, profile if choices == "all" else _mc_only(profile))
    say("solving the knapsack" + (", then refining against measured peaks ..." if refine > 0 else " ..."))
    plan = make_plan(profile, budget_bytes, use_measured_baseline_c=True, choices=choices)
    if refine > 0:
        plan = refine_plan(setup, profile, plan, steps=refine, progress=progress, choices=choices)
    plan = fit_plan(setup, profile, plan, choices=choices, progress=progress)
    plan.budget_source = explanation
    measured: dict[str, StepMeasurement] = {}
    if measure or baselines:
        settings: dict[str, Modes] = {"plan": plan.setting()}
        if baselines:
            settings["baseline-M"] = "M"
            if _baseline_c_fits(profile, budget_bytes):
                settings["baseline-C"] = "C"
        say("measuring the plan" + (" and the baselines" if baselines else "") + " ...")
        measured = measure_steps(setup, settings)  # the settings' timed steps alternate
        plan.measured_step_time_s = measured["plan"].step_time_s if setup.repeats else None
        plan.measured_peak_bytes = measured["plan"].peak_bytes
        if measured["plan"].times_s:
            iv = median_interval(measured["plan"].times_s)
            plan.measured_step_time_interval_s = [iv.low, iv.high]
    return PlanningResult(plan=plan, profile=profile, measured=measured)


def _mc_only(profile: Profile) -> Profile:
    return dataclasses.replace(profile, layers=[])


def _baseline_c_fits(profile: Profile, budget: int) -> bool:
    """Whether baseline-C fits: by its measured peak if profiled, else by the predicted one."""
    if profile.peak_C_bytes is not None:
        return profile.peak_C_bytes <= budget
    return profile.m_o_bytes + sum(b.m_bytes for b in profile.blocks) <= budget


def _check_profile(setup: MeasurementSetup, profile: Profile) -> None:
    from revtrain.core import reversible_blocks

    names = [name for name, _ in reversible_blocks(setup.model)]
    shape = tuple(setup.first_input.shape[1:])
    if (
        [b.name for b in profile.blocks] != names
        or profile.batch_size != setup.batch_size
        or tuple(profile.input_shape) != shape
    ):
        raise ValueError(
            f"the profile given was made for {profile.model!r} ({len(profile.blocks)} reversible blocks) at "
            f"batch size {profile.batch_size}, {describe_sample(profile.input_shape)}; this run has "
            f"{len(names)} reversible blocks at batch size {setup.batch_size}, {describe_sample(shape)}. "
            "A profile holds for one model and workload only (activation memory and t_e grow with the "
            "batch and the sample, attention with the square of the sequence length): profile this "
            "model and batch again (profile=None)"
        )
