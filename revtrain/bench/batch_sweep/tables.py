"""The findings computed from the planner benchmark's rows (the report's notes)."""

from __future__ import annotations

from revtrain.bench.batch_sweep.schema import PlannerBenchResult

__all__ = ["summary_lines"]


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
