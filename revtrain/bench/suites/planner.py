"""Planner suite, two parts (``--methods`` picks them; default both):

* ``sweep``: the plan against baseline-M (all M-mode) and baseline-C (all C-mode) across batch
  sizes under one memory budget per model (:func:`revtrain.bench.batch_sweep.run_planner_benchmark`).
  Per batch size: verify, profile (t_e, m_i, m_o), solve the knapsack (``plan (refine=0)``, the
  paper's plan), refine against measured peaks (``plan``), then one measurement in which the four
  settings' steps alternate, and one step per setting under the memory tracker. The figures (the
  paper's Fig. 4 heat map and Fig. 5 step times) are written beside the report.
* ``whole-model``: the fastest step under budgets from plain backprop's step memory down to the
  smallest that recomputing the non-reversible layers allows, against Jiang et al.'s M/C-only plan,
  checkpointing with every block in M-mode and plain backprop
  (:mod:`revtrain.bench.suites.planner_whole_model`). Run alone, its report is
  ``results/planner_<device>_whole_model``.
"""

from __future__ import annotations

from pathlib import Path

import torch

from revtrain.bench.batch_sweep import PlannerBenchConfig, run_planner_benchmark, summary_lines, to_sweep_result
from revtrain.bench.report import Column, Report, Table
from revtrain.bench.suites.planner_whole_model import QUICK_CASE, WholeModelCase, whole_model_tables

MODELS: dict[str, dict] = {
    "revnet110": {},
    "revformer_small": {"input_shape": (512,), "batch_sizes": (1, 2, 4, 8), "model_options": ("positions=rotary",)},
    "resnext29_iabn": {"batch_sizes": (4, 8, 16, 32)},
}
"""Each model's case on a CPU (batch sizes 8 16 32 64 unless given; 64 to 1024 on CUDA)."""
QUICK = {"revnet38": {"input_shape": (3, 8, 8), "batch_sizes": (2, 4), "budget": "64MiB", "profile_repeats": 1,
                      "refine": 1, "t_e_max_pairs": 5}}


PARTS = ("sweep", "whole-model")


def parts(options) -> tuple[str, ...]:
    """The parts ``--methods`` names (default: both); an unknown one is refused."""
    unknown = [p for p in options.methods if p not in PARTS]
    if unknown:
        raise ValueError(f"the planner suite's parts (--methods) are {', '.join(PARTS)}; got {', '.join(unknown)}")
    return tuple(dict.fromkeys(options.methods)) or PARTS


def report_suffix(options) -> str:
    """``_whole_model`` when that part runs alone: its report lives beside the sweep's."""
    return "_whole_model" if parts(options) == ("whole-model",) else ""


def run(options, device: torch.device, out: Path, log) -> Report:
    chosen = parts(options)
    tables: list[Table] = []
    notes: list[str] = []
    figures: list[str] = []
    if "sweep" in chosen:
        tables, notes, figures = _sweep(options, device, out, log)
    if "whole-model" in chosen:
        found, found_notes = whole_model_tables(_whole_model_case(options), device, log)
        tables += found
        notes += found_notes
    return Report("planner", "Planner: " + "; ".join(_TITLES[p] for p in chosen), {}, tables, intro=" ".join(_INTROS[p] for p in chosen), notes=notes,
                  figures=figures)


def _whole_model_case(options) -> WholeModelCase:
    base = QUICK_CASE if options.quick else WholeModelCase()
    fields = {}
    if options.models:
        fields["models"] = tuple(options.models)
    if options.shapes:
        if len(options.shapes) != 1:
            raise ValueError(f"the whole-model part plans one batch size (--shapes 64); got {' '.join(options.shapes)}")
        fields["batch_size"] = int(options.shapes[0])
    if options.repeats is not None:
        fields["rounds"] = options.repeats
    return WholeModelCase(**{**base.__dict__, **fields})


