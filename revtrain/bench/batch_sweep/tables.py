"""The planner benchmark's tables (markdown) and the findings computed from its rows."""

from __future__ import annotations

from collections.abc import Sequence

from revtrain.bench.batch_sweep.schema import PlannerBenchResult, PlannerBenchRow, _rel
from revtrain.memory import format_bytes

__all__ = ["format_accuracy_table", "format_planner_table", "format_refine_table", "summary_lines"]


def format_planner_table(rows: Sequence[PlannerBenchRow]) -> str:
    """Time per iteration (TPI) and per sample (TPS) of the baselines and the plan (paper Table 2)."""
    lines = [
        ("| batch | C-mode blocks | baseline-C TPI s | baseline-M TPI s | plan TPI s | baseline-C TPS ms "
        "| baseline-M TPS ms | plan TPS ms | speed-up plan / M (paired, IQR) | plan / C (paired) "
        "| peak M | peak C | peak plan | budget |"),
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        m, c, p = (r.settings[k] for k in ("baseline-M", "baseline-C", "plan"))
        b = r.batch_size
        c_note = "" if c.fits else " (over budget)"
        sp, sp_iqr = r.speedup_paired
        pc, _ = r.plan_vs_c_paired
        lines.append(
            f"| {b} | {p.c_blocks}/{r.n_blocks} | {c.step_time_s:.3f}{c_note} | {m.step_time_s:.3f} "
            f"| {p.step_time_s:.3f} | {c.step_time_s / b * 1e3:.1f}{c_note} | {m.step_time_s / b * 1e3:.1f} "
            f"| {p.step_time_s / b * 1e3:.1f} | {r.speedup:.3f} ({sp:.3f}, {sp_iqr:.3f}) | {pc:.3f} "
            f"| {format_bytes(m.peak_bytes)} | {format_bytes(c.peak_bytes)}{' ✗' if not c.fits else ''} "
            f"| {format_bytes(p.peak_bytes)}{'' if p.fits else ' OVER'} | {format_bytes(r.budget_bytes)} |"
        )
    return "\n".join(lines)


def format_accuracy_table(rows: Sequence[PlannerBenchRow]) -> str:
    """Predicted vs measured step time and peak of every setting, with relative errors."""
    lines = [
        ("| batch | setting | C blocks | pred. step s | meas. step s | error | pred. from this run's M | error "
        "| pred. peak | meas. peak | error | additive model m_o+Σm_i | error |"),
        "|---:|:---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        for s in r.settings.values():
            lines.append(
                f"| {r.batch_size} | {s.name} | {s.c_blocks} | {s.predicted_step_time_s:.3f} "
                f"| {s.step_time_s:.3f} | {s.step_time_error:+.1%} | {s.step_time_from_run_M_s:.3f} "
                f"| {_rel(s.step_time_from_run_M_s, s.step_time_s):+.1%} "
                f"| {format_bytes(s.predicted_peak_bytes)} | {format_bytes(s.peak_bytes)} | {s.peak_error:+.1%} "
                f"| {format_bytes(s.additive_peak_bytes)} | {s.additive_peak_error:+.1%} |"
            )
    return "\n".join(lines)


def format_refine_table(rows: Sequence[PlannerBenchRow]) -> str:
    """The paper's knapsack as solved (refine=0) against the refined plan, and planner overhead."""
    lines = [
        ("| batch | C blocks refine=0 / refined | step s refine=0 / refined | speed-up over M refine=0 / refined "
        "| peak refine=0 / refined (budget) | Σt_e s | meas. M−C s | profile s | solve ms | refine s |"),
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        m, c = r.settings["baseline-M"], r.settings["baseline-C"]
        p0, p = r.settings["plan (refine=0)"], r.settings["plan"]
        lines.append(
            f"| {r.batch_size} | {p0.c_blocks} / {p.c_blocks} | {p0.step_time_s:.3f} / {p.step_time_s:.3f} "
            f"| {m.step_time_s / p0.step_time_s:.3f} / {m.step_time_s / p.step_time_s:.3f} "
            f"| {format_bytes(p0.peak_bytes)} / {format_bytes(p.peak_bytes)} ({format_bytes(r.budget_bytes)}) "
            f"| {r.sum_t_e_s:.3f} | {m.step_time_s - c.step_time_s:.3f} | {r.profile_s:.0f} "
            f"| {r.solve_s * 1e3:.0f} | {r.refine_s:.1f} |"
        )
    return "\n".join(lines)


# --- helpers ------------------------------------------------------------------------------------


def summary_lines(result: PlannerBenchResult) -> list[str]:
    """Findings computed from the rows, so the text can never disagree with the table."""
    rows = result.rows
    lines = []
    tight = [r for r in rows if not r.settings["baseline-C"].fits]
    roomy = [r for r in rows if r.settings["baseline-C"].fits]
    if tight:
        sp = ", ".join(f"{r.speedup_paired[0]:.2f}× (b={r.batch_size})" for r in tight)
        lines.append(f"- Where baseline-C does not fit the budget, the plan's speed-up over baseline-M (paired): {sp}.")
    if roomy:
        eq = ", ".join(
            f"{r.plan_vs_c_paired[0]:.3f} (b={r.batch_size}, plan {r.settings['plan'].c_blocks}/{r.n_blocks} C)"
            for r in roomy
        )
        lines.append(f"- Where baseline-C fits, plan ÷ baseline-C step time (paired): {eq}.")
    worst = min(rows, key=lambda r: r.speedup_paired[0])
    lines.append(
        f"- Lowest paired speed-up over baseline-M: {worst.speedup_paired[0]:.3f} at batch "
        f"{worst.batch_size} (IQR of the per-round ratio {worst.speedup_paired[1]:.3f})."
    )
    over = [r.batch_size for r in rows if not r.settings["plan"].fits]
    lines.append(
        "- Every plan's measured peak kept within the budget." if not over
        else f"- The plan's measured peak EXCEEDED the budget at batch sizes {over}."
    )
    step_err = [r.settings["plan"].step_time_error for r in rows]
    step_err0 = [r.settings["plan"].step_time_from_run_M_s / r.settings["plan"].step_time_s - 1 for r in rows]
    lines.append(
        f"- Plan step time, predicted − measured: {_span(step_err)} of measured (from the profile's "
        f"baseline-M); {_span(step_err0)} when the same run's baseline-M is the starting point."
    )
    peak0 = [r.settings["plan (refine=0)"].additive_peak_error for r in rows if r.settings["plan (refine=0)"].c_blocks]
    peak_c = [r.settings["baseline-C"].additive_peak_error for r in rows]
    peak_p = [r.settings["plan"].peak_error for r in rows]
    if peak0:
        lines.append(f"- Peak of the knapsack's plan (refine=0), additive model m_o + Σm_i vs measured: {_span(peak0)}.")
    lines.append(f"- Baseline-C peak, additive model vs measured: {_span(peak_c)} (the model adds every m_i at baseline-M's peak moment).")
    lines.append(
        f"- Peak of the refined plan, as the plan predicts it vs measured: {_span(peak_p)} (where refinement "
        "changed the plan, its prediction is the peak measured while refining)."
    )
    te = [r.sum_t_e_s / (r.settings["baseline-M"].step_time_s - r.settings["baseline-C"].step_time_s) for r in rows]
    lines.append(f"- Σt_e ÷ measured (baseline-M − baseline-C): {', '.join(f'{x:.2f}' for x in te)} across batch sizes.")
    return lines


def _span(values: list[float]) -> str:
    if not values:
        return "–"
    lo, hi = min(values), max(values)
    return f"{lo:+.1%}" if abs(hi - lo) < 5e-4 else f"{lo:+.1%} to {hi:+.1%}"
