"""What ``revtrain plan`` prints: the profile per block, predicted against measured, the sweep."""

from __future__ import annotations

import math
from typing import TextIO

from revtrain.memory import format_bytes, format_step_memory, process_peak_rss_bytes
from revtrain.planner.pipeline import PlanningResult
from revtrain.planner.sweep_result import SweepResult

__all__ = ["report_plan", "report_sweep"]


def report_plan(result: PlanningResult, out: TextIO) -> None:
    """Per-block table, then predicted and measured step time and peak of the plan and the baselines.

    Predictions come from the profile (baseline-M: the profiled step; baseline-C: baseline-M minus
    what every block saves, m_o plus every m_i); measurements are one run after planning whose
    settings' timed steps alternate.
    """
    profile, plan, measured = result.profile, result.plan, result.measured
    print(f"\n{'#':>3}  {'block':44s} {'mode':4s} {'t_e ms':>8s} {'IQR ms':>7s} {'pairs':>5s} "
          f"{'m_i':>11s} {'m_i (tracker)':>14s}", file=out)
    for i, b in enumerate(profile.blocks):
        tracker = format_bytes(b.m_tracker_bytes) if b.m_tracker_bytes is not None else "-"
        spread = f"{b.t_e_iqr_s * 1e3:7.2f}" if b.t_e_iqr_s is not None else f"{'-':>7s}"
        pairs = f"{b.t_e_pairs:5d}" if b.t_e_pairs is not None else f"{'-':>5s}"
        print(f"{i:>3}  {b.name[-44:]:44s} {plan.modes[b.name]:4s} {b.t_e_s * 1e3:8.2f} {spread} {pairs} "
              f"{format_bytes(b.m_bytes):>11s} {tracker:>14s}", file=out)
    sum_te = sum(b.t_e_s for b in profile.blocks)
    sum_m = sum(b.m_bytes for b in profile.blocks)
    print(f"     {'total (' + str(len(plan.c_mode_blocks)) + ' in C-mode)':44s} {'':4s} {sum_te * 1e3:8.2f} "
          f"{'':7s} {'':5s} {format_bytes(sum_m):>11s}", file=out)
    if profile.layers:
        print(f"\n{'#':>3}  {'plain layer':44s} {'option':9s} {'recompute ms':>12s} {'95% interval ms':>17s} "
              f"{'frees':>11s}", file=out)
        for i, x in enumerate(profile.layers):
            iv = (f"[{x.recompute_low_s * 1e3:.2f}, {x.recompute_high_s * 1e3:.2f}]"
                  if x.recompute_low_s is not None and x.recompute_high_s is not None else "-")
            print(f"{i:>3}  {x.name[-44:]:44s} {plan.layers.get(x.name, 'keep'):9s} {x.recompute_s * 1e3:12.2f} "
                  f"{iv:>17s} {format_bytes(x.recompute_saves_bytes):>11s}", file=out)
        if plan.recomputed_layers:
            print(f"     the plan recomputes/offloads {len(plan.recomputed_layers)} plain layer(s), predicted to cost "
                  f"{plan.recompute_cost_s * 1e3:.2f} ms per step", file=out)
    print(f"\nm_o (baseline-M peak) {format_bytes(profile.m_o_bytes)}, of which fixed (parameters, buffers, "
          f"gradients, {profile.optimizer or 'optimizer'} state) {format_bytes(profile.fixed_bytes or 0)}", file=out)
    budget = plan.budget_bytes
    predicted = {
        "plan": (plan.predicted_step_time_s, plan.predicted_peak_bytes),
        "baseline-M": (profile.step_time_M_s, profile.m_o_bytes),
        "baseline-C": (profile.step_time_M_s - profile.saved_time_s(sum_te), profile.m_o_bytes + sum_m),
    }
    print(f"\n{'':12s} {'pred step s':>12s} {'meas step s':>12s} {'error':>7s} {'pred peak':>11s} "
          f"{'meas peak':>11s}  budget {format_bytes(budget)}", file=out)
    for name, (pt, pp) in predicted.items():
        if name not in measured:
            seen = profile.peak_C_bytes
            peak = f"measured peak {format_bytes(seen)}" if seen is not None else f"predicted peak {format_bytes(pp)}"
            print(f"{name:12s} does not fit the budget ({peak}); not run", file=out)
            continue
        mt, mp = measured[name].step_time_s, measured[name].peak_bytes
        fits = "within budget" if mp <= budget else "OVER BUDGET"
        error = f"{pt / mt - 1:+7.1%}" if mt > 0 and not math.isnan(mt) else f"{'-':>7s}"
        print(f"{name:12s} {pt:12.4f} {mt:12.4f} {error} {format_bytes(pp):>11s} {format_bytes(mp):>11s}  {fits}",
              file=out)
    if "plan" in measured and "baseline-M" in measured:
        saved = profile.saved_time_s(sum(b.t_e_s for b in profile.blocks if plan.modes[b.name] == "C"))
        from_run = measured["baseline-M"].step_time_s - saved
        drift = profile.step_time_M_s / measured["baseline-M"].step_time_s - 1
        print(f"\ncheck: this run's baseline-M minus what the plan saves {from_run:.4f} s "
              f"({from_run / measured['plan'].step_time_s - 1:+.1%} of the plan's measured step); baseline-M "
              f"moved {drift:+.1%} between profiling and measuring", file=out)
    if "plan" in measured:
        plain = measured["baseline-C"].peak_bytes if "baseline-C" in measured else profile.peak_C_bytes
        print("\n" + format_step_memory(profile.batch_size, plan.modes, measured["plan"].peak_bytes, plain), file=out)
    if profile.step_time_C_s is not None:
        scale = "" if profile.t_e_scale is None else f": predicted savings are t_e x {profile.t_e_scale:.3f}"
        print(f"\ncheck: sum of t_e {sum_te:.4f} s; profiled baseline-M - baseline-C "
              f"{profile.step_time_M_s - profile.step_time_C_s:.4f} s{scale}", file=out)
    for warning in profile.warnings:
        print(f"warning: {warning}", file=out)
    if profile.peak_C_bytes is not None:
        print(f"check: m_o + sum(m_i) {format_bytes(profile.m_o_bytes + sum_m)} bounds the profiled "
              f"baseline-C peak {format_bytes(profile.peak_C_bytes)}", file=out)
    rss = process_peak_rss_bytes()
    if rss is not None and profile.device == "cpu":
        print(f"process peak RSS so far {format_bytes(rss)} (coarse: interpreter and every run included)", file=out)
    print(f"\n{plan.summary()}", file=out)


