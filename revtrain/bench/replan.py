"""Re-planning the same case: do the plans agree, and does the printed prediction hold?

Runs ``revtrain plan`` several times on one case (model, batch size, budget), each in a fresh
process as a user would, and then measures all the plans it made, plus baseline-M, in one run
whose settings' timed steps alternate (:func:`revtrain.planner.measure_steps`). It reports

* each plan: its C-mode blocks, its predicted step time, the step time ``revtrain plan`` measured
  at the end of planning and the prediction's error against it;
* the plans' step times in the common, interleaved measurement, and their spread
  ``max / min - 1`` (plans that differ only within the noise of ``t_e`` run equally fast);
* the noise of each prediction from the profile's spread of ``t_e``:
  ``sqrt(sum over C-mode blocks of se_i^2)``, ``se_i = 0.929 * IQR_i / sqrt(pairs_i)``.

Issue 7's goals: the plans' measured step times within 3% of each other, each printed
prediction within 10% of the measured step. The script states whether they were met; it never
adjusts them.
"""

from __future__ import annotations

import math
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch

from revtrain.device import float_dtype, resolve_device
from revtrain.memory import format_bytes
from revtrain.planner import Plan, Profile, TimingRule, measure_steps, prepare
from revtrain.planner.budget import check_budget
from revtrain.timing import iqr, stderr_from_iqr

__all__ = [
    "Replan",
    "ReplanBenchConfig",
    "ReplanBenchResult",
    "format_replan_table",
    "goal_lines",
    "run_replan_benchmark",
]


@dataclass(kw_only=True)
class ReplanBenchConfig:
    """The case to re-plan, how often, and how the plans are compared."""

    model: str = "revnet110"
    """Zoo model name (`revtrain models`)."""
    batch_size: int = 32
    """Batch size planned for."""
    budget: str = "131MiB"
    """Step memory allowed; the default gives RevNet-110 at batch 32 a mixed plan (about 12 of 25 blocks in C-mode)."""
    replans: int = 3
    """How many times `revtrain plan` runs, each in a fresh process."""
    device: str = "cpu"
    """cpu, cuda or cuda:N."""
    dtype: Literal["float32", "float64", "bfloat16", "float16"] = "float32"
    """Parameter dtype."""
    threads: int = 1
    """CPU threads of every run (revtrain plan --threads, and the comparison)."""
    plan_repeats: int = 3
    """revtrain plan --repeats: timed steps of each whole-step measurement while planning."""
    repeats: int = 9
    """Timed rounds of the final comparison, in which every plan's steps alternate with the others'."""
    warmup: int = 2
    """Untimed steps per setting before the comparison."""
    t_e_precision: float = 0.05
    """revtrain plan --t-e-precision."""
    t_e_max_pairs: int = 30
    """revtrain plan --t-e-max-pairs."""
    seed: int = 0
    """Seed of the model's weights and the example batch (the same in every run)."""
    spread_goal: float = 0.03
    """Goal: the plans' measured step times lie within this fraction of each other."""
    prediction_goal: float = 0.10
    """Goal: each printed prediction lies within this fraction of the step measured after planning."""

    def __post_init__(self) -> None:
        from revtrain.models import model_info

        model_info(self.model)
        check_budget(self.budget)
        float_dtype(self.dtype)
        resolve_device(self.device)
        TimingRule.with_cap(self.t_e_precision, self.t_e_max_pairs)
        for name in ("batch_size", "replans", "threads", "plan_repeats", "repeats", "warmup"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")


@dataclass(kw_only=True)
class Replan:
    """One run of ``revtrain plan`` and how its plan fared."""

    index: int
    """1, 2, ... in the order run."""
    command: str
    """The command line run."""
    modes: dict[str, str]
    """The plan's mode per block."""
    c_blocks: int
    """Blocks in C-mode."""
    predicted_step_time_s: float
    """The plan's predicted step time, as printed."""
    prediction_noise_s: float
    """Standard error of the prediction from the profile's spread of t_e (module docstring)."""
    planned_step_time_s: float
    """The step time revtrain plan measured at the end of planning, as printed."""
    predicted_peak_bytes: int
    measured_peak_bytes: int
    wall_s: float
    """Seconds the whole revtrain plan run took."""
    compared_times_s: tuple[float, ...] = ()
    """Its timed steps in the final comparison, one per round."""

    @property
    def prediction_error(self) -> float:
        """(predicted - measured at the end of planning) / measured."""
        return self.predicted_step_time_s / self.planned_step_time_s - 1

    @property
    def compared_step_time_s(self) -> float:
        """Median step time in the final comparison."""
        return statistics.median(self.compared_times_s)

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "prediction_error": self.prediction_error,
                "compared_step_time_s": self.compared_step_time_s}


