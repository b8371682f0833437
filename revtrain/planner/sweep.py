"""Choose the batch size too: sweep it with costs linear in the batch size (Jiang et al. 2021, §3.4).

Problem 8 of the paper (modes and batch size together) is solved the way the paper suggests: by
sweeping the batch size. :func:`sweep_batch_sizes`

1. profiles a few batch sizes of the range (three by default: smallest, middle, largest);
2. fits, by least squares, every per-block ``t_e`` and ``m``, the baseline-M peak ``m_o``, the
   baseline-M step time and (where measured) the baseline-C peak as lines ``a + k * b`` in the batch
   size ``b``. Memory lines are then raised by their largest shortfall at the profiled sizes, so
   they never predict less than was measured there;
3. solves the knapsack at every batch size of the range from the fitted costs, predicting step
   time, time per sample and peak for the plan and both baselines;
4. plans the best few batch sizes (by predicted time per sample) with the same pipeline as a
   single plan (:func:`~revtrain.planner.pipeline.run_pipeline`: this size profiled, solved, refined
   against measured peaks, then measured), and picks the best measured one that kept within the
   budget. The plan at the chosen batch size is therefore the plan ``revtrain plan --batch-size``
   makes from the same profile.

The result is plain data (:mod:`revtrain.planner.sweep_result`); :mod:`revtrain.planner.plots`
draws it.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from revtrain.planner.block_timing import TimingRule
from revtrain.planner.budget import resolve_budget
from revtrain.planner.data import BlockProfile, Profile
from revtrain.planner.errors import BudgetTooSmallError
from revtrain.planner.pipeline import Progress, run_pipeline
from revtrain.planner.profile import profile_setup
from revtrain.planner.setup import LossFn, MeasurementSetup, OptimizerFactory, prepare
from revtrain.planner.solve import make_plan
from revtrain.planner.sweep_result import SweepPoint, SweepResult
from revtrain.planner.verify import verify_setup

__all__ = ["parse_batch_sizes", "resize_batch", "sweep_batch_sizes", "sweep_setup"]

BatchFactory = Callable[[int], tuple[Any, Tensor]]
"""``make_batch(batch_size) -> (inputs, targets)``."""


def parse_batch_sizes(text: str) -> list[int]:
    """Batch sizes from ``"32,64,128"`` or a range ``"32:256:32"`` (start:stop:step, stop included).

    Raises:
        ValueError: not positive integers, or an empty range.
    """
    try:
        if ":" in text:
            parts = [int(p) for p in text.split(":")]
            if len(parts) not in (2, 3):
                raise ValueError
            start, stop = parts[0], parts[1]
            step = parts[2] if len(parts) == 3 else 1
            if step < 1:
                raise ValueError
            sizes = list(range(start, stop + 1, step))
        else:
            sizes = [int(p) for p in text.split(",") if p.strip()]
    except ValueError:
        raise ValueError(
            f"cannot read batch sizes from {text!r}: give a list '32,64,128' or a range "
            "'32:256:32' (start:stop:step, stop included)"
        ) from None
    if not sizes or min(sizes) < 1:
        raise ValueError(f"batch sizes must be positive integers, got {text!r}")
    return sorted(set(sizes))


def resize_batch(batch: tuple[Any, Tensor], batch_size: int) -> tuple[Any, Tensor]:
    """The example batch repeated (or cut) along dim 0 to ``batch_size`` samples."""

    def resize(t: Any) -> Any:
        if not isinstance(t, Tensor):
            return t
        reps = -(-batch_size // t.shape[0])
        return t.repeat(reps, *([1] * (t.dim() - 1)))[:batch_size].contiguous()

    inputs, targets = batch
    inputs = tuple(resize(x) for x in inputs) if isinstance(inputs, (tuple, list)) else resize(inputs)
    return inputs, resize(targets)


def sweep_batch_sizes(
    model: nn.Module,
    batches: tuple[Any, Tensor] | BatchFactory,
    batch_sizes: Sequence[int],
    budget: int | str | None = None,
    *,
    profile_sizes: Sequence[int] | None = None,
    confirm: int = 2,
    loss_fn: LossFn = F.cross_entropy,
    make_optimizer: OptimizerFactory | None = None,
    device: torch.device | str | None = None,
    repeats: int = 3,
    warmup: int = 2,
    max_repeats: int | None = None,
    verify: bool = True,
    model_name: str | None = None,
    refine: int = 4,
    timing: TimingRule | None = None,
    progress: Progress | None = None,
) -> SweepResult:
    """Plan at every batch size of a range and find the one with the best throughput (§3.4).

    Args:
        model: A model with reversible blocks; moved to ``device``, otherwise left as it was.
        batches: An example ``(inputs, targets)`` batch, repeated or cut to each size
            (:func:`resize_batch`), or a function ``batch_size -> (inputs, targets)``.
        batch_sizes: The candidate batch sizes.
        budget: As :func:`~revtrain.planner.plan_for_model`.
        profile_sizes: Batch sizes to profile for the fit; default the smallest, the middle and
            the largest candidate (all of them when there are at most three).
        confirm: How many of the best predicted batch sizes to plan with the full pipeline and
            measure.
        loss_fn, make_optimizer, device, repeats, warmup, max_repeats, verify, model_name, refine,
            timing, progress: As :func:`~revtrain.planner.plan_for_model`.

    Raises:
        ValueError: an empty range, or a malformed budget.
    """
    sizes = _sizes(batch_sizes)
    make_batch: BatchFactory = batches if callable(batches) else (lambda b: resize_batch(batches, b))
    with prepare(
        model, make_batch(sizes[0]), loss_fn=loss_fn, make_optimizer=make_optimizer, device=device,
        repeats=repeats, warmup=warmup, max_repeats=max_repeats, model_name=model_name,
    ) as setup:
        return sweep_setup(
            setup, make_batch, sizes, budget, profile_sizes=profile_sizes, confirm=confirm,
            verify=verify, refine=refine, timing=timing, progress=progress,
        )


def sweep_setup(
    setup: MeasurementSetup,
    make_batch: BatchFactory,
    batch_sizes: Sequence[int],
    budget: int | str | None = None,
    *,
    profile_sizes: Sequence[int] | None = None,
    confirm: int = 2,
    verify: bool = True,
    refine: int = 4,
    timing: TimingRule | None = None,
    known: Mapping[int, Profile] | None = None,
    progress: Progress | None = None,
    choices: str = "all",
) -> SweepResult:
    """:func:`sweep_batch_sizes` on a prepared model: each batch size's batch is made by
    ``make_batch`` and swapped into ``setup`` (:meth:`MeasurementSetup.with_batch`).

    Args:
        choices: What the confirmed plans may choose (:data:`~revtrain.planner.solve.CHOICES`); the
            predicted points of the fitted lines choose M/C per block only.
        known: Profiles already made at some batch sizes (e.g. the single plan's, by ``revtrain
            plan``); they are used instead of profiling those sizes again.
        Others: As :func:`sweep_batch_sizes`.
    """
    say = progress or (lambda line: None)
    sizes = _sizes(batch_sizes)
    if profile_sizes is None:
        profile_sizes = sizes if len(sizes) <= 3 else [sizes[0], sizes[len(sizes) // 2], sizes[-1]]
    profile_sizes = _sizes(profile_sizes)
    budget_bytes, explanation = resolve_budget(budget, setup.device)
    profiles: dict[int, Profile] = dict(known or {})

    def setup_of(b: int) -> MeasurementSetup:
        sized = setup.with_batch(make_batch(b))
        if sized.batch_size != b:
            raise ValueError(f"the batch factory returned {sized.batch_size} samples for batch size {b}")
        return sized

    if verify:
        say(f"verifying that every block rebuilds its input (batch {profile_sizes[0]}) ...")
        verify_setup(setup_of(profile_sizes[0]))
    for b in profile_sizes:
        if b in profiles:
            continue
        say(f"sweep: profiling batch size {b} ...")
        try:
            profiles[b] = profile_setup(setup_of(b), timing=timing, plain_layers=choices == "all")
        except torch.cuda.OutOfMemoryError:
            torch.cuda.empty_cache()  # too big for the device even in baseline-M: fit without it
    fitted = [profiles[b] for b in profile_sizes if b in profiles]
    if not fitted:
        raise RuntimeError(
            f"no batch size of {profile_sizes} could be profiled: each ran out of device memory; "
            "sweep smaller batch sizes"
        )
    fits = _fit(fitted)
    names = [b.name for b in fitted[0].blocks]
    scales = [p.t_e_scale for p in fitted if p.t_e_scale is not None]
    template = dataclasses.replace(fitted[0], t_e_scale=statistics.median(scales) if scales else None)
    points = [_predict(fits, names, template, b, budget_bytes, profiles.get(b)) for b in sizes]

    ranked = sorted((p for p in points if p.feasible), key=lambda p: p.predicted_time_per_sample_s or math.inf)
    for p in ranked[: max(0, confirm)]:
        say(f"sweep: planning batch size {p.batch_size} with the full pipeline ...")
        try:
            result = run_pipeline(
                setup_of(p.batch_size), budget_bytes, verify=False, profile=profiles.get(p.batch_size),
                refine=refine, measure=True, timing=timing, choices=choices,
            )
        except torch.cuda.OutOfMemoryError:
            torch.cuda.empty_cache()
            continue
        except BudgetTooSmallError:  # the fitted lines said it fits; its own profile says not
            p.feasible, p.modes, p.predicted_step_time_s, p.predicted_peak_bytes = False, None, None, None
            continue
        profiles[p.batch_size] = result.profile
        _record_pipeline(p, result.plan, result.profile)
    kept = [p for p in points if p.confirmed and (p.measured_peak_bytes or 0) <= budget_bytes]
    if kept:
        best = min(kept, key=lambda p: p.measured_time_per_sample_s or math.inf)
        best_size, basis = best.batch_size, "measured"
    elif ranked:
        best_size, basis = ranked[0].batch_size, "predicted"
    else:
        best_size, basis = None, "none"
    first = fitted[0]
    return SweepResult(
        model=first.model,
        device=first.device,
        dtype=first.dtype,
        budget_bytes=budget_bytes,
        budget_source=explanation,
        block_names=names,
        profiled_batch_sizes=[p.batch_size for p in fitted],
        fits={k: [float(a), float(s)] for k, (a, s) in fits.items()},
        points=points,
        best_batch_size=best_size,
        best_basis=basis,
    )


def _sizes(batch_sizes: Sequence[int]) -> list[int]:
    sizes = sorted({int(b) for b in batch_sizes})
    if not sizes or sizes[0] < 1:
        raise ValueError(f"batch sizes must be a non-empty list of positive integers, got {list(batch_sizes)}")
    return sizes


def _record_pipeline(point: SweepPoint, plan: Any, profile: Profile) -> None:
    """The point takes the full pipeline's plan, its predictions and its measurement."""
    point.planned = True
    point.modes = dict(plan.modes)
    point.predicted_step_time_s = max(0.0, plan.predicted_step_time_s)
    point.predicted_peak_bytes = plan.predicted_peak_bytes
    point.measured_step_time_s = plan.measured_step_time_s
    point.measured_peak_bytes = plan.measured_peak_bytes
    if plan.measured_step_time_interval_s is not None:
        point.measured_intervals["plan"] = list(plan.measured_step_time_interval_s)
    _record_profile(point, profile)


