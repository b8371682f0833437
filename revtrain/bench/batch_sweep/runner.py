"""Run the planner benchmark: baseline-M, baseline-C and the plan, measured across batch sizes.

For one zoo model with reversible layers of any kind (RevNet or Transformer coupling blocks,
In-place ABN layers) and a list of batch sizes, under one memory budget, the model is prepared once
(:func:`revtrain.planner.prepare`), verified once, and each batch size's batch (built from the
model's registry entry, :func:`revtrain.models.input_spec`; a token model is built with the
sequence length as its context) gets the planner's stages 2-3 with
:func:`revtrain.planner.run_pipeline`: profiled once, then planned twice from that profile,
with ``refine=0`` (the paper's knapsack as solved) and with refinement (the library's default).
Then one interleaved measurement (:func:`revtrain.planner.measure_steps`: the settings' timed
steps alternate, so a change of machine load hits each alike) of whole training steps for
baseline-M, baseline-C (measured even where its peak exceeds the budget, then marked as not
fitting), the plan and the refine=0 plan. Each row holds what was predicted before the
measurement next to what was measured (Jiang et al. 2021, §3.2-3.4, Fig. 4, Fig. 5, Table 2).

The budget is fixed across batch sizes, as a device's memory is in the paper. Without one,
:func:`auto_budget` puts it where the plan matters: above baseline-C's peak at the smallest batch
size and above baseline-M's at the largest, so every batch size in between must mix modes.

Example:
    >>> config = PlannerBenchConfig(model="revnet38", batch_sizes=(4, 8), repeats=2)
    >>> result = run_planner_benchmark(config)
    >>> print(format_planner_table(result.rows))
"""

from __future__ import annotations

import dataclasses
import gc
import math
import time
from collections import Counter
from collections.abc import Callable, Mapping
from typing import Any

import torch

from revtrain.bench.batch_sweep.schema import PlannerBenchConfig, PlannerBenchResult, PlannerBenchRow, SettingResult
from revtrain.device import float_dtype, resolve_device
from revtrain.memory import format_bytes, format_step_memory
from revtrain.planner import (
    MeasurementSetup,
    Plan,
    Profile,
    StepMeasurement,
    SweepPoint,
    SweepResult,
    measure_steps,
    prepare,
    profile_setup,
    resolve_budget,
    run_pipeline,
)
from revtrain.planner.verify import verify_setup
from revtrain.timing import iqr

__all__ = ["auto_budget", "run_planner_benchmark", "to_sweep_result"]

Log = Callable[[str], None]


def auto_budget(
    setup: MeasurementSetup, make_batch: Callable[[int], Any], batch_sizes: tuple[int, ...], *, margin: float = 1.2
) -> tuple[int, str, dict[str, int]]:
    """A budget between the baselines: ``margin * max(peak_C(b_min), peak_M(b_max))``, whole MiB.

    Measures baseline-C's peak at the smallest batch size and baseline-M's at the largest (one
    untimed step each, then one under the memory tracker). Returns ``(bytes, explanation,
    peaks)``.
    """
    small, large = min(batch_sizes), max(batch_sizes)
    peak_c = measure_steps(setup.with_batch(make_batch(small)), {"C": "C"}, repeats=0, warmup=1)["C"].peak_bytes
    peak_m = measure_steps(setup.with_batch(make_batch(large)), {"M": "M"}, repeats=0, warmup=1)["M"].peak_bytes
    mib = 2**20
    budget = math.ceil(margin * max(peak_c, peak_m) / mib) * mib
    text = (
        f"automatic: {margin:g} x max(baseline-C peak at batch {small} = {format_bytes(peak_c)}, "
        f"baseline-M peak at batch {large} = {format_bytes(peak_m)}), rounded up to a MiB "
        f"= {format_bytes(budget)} ({budget} bytes)"
    )
    return budget, text, {f"baseline-C@{small}": peak_c, f"baseline-M@{large}": peak_m}