def _sweep(options, device: torch.device, out: Path, log) -> tuple[list[Table], list[str], list[str]]:
    cases = {m: MODELS.get(m, {}) for m in options.models} if options.models else (QUICK if options.quick else MODELS)
    plans, settings, costs, notes, figures = [], [], [], [], []
    for model, case in cases.items():
        fields = dict(case)
        if options.shapes:
            fields["batch_sizes"] = tuple(int(s) for s in options.shapes)
        elif "batch_sizes" not in fields:
            fields["batch_sizes"] = (64, 128, 256, 512, 1024) if device.type == "cuda" else (8, 16, 32, 64)
        fields.update(repeats=options.pick(5, 1), warmup=options.warmup if options.warmup is not None else
                      1 if options.quick else 2, device=str(device), threads=options.threads or 1)
        config = PlannerBenchConfig(model=model, **fields)
        result = run_planner_benchmark(config, log=log)
        notes.append(f"{model}: budget {result.budget_source}")
        notes += [f"{model}: {line.removeprefix('- ')}" for line in summary_lines(result)]
        sweep = to_sweep_result(result)
        if not options.quick:
            from revtrain.planner.plots import plot_decision_heatmap, plot_step_times

            for plot, suffix in ((plot_decision_heatmap, "heatmap"), (plot_step_times, "step_times")):
                figures.append(plot(sweep, out.with_name(f"{out.name}_{model}_{suffix}.png")).name)
        for r in result.rows:
            m, c, p = (r.settings[k] for k in ("baseline-M", "baseline-C", "plan"))
            plans.append({
                "model": model, "batch": r.batch_size, "blocks": r.n_blocks, "C_blocks": p.c_blocks,
                "baseline_M_s": m.step_time_s, "baseline_C_s": c.step_time_s, "plan_s": p.step_time_s,
                "speedup_over_M": r.speedup_paired[0], "speedup_iqr": r.speedup_paired[1],
                "plan_over_C": r.plan_vs_c_paired[0], "budget_bytes": r.budget_bytes,
                "M_peak_bytes": m.peak_bytes, "C_peak_bytes": c.peak_bytes, "C_fits": c.fits,
                "plan_peak_bytes": p.peak_bytes, "plan_fits": p.fits, "saved_vs_C_bytes": c.peak_bytes - p.peak_bytes,
            })
            for s in r.settings.values():
                settings.append({
                    "model": model, "batch": r.batch_size, "setting": s.name, "C_blocks": s.c_blocks,
                    "step_s": s.step_time_s, "predicted_step_s": s.predicted_step_time_s,
                    "step_error": s.step_time_error, "peak_bytes": s.peak_bytes,
                    "predicted_peak_bytes": s.predicted_peak_bytes, "peak_error": s.peak_error,
                    "additive_peak_bytes": s.additive_peak_bytes, "additive_error": s.additive_peak_error,
                    "fits": s.fits,
                })
            costs.append({"model": model, "batch": r.batch_size, "profile_s": r.profile_s, "solve_s": r.solve_s,
                          "refine_s": r.refine_s, "sum_t_e_s": r.sum_t_e_s,
                          "measured_M_minus_C_s": m.step_time_s - c.step_time_s})
    plan_table = Table(
        "plan", "The plan against the baselines (paper Fig. 5, Table 2)",
        [Column("model", "model"), Column("batch", "batch", "int"), Column("C_blocks", "C-mode blocks", "int"),
         Column("blocks", "of", "int"), Column("baseline_M_s", "baseline-M step", "ms"),
         Column("baseline_C_s", "baseline-C step", "ms"), Column("C_fits", "C fits"), Column("plan_s", "plan step", "ms"),
         Column("speedup_over_M", "plan speed-up over M (paired)", "ratio3"), Column("plan_over_C", "plan / C", "ratio3"),
         Column("M_peak_bytes", "M peak", "bytes"), Column("C_peak_bytes", "C peak", "bytes"),
         Column("plan_peak_bytes", "plan peak", "bytes"), Column("budget_bytes", "budget", "bytes")],
        plans,
        note=("Step = forward + loss + backward + SGD (momentum 0.9) step; medians of steps alternating between the "
              "settings; paired = median over rounds of the ratio of the two settings' steps in the same round. "
              "baseline-C is measured even where its peak exceeds the budget (C fits: False): the plan may not use it there."),
    )
    setting_table = Table(
        "settings", "Predicted against measured, every setting",
        [Column("model", "model"), Column("batch", "batch", "int"), Column("setting", "setting"),
         Column("C_blocks", "C blocks", "int"), Column("predicted_step_s", "pred. step", "ms"),
         Column("step_s", "meas. step", "ms"), Column("step_error", "error", "+.1%"),
         Column("predicted_peak_bytes", "pred. peak", "bytes"), Column("peak_bytes", "meas. peak", "bytes"),
         Column("peak_error", "error", "+.1%"), Column("additive_peak_bytes", "additive m_o+Σm_i", "bytes"),
         Column("additive_error", "error", "+.1%")],
        settings,
        note="Predicted before the measurement from each batch size's own profile; error = (predicted − measured) / measured.",
    )
    cost_table = Table(
        "cost", "The planner's own cost",
        [Column("model", "model"), Column("batch", "batch", "int"), Column("profile_s", "profile", "s"),
         Column("solve_s", "solve", "ms"), Column("refine_s", "refine", "s"), Column("sum_t_e_s", "Σt_e", "ms"),
         Column("measured_M_minus_C_s", "measured M − C", "ms")],
        costs,
    )
    return [plan_table, setting_table, cost_table], notes, figures


_TITLES = {"sweep": "the plan against all-M and all-C across batch sizes",
           "whole-model": "the whole model, recompute for plain layers and M/C for reversible ones"}
_INTROS = {"sweep": ("Per model and batch size: verify, profile (t_e, m_i, m_o), solve the knapsack (`plan (refine=0)`, the "
          "paper's plan), refine against measured peaks (`plan`), then measure the four settings in alternating "
          "rounds and one step of each under the memory tracker. One budget per model for every batch size."),
           "whole-model": ("Per model, one profile of every layer's options serves budgets from plain backprop's step "
                           "memory down to the smallest that recomputing every plain layer allows; at each, the plan "
                           "with every option (new) and the M/C-only plan (a) are measured beside checkpointing with "
                           "every block in M-mode (b) and plain backprop (c).")}