def _record_profile(point: SweepPoint, measured: Profile) -> None:
    point.profiled = True
    point.measured_baseline_M_step_time_s = measured.step_time_M_s
    point.measured_baseline_M_peak_bytes = measured.m_o_bytes
    point.measured_baseline_C_step_time_s = measured.step_time_C_s
    point.measured_baseline_C_peak_bytes = measured.peak_C_bytes
    if measured.step_time_M_interval_s is not None:
        point.measured_intervals["baseline-M"] = list(measured.step_time_M_interval_s)
    if measured.step_time_C_interval_s is not None:
        point.measured_intervals["baseline-C"] = list(measured.step_time_C_interval_s)


# --- fitting and prediction -------------------------------------------------------------------


def _line(xs: Sequence[float], ys: Sequence[float], *, upper: bool, through: float = 0.0) -> tuple[float, float]:
    """Least-squares line ``a + k x``; from one point, the line through ``(0, through)``.

    ``upper`` raises the line by its largest shortfall at the data, so it never predicts less
    than was measured there.
    """
    x = np.asarray(xs, dtype=np.float64)
    y = np.asarray(ys, dtype=np.float64)
    if len(set(xs)) >= 2:
        k, a = np.polyfit(x, y, 1)
    else:
        a = through
        k = (float(y.mean()) - a) / float(x[0])
    if upper:
        a += max(0.0, float(np.max(y - (a + k * x))))
    return float(a), float(k)