def run_planner_benchmark(config: PlannerBenchConfig, *, log: Log = lambda line: None) -> PlannerBenchResult:
    """Plan and measure every batch size of ``config`` (module docstring); ``log`` gets progress."""
    from revtrain.core import reversible_blocks
    from revtrain.models import create_model_for, input_spec
    from revtrain.tasks import task_for

    threads = torch.get_num_threads()
    if config.threads is not None:
        torch.set_num_threads(config.threads)
    try:
        dev, dtype = resolve_device(config.device), float_dtype(config.dtype)
        spec = input_spec(config.model, input_size=config.input_shape, num_classes=config.num_classes)
        if spec.kind == "image":
            spec = spec.with_changes(dtype=dtype)
        torch.manual_seed(config.seed)
        model = create_model_for(config.model, spec, **config.model_overrides()).to(dtype)
        layers = reversible_blocks(model)
        names = [name for name, _ in layers]
        kinds = Counter(type(layer).__name__ for _, layer in layers)

        def make_batch(b: int) -> Any:
            return spec.example(b, dev, seed=config.seed)

        with prepare(
            model, make_batch(config.batch_sizes[0]), loss_fn=task_for(spec).loss, device=dev,
            repeats=config.profile_repeats, warmup=config.warmup, model_name=config.model,
        ) as setup:
            start = time.perf_counter()
            verify_setup(setup)
            verify_s = time.perf_counter() - start
            kinds_text = ", ".join(f"{n} {k}" for k, n in kinds.items())
            log(f"{config.model}: {len(names)} reversible layers ({kinds_text}), inverses verified in {verify_s:.1f} s")
            peaks: dict[str, int] = {}
            if config.budget is None:
                budget, source, peaks = auto_budget(setup, make_batch, config.batch_sizes, margin=config.budget_margin)
            else:
                budget, source = resolve_budget(config.budget, dev)
            log(f"budget: {source}")
            rows = []
            for b in config.batch_sizes:
                rows.append(_measure_batch_size(setup.with_batch(make_batch(b)), budget, config, log))
                _free(dev)
        return PlannerBenchResult(
            config=config,
            budget_bytes=budget,
            budget_source=source,
            rows=rows,
            block_names=names,
            model_name=config.model,
            device=rows[0].profile["device"] if rows else str(dev),
            dtype=config.dtype,
            input_shape=tuple(spec.shape),
            num_classes=spec.num_classes,
            verify_s=verify_s,
            budget_peaks=peaks,
            layer_kinds=dict(kinds),
            input_kind=spec.kind,
        )
    finally:
        torch.set_num_threads(threads)


def _measure_batch_size(setup: MeasurementSetup, budget: int, config: PlannerBenchConfig, log: Log) -> PlannerBenchRow:
    b = setup.batch_size
    start = time.perf_counter()
    profile = profile_setup(setup, timing=config.timing_rule())
    profile_s = time.perf_counter() - start
    start = time.perf_counter()
    plan0 = run_pipeline(setup, budget, verify=False, profile=profile, refine=0).plan
    solve_s = time.perf_counter() - start
    start = time.perf_counter()
    plan = run_pipeline(setup, budget, verify=False, profile=profile, refine=config.refine).plan
    refine_s = time.perf_counter() - start
    log(
        f"batch {b}: profiled in {profile_s:.0f} s; plan {len(plan.c_mode_blocks)}/{len(plan.modes)} "
        f"blocks in C-mode (refine=0: {len(plan0.c_mode_blocks)}), solved in {solve_s * 1e3:.0f} ms, "
        f"refined in {refine_s:.1f} s; measuring ..."
    )
    settings: dict[str, str | Mapping[str, str]] = {
        "baseline-M": "M", "baseline-C": "C", "plan": plan.setting(), "plan (refine=0)": plan0.setting(),
    }
    steps = measure_steps(setup, settings, repeats=config.repeats, warmup=config.warmup)
    m_step = steps["baseline-M"].step_time_s
    results = {
        name: _setting(name, modes, steps, profile, budget, chosen, m_step)
        for name, modes, chosen in (
            ("baseline-M", {n: "M" for n in plan.modes}, None),
            ("baseline-C", {n: "C" for n in plan.modes}, None),
            ("plan", plan.modes, plan),
            ("plan (refine=0)", plan0.modes, plan0),
        )
    }
    row = PlannerBenchRow(
        batch_size=b,
        budget_bytes=budget,
        n_blocks=len(plan.modes),
        settings=results,
        modes=dict(plan.modes),
        modes_refine0=dict(plan0.modes),
        profile=dataclasses.asdict(profile),
        profile_s=profile_s,
        solve_s=solve_s,
        refine_s=refine_s,
    )
    log(
        f"batch {b}: step M {m_step:.3f} s, C {results['baseline-C'].step_time_s:.3f} s, plan "
        f"{results['plan'].step_time_s:.3f} s (x{row.speedup:.2f} over M); budget {format_bytes(budget)}; "
        + format_step_memory(b, plan.modes, results["plan"].peak_bytes, results["baseline-C"].peak_bytes)
    )
    return row