@dataclass(kw_only=True)
class ReplanBenchResult:
    """Every re-plan and the comparison."""

    config: ReplanBenchConfig
    replans: list[Replan]
    baseline_M_times_s: tuple[float, ...]
    """Baseline-M's timed steps in the final comparison."""
    budget_bytes: int
    comparison_s: float
    """Seconds of the final comparison."""
    outputs: list[str] = field(default_factory=list)
    """What each revtrain plan printed."""

    @property
    def spread(self) -> float:
        """``max / min - 1`` of the plans' median step times in the comparison."""
        times = [r.compared_step_time_s for r in self.replans]
        return max(times) / min(times) - 1

    @property
    def spread_met(self) -> bool:
        return self.spread <= self.config.spread_goal

    @property
    def predictions_met(self) -> bool:
        return all(abs(r.prediction_error) <= self.config.prediction_goal for r in self.replans)

    def paired_to_first(self, replan: Replan) -> tuple[float, float]:
        """Median and IQR over rounds of this plan's step / the first plan's step in the same round."""
        ratios = [a / b for a, b in zip(replan.compared_times_s, self.replans[0].compared_times_s)]
        return statistics.median(ratios), iqr(ratios)

    def to_dict(self) -> dict[str, Any]:
        return {
            "config": asdict(self.config), "budget_bytes": self.budget_bytes, "comparison_s": self.comparison_s,
            "baseline_M_times_s": list(self.baseline_M_times_s),
            "baseline_M_step_time_s": statistics.median(self.baseline_M_times_s),
            "replans": [r.to_dict() for r in self.replans], "spread": self.spread,
            "spread_met": self.spread_met, "predictions_met": self.predictions_met, "outputs": self.outputs,
        }


def run_replan_benchmark(
    config: ReplanBenchConfig, work_dir: Path, *, log: Callable[[str], None] = lambda line: None
) -> ReplanBenchResult:
    """Re-plan ``config.replans`` times in fresh processes, then compare the plans (module docstring).

    Plans and profiles are written to ``work_dir``.
    """
    work_dir.mkdir(parents=True, exist_ok=True)
    replans, outputs = [], []
    for i in range(1, config.replans + 1):
        plan_path, profile_path = work_dir / f"plan_{i}.json", work_dir / f"profile_{i}.json"
        argv = [
            sys.executable, "-m", "revtrain.cli", "plan", "--model", config.model,
            "--batch-size", str(config.batch_size), "--budget", config.budget, "--device", config.device,
            "--dtype", config.dtype, "--threads", str(config.threads), "--repeats", str(config.plan_repeats),
            "--t-e-precision", str(config.t_e_precision), "--t-e-max-pairs", str(config.t_e_max_pairs),
            "--seed", str(config.seed), "--out", str(plan_path), "--profile-out", str(profile_path),
        ]
        log(f"re-plan {i}/{config.replans}: {' '.join(argv[2:])}")
        start = time.perf_counter()
        done = subprocess.run(argv, capture_output=True, text=True, check=False)
        wall = time.perf_counter() - start
        outputs.append(done.stdout + done.stderr)
        if done.returncode != 0:
            raise RuntimeError(f"revtrain plan failed (exit {done.returncode}):\n{done.stdout}{done.stderr}")
        plan, profile = Plan.from_json(plan_path), Profile.from_json(profile_path)
        assert plan.measured_step_time_s is not None and plan.measured_peak_bytes is not None
        replans.append(Replan(
            index=i, command=" ".join(["revtrain", *argv[4:]]), modes=dict(plan.modes),
            c_blocks=len(plan.c_mode_blocks), predicted_step_time_s=plan.predicted_step_time_s,
            prediction_noise_s=_prediction_noise(profile, plan), planned_step_time_s=plan.measured_step_time_s,
            predicted_peak_bytes=plan.predicted_peak_bytes, measured_peak_bytes=plan.measured_peak_bytes,
            wall_s=wall,
        ))
        log(f"  {plan.summary()} ({wall:.0f} s)")
    log("comparing the plans and baseline-M, their steps alternating ...")
    start = time.perf_counter()
    times, budget = _compare(config, replans)
    comparison_s = time.perf_counter() - start
    for r in replans:
        r.compared_times_s = tuple(times[f"plan {r.index}"])
    return ReplanBenchResult(config=config, replans=replans, baseline_M_times_s=tuple(times["baseline-M"]),
                             budget_bytes=budget, comparison_s=comparison_s, outputs=outputs)