def report_sweep(result: SweepResult, out: TextIO) -> None:
    """One line per batch size: the plan's modes, predicted and measured step and peak."""
    print(f"\n{'batch':>6s} {'modes (M/C per block)':30s} {'pred s/step':>11s} {'pred ms/sample':>14s} "
          f"{'pred peak':>11s} {'meas s/step':>11s} {'meas peak':>11s}", file=out)
    for p in result.points:
        if not p.feasible:
            print(f"{p.batch_size:>6d} {'no plan fits the budget':30s}", file=out)
            continue
        modes = "".join((p.modes or {}).values())
        modes = modes if len(modes) <= 30 else modes[:27] + "..."
        how = " (planned)" if p.planned else ""
        print(f"{p.batch_size:>6d} {modes:30s} {_opt(p.predicted_step_time_s, '11.4f')} "
              f"{_opt(p.predicted_time_per_sample_s and p.predicted_time_per_sample_s * 1e3, '14.3f')} "
              f"{_bytes(p.predicted_peak_bytes)} {_opt(p.measured_step_time_s, '11.4f')} "
              f"{_bytes(p.measured_peak_bytes)}{how}", file=out)
    if result.best_batch_size is not None:
        print(f"best batch size: {result.best_batch_size} ({result.best_basis} time per sample)", file=out)
    else:
        print("no batch size of the sweep fits the budget", file=out)


def _opt(x: float | None, fmt: str) -> str:
    width = int(fmt.split(".")[0])
    return format(x, fmt) if x is not None else "-".rjust(width)


def _bytes(n: int | None) -> str:
    return f"{format_bytes(n) if n is not None else '-':>11s}"