def _fit(profiles: list[Profile]) -> dict[str, tuple[float, float]]:
    bs = [p.batch_size for p in profiles]
    fits: dict[str, tuple[float, float]] = {}
    for i, block in enumerate(profiles[0].blocks):
        fits[f"t_e/{block.name}"] = _line(bs, [p.blocks[i].t_e_s for p in profiles], upper=False)
        fits[f"m/{block.name}"] = _line(bs, [p.blocks[i].m_bytes for p in profiles], upper=True)
    fixed = min(p.fixed_bytes or 0 for p in profiles)
    fits["m_o"] = _line(bs, [p.m_o_bytes for p in profiles], upper=True, through=fixed)
    fits["step_M"] = _line(bs, [p.step_time_M_s for p in profiles], upper=False)
    if all(p.peak_C_bytes is not None for p in profiles):
        fits["peak_C"] = _line(bs, [p.peak_C_bytes or 0 for p in profiles], upper=True, through=fixed)
    return fits


def _at(fit: tuple[float, float], b: int) -> float:
    return fit[0] + fit[1] * b


def _predict(
    fits: dict[str, tuple[float, float]],
    names: list[str],
    template: Profile,
    b: int,
    budget: int,
    measured: Profile | None,
) -> SweepPoint:
    blocks = [
        BlockProfile(
            name=n,
            t_e_s=_at(fits[f"t_e/{n}"], b),
            m_bytes=max(0, math.ceil(_at(fits[f"m/{n}"], b))),
        )
        for n in names
    ]
    m_o = max(0, math.ceil(_at(fits["m_o"], b)))
    step_m = max(0.0, _at(fits["step_M"], b))
    peak_c_model = m_o + sum(x.m_bytes for x in blocks)
    peak_c_fit = max(m_o, math.ceil(_at(fits["peak_C"], b))) if "peak_C" in fits else None
    profile = Profile(
        model=template.model,
        batch_size=b,
        input_shape=template.input_shape,
        dtype=template.dtype,
        device=template.device,
        blocks=blocks,
        m_o_bytes=m_o,
        fixed_bytes=min(template.fixed_bytes or 0, m_o),
        step_time_M_s=step_m,
        peak_C_bytes=peak_c_fit,
        t_e_scale=template.t_e_scale,
    )
    peak_c = peak_c_model if peak_c_fit is None else min(peak_c_model, peak_c_fit)
    point = SweepPoint(
        batch_size=b,
        feasible=False,
        modes=None,
        predicted_step_time_s=None,
        predicted_peak_bytes=None,
        baseline_M_step_time_s=step_m,
        baseline_M_peak_bytes=m_o,
        baseline_C_step_time_s=max(0.0, step_m - profile.saved_time_s(sum(x.t_e_s for x in blocks))),
        baseline_C_peak_bytes=peak_c,
        baseline_C_fits=peak_c <= budget,
    )
    try:
        plan = make_plan(profile, budget, use_measured_baseline_c=True)
    except BudgetTooSmallError:
        pass
    else:
        point.feasible = True
        point.modes = plan.modes
        point.predicted_step_time_s = max(0.0, plan.predicted_step_time_s)
        point.predicted_peak_bytes = plan.predicted_peak_bytes
    if measured is not None:
        _record_profile(point, measured)
    return point