def _setting(
    name: str,
    modes: Mapping[str, str],
    steps: Mapping[str, StepMeasurement],
    profile: Profile,
    budget: int,
    plan: Plan | None,
    run_m_step: float,
) -> SettingResult:
    c = {n for n, mode in modes.items() if mode == "C"}
    saved = profile.saved_time_s(sum(blk.t_e_s for blk in profile.blocks if blk.name in c and blk.t_e_s > 0))
    additive = profile.m_o_bytes + sum(blk.m_bytes for blk in profile.blocks if blk.name in c)
    m = steps[name]
    return SettingResult(
        name=name,
        c_blocks=len(c),
        step_time_s=m.step_time_s,
        step_time_iqr_s=iqr(m.times_s),
        times_s=m.times_s,
        peak_bytes=m.peak_bytes,
        fits=m.peak_bytes <= budget,
        predicted_step_time_s=plan.predicted_step_time_s if plan else profile.step_time_M_s - saved,
        predicted_peak_bytes=plan.predicted_peak_bytes if plan else additive,
        additive_peak_bytes=additive,
        step_time_from_run_M_s=run_m_step - saved,
    )


def to_sweep_result(result: PlannerBenchResult) -> SweepResult:
    """The measurements as a :class:`~revtrain.planner.SweepResult`, for :mod:`revtrain.planner.plots`.

    Every batch size counts as profiled and confirmed: "predicted" values are each batch size's
    own profile (not a fitted line), "measured" values this benchmark's interleaved measurement.
    The best batch size is the one whose plan had the lowest measured time per sample within
    the budget.
    """
    points = []
    for r in result.rows:
        s = r.settings
        points.append(
            SweepPoint(
                batch_size=r.batch_size,
                feasible=True,
                modes=dict(r.modes),
                predicted_step_time_s=s["plan"].predicted_step_time_s,
                predicted_peak_bytes=s["plan"].predicted_peak_bytes,
                baseline_M_step_time_s=s["baseline-M"].predicted_step_time_s,
                baseline_M_peak_bytes=s["baseline-M"].predicted_peak_bytes,
                baseline_C_step_time_s=s["baseline-C"].predicted_step_time_s,
                baseline_C_peak_bytes=s["baseline-C"].peak_bytes,
                baseline_C_fits=s["baseline-C"].fits,
                profiled=True,
                measured_baseline_M_step_time_s=s["baseline-M"].step_time_s,
                measured_baseline_M_peak_bytes=s["baseline-M"].peak_bytes,
                measured_baseline_C_step_time_s=s["baseline-C"].step_time_s,
                measured_baseline_C_peak_bytes=s["baseline-C"].peak_bytes,
                measured_step_time_s=s["plan"].step_time_s,
                measured_peak_bytes=s["plan"].peak_bytes,
            )
        )
    kept = [p for p in points if (p.measured_peak_bytes or 0) <= result.budget_bytes]
    best = min(kept, key=lambda p: p.measured_time_per_sample_s or math.inf) if kept else None
    return SweepResult(
        model=result.model_name,
        device=result.device,
        dtype=result.dtype,
        budget_bytes=result.budget_bytes,
        budget_source=result.budget_source,
        block_names=list(result.block_names),
        profiled_batch_sizes=[r.batch_size for r in result.rows],
        fits={},
        points=points,
        best_batch_size=best.batch_size if best else None,
        best_basis="measured" if best else "none",
    )


def _free(dev: torch.device) -> None:
    gc.collect()
    if dev.type == "cuda":
        torch.cuda.empty_cache()
