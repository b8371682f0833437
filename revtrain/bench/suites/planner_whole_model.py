"""The planner suite's ``whole-model`` part: the fastest step under budgets down to what
recomputing the non-reversible layers allows (``revtrain bench planner --methods whole-model``).

Per model (RevNet-38 and RevNet-110 by default; 3×32×32 inputs, batch 64, SGD with momentum), one
profile with every option (M/C per reversible block; keep or recompute per plain layer) serves a
ladder of budgets: plain backprop's step memory, halfway to all-M, all-M's, and evenly spaced
down to the smallest step the options reach (every block in M-mode, every plain layer
recomputed). At each budget it plans with every option (*new*) and with Jiang et al.'s M/C choice
only (*(a)*), then measures, in one run whose settings' timed steps alternate, the distinct plans
beside (b) ``torch.utils.checkpoint`` on every plain layer with every block in M-mode and (c)
plain backprop. Each setting's step memory is measured; the new plan's step is compared with
(a)'s and (b)'s by per-round ratios with an interval (:func:`revtrain.timing.median_interval`).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from revtrain.bench.report import Column, Table, interval_cells
from revtrain.memory import format_bytes
from revtrain.models import create_model, example_batch
from revtrain.planner import (
    BudgetTooSmallError,
    TimingRule,
    measure_steps,
    plain_layers,
    prepare,
    profile_setup,
    run_pipeline,
)
from revtrain.timing import median_interval

__all__ = ["WholeModelCase", "whole_model_tables"]

PLAIN, CHECKPOINT = "(c) plain", "(b) checkpoint + M"


@dataclass(kw_only=True)
class WholeModelCase:
    """What the whole-model part measures, and how carefully (the fast profile options of
    ``revtrain plan``: ``t_e_max_pairs``, ``refine``)."""

    models: tuple[str, ...] = ("revnet38", "revnet110")
    batch_size: int = 64
    side: int = 32
    """Height and width of the 3-channel inputs."""
    rounds: int = 6
    """Timed rounds of the final comparison (the settings' steps alternate in each); 6 or more give
    intervals of at least 95%."""
    t_e_max_pairs: int = 5
    """M/C pairs per block at most while profiling."""
    refine: int = 1
    """Richer plans measured per budget (``revtrain plan --refine``)."""
    steps_below: int = 3
    """Budgets between all-M's step memory and the smallest, evenly spaced."""


QUICK_CASE = WholeModelCase(models=("revnet38",), batch_size=4, side=8, rounds=2, t_e_max_pairs=3, steps_below=1)


def whole_model_tables(case: WholeModelCase, device: torch.device, log: Callable[[str], None]) -> tuple[list[Table], list[str]]:
    """Measure every model of ``case``; returns the tables and the notes (profile warnings)."""
    budgets, settings, layers, notes = [], [], [], []
    for name in case.models:
        found = _measure_model(name, case, device, log)
        budgets += found["budgets"]
        settings += found["settings"]
        layers += found["layers"]
        notes += [f"{name}: profile warning: {w}" for w in found["warnings"]]
        notes.append(f"{name}: profiling took {found['profile_s']:.0f} s, the whole model {found['total_s']:.0f} s")
    coverage = median_interval([0.0] * case.rounds).coverage
    budget_table = Table(
        "whole_model", "The fastest step under each budget: every option (new) against M/C only (a)",
        [Column("model", "model"), Column("budget_bytes", "budget", "bytes"), Column("vs_all_M", "vs all-M", "+.1%"),
         Column("new_plan", "new: C blocks, recomputed"), Column("new_step_s", "new step [interval]", "interval"),
         Column("new_peak_bytes", "new peak", "bytes"), Column("mc_plan", "(a): C blocks"),
         Column("mc_step_s", "(a) step [interval]", "interval"), Column("mc_peak_bytes", "(a) peak", "bytes"),
         Column("new_over_mc", "new / (a), paired [interval]", "interval"),
         Column("new_over_b", "new / (b), paired [interval]", "interval"), Column("b_fits", "(b) fits"),
         Column("c_fits", "(c) fits")],
        budgets,
        note=("Budgets bound the step memory (peak tensor bytes of one training step: parameters, gradients, "
              "optimizer state, batch, activations, caches kept between steps); every peak is measured. *new* plans "
              "with every option, (a) with Jiang et al.'s M/C choice only ('infeasible': no M/C plan fits), (b) is "
              "`torch.utils.checkpoint` on every plain layer with every block in M-mode, (c) plain backprop. Steps "
              f"in seconds: medians of {case.rounds} rounds in which every setting's step alternates; paired = "
              f"median of the per-round ratios; intervals of {coverage:.1%} (`median_interval`)."),
    )
    setting_table = Table(
        "whole_model_settings", "Every setting measured",
        [Column("model", "model"), Column("setting", "setting"), Column("step_s", "step [interval]", "interval"),
         Column("peak_bytes", "step memory", "bytes"), Column("vs_all_M", "vs all-M", "+.1%")],
        settings,
        note=("'new@B' / 'mc@B': the plan made for budget B with every option / M/C only; a setting found for "
              "several budgets (or equal to (b) or (c)) is measured once, under its first name."),
    )
    layer_table = Table(
        "whole_model_layers", "What recomputing each plain layer costs and frees (profiled)",
        [Column("model", "model"), Column("layer", "layer"), Column("recompute_s", "recompute cost", "ms"),
         Column("frees_bytes", "bytes freed", "bytes")],
        layers,
    )
    return [budget_table, setting_table, layer_table], notes


def _measure_model(name: str, case: WholeModelCase, device: torch.device, log: Callable[[str], None]) -> dict[str, Any]:
    torch.manual_seed(0)
    model = create_model(name)
    batch = example_batch(name, case.batch_size, input_size=(3, case.side, case.side))
    rule = TimingRule(warmup_pairs=1, min_pairs=min(3, case.t_e_max_pairs), max_pairs=case.t_e_max_pairs)
    with prepare(model, batch, device=device, repeats=1, max_repeats=2, warmup=1, model_name=name) as setup:
        start = time.perf_counter()
        log(f"{name}: profiling every layer's options ...")
        profile = profile_setup(setup, timing=rule, run_baseline_c=True)
        profile_s = time.perf_counter() - start
        all_m = {b.name: "M" for b in profile.blocks}
        smallest = {**all_m, **dict.fromkeys((n for n, _ in plain_layers(model)), "recompute")}
        refs = measure_steps(setup, {"plain": "C", "all-M": all_m, "smallest": smallest}, repeats=0)
        plain_peak, m_peak, low = (refs[k].peak_bytes for k in ("plain", "all-M", "smallest"))
        ladder = [plain_peak, (plain_peak + m_peak) // 2, m_peak]
        ladder += [m_peak - (m_peak - low) * k // case.steps_below for k in range(1, case.steps_below + 1)]
        ladder = list(dict.fromkeys(ladder))
        all_c = {b.name: "C" for b in profile.blocks}
        timed: dict[str, Any] = {PLAIN: all_c, CHECKPOINT: smallest}
        named = {_identity(all_c): PLAIN, _identity(smallest): CHECKPOINT}
        plans = []
        for budget in ladder:
            row: dict[str, Any] = {"budget": budget}
            for key, choices in (("new", "all"), ("mc", "mc")):
                try:
                    plan = run_pipeline(setup, budget, verify=False, profile=profile, refine=case.refine,
                                        choices=choices).plan
                except BudgetTooSmallError:
                    row[key] = None
                    continue
                label = named.setdefault(_identity(plan.setting()), f"{key}@{format_bytes(budget)}")
                timed.setdefault(label, plan.setting())
                row[key] = (label, plan)
            plans.append(row)
            log(f"  budget {format_bytes(budget)}: new {_describe(row['new'])}, M/C only {_describe(row['mc'])}")
        log(f"{name}: measuring {len(timed)} settings, their steps alternating, {case.rounds} rounds ...")
        measured = measure_steps(setup, timed, repeats=case.rounds)
        total_s = time.perf_counter() - start

    def times(label: str) -> list[float]:
        return list(measured[label].times_s)

    def paired(a: str, b: str) -> dict[str, float]:
        return interval_cells("", median_interval([x / y for x, y in zip(times(a), times(b))]))

    def step(key: str, label: str) -> dict[str, float]:
        return interval_cells(key, median_interval(times(label)))

    budgets = []
    for row in plans:
        b = row["budget"]
        cells: dict[str, Any] = {"model": name, "budget_bytes": b, "vs_all_M": b / m_peak - 1,
                                 "b_fits": _yes(measured[CHECKPOINT].peak_bytes <= b),
                                 "c_fits": _yes(measured[PLAIN].peak_bytes <= b)}
        for key in ("new", "mc"):
            if row[key] is None:
                cells[f"{key}_plan"] = "infeasible"
                continue
            label, plan = row[key]
            cells[f"{key}_plan"] = _describe(row[key])
            cells.update(step(f"{key}_step_s", label))
            cells[f"{key}_peak_bytes"] = measured[label].peak_bytes
        if row["new"] is not None:
            if row["mc"] is not None:
                cells.update({f"new_over_mc{k}": v for k, v in paired(row["new"][0], row["mc"][0]).items()})
            if measured[CHECKPOINT].peak_bytes <= b and row["new"][0] != CHECKPOINT:
                cells.update({f"new_over_b{k}": v for k, v in paired(row["new"][0], CHECKPOINT).items()})
        budgets.append(cells)
    settings = [{"model": name, "setting": label, **step("step_s", label), "peak_bytes": m.peak_bytes,
                 "vs_all_M": m.peak_bytes / m_peak - 1} for label, m in measured.items()]
    settings += [{"model": name, "setting": "all-M (peak only)", "peak_bytes": m_peak, "vs_all_M": 0.0}]
    layers = [{"model": name, "layer": x.name, "recompute_s": x.recompute_s, "frees_bytes": x.recompute_saves_bytes}
              for x in profile.layers]
    return {"budgets": budgets, "settings": settings, "layers": layers, "warnings": list(profile.warnings),
            "profile_s": profile_s, "total_s": total_s}


def _identity(setting: dict[str, str]) -> tuple:
    """A setting without its defaults: plans that differ only in naming kept layers are one setting."""
    return tuple(sorted((k, v) for k, v in setting.items() if v != "keep"))


def _yes(fits: bool) -> str:
    return "yes" if fits else "no"


def _describe(found: tuple[str, Any] | None) -> str:
    if found is None:
        return "infeasible"
    plan = found[1]
    return f"{len(plan.c_mode_blocks)}, {', '.join(plan.recomputed_layers) or '-'}"