def _compare(config: ReplanBenchConfig, replans: list[Replan]) -> tuple[dict[str, list[float]], int]:
    from revtrain.models import create_model, input_spec
    from revtrain.planner import resolve_budget
    from revtrain.tasks import task_for

    threads = torch.get_num_threads()
    torch.set_num_threads(config.threads)
    try:
        dev, dtype = resolve_device(config.device), float_dtype(config.dtype)
        spec = input_spec(config.model)
        spec = spec.with_changes(dtype=dtype) if spec.kind == "image" else spec
        torch.manual_seed(config.seed)  # the same weights and batch as every revtrain plan run
        model = create_model(config.model).to(dtype)
        settings: dict[str, Any] = {"baseline-M": "M", **{f"plan {r.index}": r.modes for r in replans}}
        with prepare(model, spec.example(config.batch_size, dev, seed=config.seed), loss_fn=task_for(spec).loss,
                     device=dev, repeats=config.repeats, warmup=config.warmup) as setup:
            steps = measure_steps(setup, settings, repeats=config.repeats)
        budget, _ = resolve_budget(config.budget, dev)
        return {name: list(m.times_s) for name, m in steps.items()}, budget
    finally:
        torch.set_num_threads(threads)


def _prediction_noise(profile: Profile, plan: Plan) -> float:
    variance = 0.0
    for b in profile.blocks:
        if plan.modes[b.name] == "C" and b.t_e_iqr_s is not None and b.t_e_pairs:
            variance += stderr_from_iqr(b.t_e_iqr_s, b.t_e_pairs) ** 2
    return math.sqrt(variance)


def format_replan_table(result: ReplanBenchResult) -> str:
    """One row per re-plan: the plan, its prediction, what planning measured, the comparison."""
    lines = [
        ("| re-plan | C-mode blocks | modes (M/C per block) | predicted step s (± t_e noise) | measured at end "
         "of planning s | prediction error | comparison: step s (median) | ÷ re-plan 1 (paired, IQR) "
         "| peak predicted / measured | planning wall s |"),
        "|---:|---:|:---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in result.replans:
        ratio, spread = result.paired_to_first(r)
        lines.append(
            f"| {r.index} | {r.c_blocks}/{len(r.modes)} | `{''.join(r.modes.values())}` "
            f"| {r.predicted_step_time_s:.4f} (± {r.prediction_noise_s:.4f}) | {r.planned_step_time_s:.4f} "
            f"| {r.prediction_error:+.1%} | {r.compared_step_time_s:.4f} | {ratio:.4f} ({spread:.4f}) "
            f"| {format_bytes(r.predicted_peak_bytes)} / {format_bytes(r.measured_peak_bytes)} | {r.wall_s:.0f} |"
        )
    base = statistics.median(result.baseline_M_times_s)
    lines.append(f"| baseline-M | 0/{len(result.replans[0].modes)} | | | | | {base:.4f} | | | |")
    return "\n".join(lines)


def goal_lines(result: ReplanBenchResult) -> list[str]:
    """The two goals, each with the measured figure and whether it was met."""
    c = result.config
    errors = ", ".join(f"{r.prediction_error:+.1%}" for r in result.replans)
    return [
        f"- Spread of the plans' step times in the common measurement: {result.spread:.2%} "
        f"(goal ≤ {c.spread_goal:.0%}): {'met' if result.spread_met else 'NOT met'}.",
        f"- Printed prediction vs the step measured at the end of planning: {errors} "
        f"(goal within ±{c.prediction_goal:.0%}): {'met' if result.predictions_met else 'NOT met'}.",
        "- Identical plans: " + ("all" if len({tuple(r.modes.values()) for r in result.replans}) == 1 else
                                  f"{len({tuple(r.modes.values()) for r in result.replans})} different plans "
                                  f"among {len(result.replans)}") + ".",
    ]
