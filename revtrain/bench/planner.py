"""The planner benchmark: baseline-M, baseline-C and the plan, measured across batch sizes.

For one zoo model and a list of batch sizes, under one memory budget, each batch size gets the
planner's stages 1-3 (:func:`revtrain.core.verify_invertible` once, then
:func:`~revtrain.planner.profile_model` and :func:`~revtrain.planner.plan_for_model`, both with
``refine=0``, the paper's knapsack as solved, and with refinement), and then one interleaved
measurement (:func:`~revtrain.planner.measure_steps`: the settings' timed steps alternate, so a
change of machine load hits each alike) of whole training steps (forward, cross-entropy,
backward, SGD step) for

- ``baseline-M``: every reversible block in M-mode (rebuild inputs in backward);
- ``baseline-C``: every block in C-mode, measured even where its peak exceeds the budget (it is
  then marked as not fitting: the reference the plan cannot have);
- ``plan``: the refined plan (the default of ``plan_for_model``), and ``plan (refine=0)``.

Each row holds what was predicted before the measurement (from the profile: step time
``baseline-M - sum(t_e over C-mode blocks)``, peak ``m_o + sum(m_i over C-mode blocks)``) next
to what was measured, so the prediction error is part of the result (Jiang et al. 2021, §3.2-3.4,
Fig. 4, Fig. 5, Table 2).

The budget is fixed across batch sizes, as a device's memory is in the paper. Without one,
:func:`auto_budget` puts it where the plan matters: above baseline-C's peak at the smallest batch
size and above baseline-M's at the largest, so baseline-C fits at the small end and baseline-M
(just) at the large end, and every batch size in between must mix modes.

Example:
    >>> config = PlannerBenchConfig(model="revnet38", batch_sizes=(4, 8), repeats=2)
    >>> result = run_planner_benchmark(config)
    >>> print(format_planner_table(result.rows))
"""

from __future__ import annotations

import gc
import math
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, fields
from typing import Any

import torch
from torch import Tensor, nn

from revtrain.device import resolve_device
from revtrain.memory import format_bytes
from revtrain.planner import (
    Plan,
    Profile,
    StepMeasurement,
    SweepPoint,
    SweepResult,
    measure_steps,
    plan_for_model,
    profile_model,
    resolve_budget,
)

__all__ = [
    "PlannerBenchConfig",
    "PlannerBenchResult",
    "PlannerBenchRow",
    "SettingResult",
    "auto_budget",
    "format_accuracy_table",
    "format_planner_table",
    "format_refine_table",
    "run_planner_benchmark",
    "to_sweep_result",
]

_DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16}

SETTINGS: tuple[str, ...] = ("baseline-M", "baseline-C", "plan", "plan (refine=0)")
"""The settings measured at every batch size, in table order."""


@dataclass(kw_only=True)
class PlannerBenchConfig:
    """What to plan and measure, and how often."""

    model: str = "revnet110"
    """Zoo model name (``revtrain models``)."""
    batch_sizes: tuple[int, ...] = (8, 16, 32, 64)
    """Batch sizes to plan and measure, ascending."""
    budget: int | str | None = None
    """Peak memory budget of a training step, the same at every batch size: bytes, ``"120MiB"``,
    a fraction ``"50%"`` (see :func:`revtrain.planner.resolve_budget`), or None for
    :func:`auto_budget`."""
    budget_margin: float = 1.2
    """With ``budget=None``: the factor :func:`auto_budget` applies to the larger of baseline-C's
    peak at the smallest batch size and baseline-M's peak at the largest."""
    device: str = "cpu"
    """``cpu``, ``cuda`` or ``cuda:N``."""
    dtype: str = "float32"
    """Parameter and input dtype."""
    input_shape: tuple[int, ...] | None = None
    """One sample's shape; default the model's (CIFAR: 3x32x32)."""
    num_classes: int | None = None
    """Classifier outputs; default the model's (CIFAR-10: 10)."""
    repeats: int = 5
    """Timed steps per setting in the final, interleaved measurement (medians are reported)."""
    warmup: int = 2
    """Untimed steps per setting before it."""
    profile_repeats: int = 3
    """Timed repetitions of each profiling measurement (``profile_model(repeats=...)``)."""
    refine: int = 4
    """``plan_for_model(refine=...)`` of the plan; ``plan (refine=0)`` is always solved too."""
    threads: int | None = 1
    """CPU intra-op threads during the run (``torch.set_num_threads``), restored afterwards;
    None keeps torch's. One by default: on a shared 2-core machine two threads spin-wait for each
    other and timings become unusable under any load (``results/core_stack_cpu_findings.md``)."""
    seed: int = 0
    """Seed of the model's weights and of the synthetic batch."""

    def __post_init__(self) -> None:
        self.batch_sizes = tuple(sorted({int(b) for b in self.batch_sizes}))
        if not self.batch_sizes or self.batch_sizes[0] < 1:
            raise ValueError(f"batch_sizes must be positive integers, got {self.batch_sizes}")
        if self.dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of {sorted(_DTYPES)}, got {self.dtype!r}")
        for name in ("repeats", "warmup", "profile_repeats"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.refine < 0:
            raise ValueError(f"refine must be >= 0, got {self.refine}")
        if not self.budget_margin >= 1:
            raise ValueError(f"budget_margin must be >= 1, got {self.budget_margin}")
        if self.threads is not None and self.threads < 1:
            raise ValueError(f"threads must be a positive integer or None, got {self.threads!r}")
        if self.input_shape is not None:
            self.input_shape = tuple(int(d) for d in self.input_shape)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(kw_only=True)
class SettingResult:
    """One setting (baseline or plan) at one batch size: predicted and measured."""

    name: str
    """``baseline-M``, ``baseline-C``, ``plan`` or ``plan (refine=0)``."""
    c_blocks: int
    """Blocks in C-mode."""
    step_time_s: float
    """Measured median seconds per training step."""
    step_time_iqr_s: float
    """Interquartile range of the timed steps."""
    times_s: tuple[float, ...]
    """Every timed step, in order (round ``i`` of every setting ran back to back)."""
    peak_bytes: int
    """Measured peak bytes of one step (:mod:`revtrain.planner.measure`)."""
    fits: bool
    """Measured peak <= budget."""
    predicted_step_time_s: float
    """Before measuring, from the profile: baseline-M's profiled step minus the ``t_e`` of the
    C-mode blocks (baseline-M: its profiled step)."""
    predicted_peak_bytes: int
    """What the planner predicted: the plan's ``predicted_peak_bytes`` (for a refined plan that
    is the peak measured while refining); for baselines the additive model."""
    additive_peak_bytes: int
    """The knapsack's memory model: ``m_o + sum(m_i over C-mode blocks)``."""
    step_time_from_run_M_s: float
    """This measurement's baseline-M step minus the ``t_e`` of the C-mode blocks: the ``t_e``
    model's error without the drift of baseline-M between profiling and measuring."""

    @property
    def step_time_error(self) -> float:
        """(predicted - measured) / measured step time."""
        return _rel(self.predicted_step_time_s, self.step_time_s)

    @property
    def peak_error(self) -> float:
        """(predicted - measured) / measured peak."""
        return _rel(self.predicted_peak_bytes, self.peak_bytes)

    @property
    def additive_peak_error(self) -> float:
        """(additive model - measured) / measured peak."""
        return _rel(self.additive_peak_bytes, self.peak_bytes)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> SettingResult:
        """Inverse of :meth:`to_dict` (derived fields are recomputed)."""
        names = {f.name for f in fields(cls)}
        return cls(**{k: (tuple(v) if k == "times_s" else v) for k, v in data.items() if k in names})

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data.update(
            step_time_error=self.step_time_error,
            peak_error=self.peak_error,
            additive_peak_error=self.additive_peak_error,
        )
        return data


@dataclass(kw_only=True)
class PlannerBenchRow:
    """Everything measured at one batch size."""

    batch_size: int
    budget_bytes: int
    n_blocks: int
    """Reversible blocks of the model."""
    settings: dict[str, SettingResult]
    """By name, in :data:`SETTINGS` order."""
    modes: dict[str, str]
    """The (refined) plan's mode per block."""
    modes_refine0: dict[str, str]
    """The plan's mode per block as the knapsack solved it."""
    profile: dict[str, Any]
    """The profile (:meth:`revtrain.planner.Profile.to_json` data)."""
    profile_s: float
    """Seconds spent profiling (stage 2)."""
    solve_s: float
    """Seconds of ``plan_for_model(refine=0)`` given the profile (stage 3)."""
    refine_s: float
    """Seconds of ``plan_for_model(refine=...)`` given the profile: solving plus measuring the
    peaks of up to ``refine`` richer plans."""

    def setting(self, name: str) -> SettingResult:
        return self.settings[name]

    @property
    def speedup(self) -> float:
        """Measured baseline-M median step / the plan's median step."""
        return self.settings["baseline-M"].step_time_s / self.settings["plan"].step_time_s

    @property
    def speedup_paired(self) -> tuple[float, float]:
        """Median and IQR over rounds of baseline-M's step / the plan's step in the same round."""
        return _paired(self.settings["baseline-M"].times_s, self.settings["plan"].times_s)

    @property
    def plan_vs_c_paired(self) -> tuple[float, float]:
        """Median and IQR over rounds of the plan's step / baseline-C's step in the same round."""
        return _paired(self.settings["plan"].times_s, self.settings["baseline-C"].times_s)

    @property
    def sum_t_e_s(self) -> float:
        return sum(b["t_e_s"] for b in self.profile["blocks"])

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> PlannerBenchRow:
        """Inverse of :meth:`to_dict` (derived fields are recomputed)."""
        names = {f.name for f in fields(cls)}
        kwargs = {k: v for k, v in data.items() if k in names}
        kwargs["settings"] = {k: SettingResult.from_dict(v) for k, v in data["settings"].items()}
        return cls(**kwargs)

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["settings"] = {k: v.to_dict() for k, v in self.settings.items()}
        data.update(
            speedup=self.speedup,
            speedup_paired=self.speedup_paired,
            plan_vs_c_paired=self.plan_vs_c_paired,
            sum_t_e_s=self.sum_t_e_s,
        )
        return data


@dataclass(kw_only=True)
class PlannerBenchResult:
    """The rows and how the budget was chosen."""

    config: PlannerBenchConfig
    budget_bytes: int
    budget_source: str
    rows: list[PlannerBenchRow]
    block_names: list[str]
    model_name: str
    device: str
    dtype: str
    input_shape: tuple[int, ...]
    """One sample's shape."""
    num_classes: int
    """Classifier outputs."""
    verify_s: float
    """Seconds of stage 1 (verify every block's inverse, once, at the smallest batch size)."""
    budget_peaks: dict[str, int] = field(default_factory=dict)
    """With an automatic budget: the peaks it was computed from."""

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> PlannerBenchResult:
        """Inverse of :meth:`to_dict`: re-render a results file's tables without measuring again."""
        names = {f.name for f in fields(cls)}
        kwargs = {k: v for k, v in data.items() if k in names}
        config = dict(data["config"])
        config["batch_sizes"] = tuple(config["batch_sizes"])
        kwargs.update(
            config=PlannerBenchConfig(**config),
            rows=[PlannerBenchRow.from_dict(r) for r in data["rows"]],
            input_shape=tuple(data["input_shape"]),
        )
        return cls(**kwargs)

    def to_dict(self) -> dict[str, Any]:
        return {
            "config": self.config.to_dict(),
            "budget_bytes": self.budget_bytes,
            "budget_source": self.budget_source,
            "budget_peaks": self.budget_peaks,
            "model_name": self.model_name,
            "device": self.device,
            "dtype": self.dtype,
            "input_shape": list(self.input_shape),
            "num_classes": self.num_classes,
            "verify_s": self.verify_s,
            "block_names": self.block_names,
            "rows": [r.to_dict() for r in self.rows],
        }


def auto_budget(
    model: nn.Module,
    make_batch: Callable[[int], tuple[Tensor, Tensor]],
    batch_sizes: Sequence[int],
    *,
    margin: float = 1.2,
    device: torch.device | str | None = None,
) -> tuple[int, str, dict[str, int]]:
    """A budget between the baselines: ``margin * max(peak_C(b_min), peak_M(b_max))``, whole MiB.

    Measures baseline-C's peak at the smallest batch size and baseline-M's at the largest (one
    untimed step each, then one under the memory tracker). Returns ``(bytes, explanation,
    peaks)``.
    """
    small, large = min(batch_sizes), max(batch_sizes)
    peak_c = measure_steps(model, make_batch(small), {"C": "C"}, device=device, repeats=0, warmup=1)["C"]
    peak_m = measure_steps(model, make_batch(large), {"M": "M"}, device=device, repeats=0, warmup=1)["M"]
    top = max(peak_c.peak_bytes, peak_m.peak_bytes)
    mib = 2**20
    budget = math.ceil(margin * top / mib) * mib
    text = (
        f"automatic: {margin:g} x max(baseline-C peak at batch {small} = {format_bytes(peak_c.peak_bytes)}, "
        f"baseline-M peak at batch {large} = {format_bytes(peak_m.peak_bytes)}), rounded up to a MiB "
        f"= {format_bytes(budget)} ({budget} bytes)"
    )
    peaks = {f"baseline-C@{small}": peak_c.peak_bytes, f"baseline-M@{large}": peak_m.peak_bytes}
    return budget, text, peaks


def run_planner_benchmark(
    config: PlannerBenchConfig, *, log: Callable[[str], None] = lambda line: None
) -> PlannerBenchResult:
    """Plan and measure every batch size of ``config`` (module docstring); ``log`` gets progress."""
    from revtrain.core import reversible_blocks, verify_invertible
    from revtrain.models import create_model, model_info

    threads = torch.get_num_threads()
    if config.threads is not None:
        torch.set_num_threads(config.threads)
    try:
        dev = resolve_device(config.device)
        dtype = _DTYPES[config.dtype]
        info = model_info(config.model)
        shape = config.input_shape or tuple(info.input_size)
        classes = config.num_classes or info.num_classes
        torch.manual_seed(config.seed)
        model = create_model(config.model, num_classes=classes, in_channels=shape[0]).to(dev, dtype)
        names = [name for name, _ in reversible_blocks(model)]

        def make_batch(b: int) -> tuple[Tensor, Tensor]:
            gen = torch.Generator().manual_seed(config.seed)
            x = torch.randn(b, *shape, generator=gen).to(dev, dtype)  # (B, C, H, W)
            y = torch.randint(0, classes, (b,), generator=gen).to(dev)
            return x, y

        start = time.perf_counter()
        verify_invertible(model, make_batch(config.batch_sizes[0])[0])
        verify_s = time.perf_counter() - start
        log(f"{config.model}: {len(names)} reversible blocks, inverses verified in {verify_s:.1f} s")

        peaks: dict[str, int] = {}
        if config.budget is None:
            budget, source, peaks = auto_budget(
                model, make_batch, config.batch_sizes, margin=config.budget_margin, device=dev
            )
        else:
            budget, source = resolve_budget(config.budget, dev)
        log(f"budget: {source}")

        rows = []
        for b in config.batch_sizes:
            rows.append(_measure_batch_size(model, make_batch(b), budget, config, dev, log))
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
            input_shape=tuple(shape),
            num_classes=classes,
            verify_s=verify_s,
            budget_peaks=peaks,
        )
    finally:
        torch.set_num_threads(threads)


def _measure_batch_size(
    model: nn.Module,
    batch: tuple[Tensor, Tensor],
    budget: int,
    config: PlannerBenchConfig,
    dev: torch.device,
    log: Callable[[str], None],
) -> PlannerBenchRow:
    b = int(batch[0].shape[0])
    timing = {"repeats": config.profile_repeats, "warmup": config.warmup}
    start = time.perf_counter()
    profile = profile_model(model, batch, device=dev, model_name=config.model, **timing)
    profile_s = time.perf_counter() - start
    start = time.perf_counter()
    plan0 = plan_for_model(model, batch, budget, device=dev, verify=False, profile=profile, refine=0, **timing)
    solve_s = time.perf_counter() - start
    start = time.perf_counter()
    plan = plan_for_model(
        model, batch, budget, device=dev, verify=False, profile=profile, refine=config.refine, **timing
    )
    refine_s = time.perf_counter() - start
    log(
        f"batch {b}: profiled in {profile_s:.0f} s; plan {len(plan.c_mode_blocks)}/{len(plan.modes)} "
        f"blocks in C-mode (refine=0: {len(plan0.c_mode_blocks)}), solved in {solve_s * 1e3:.0f} ms, "
        f"refined in {refine_s:.1f} s; measuring ..."
    )
    settings: dict[str, str | Mapping[str, str]] = {
        "baseline-M": "M", "baseline-C": "C", "plan": plan.modes, "plan (refine=0)": plan0.modes,
    }
    steps = measure_steps(model, batch, settings, device=dev, repeats=config.repeats, warmup=config.warmup)
    all_c = {n: "C" for n in plan.modes}
    m_step = steps["baseline-M"].step_time_s
    results = {
        "baseline-M": _setting("baseline-M", {n: "M" for n in plan.modes}, steps, profile, budget, None, m_step),
        "baseline-C": _setting("baseline-C", all_c, steps, profile, budget, None, m_step),
        "plan": _setting("plan", plan.modes, steps, profile, budget, plan, m_step),
        "plan (refine=0)": _setting("plan (refine=0)", plan0.modes, steps, profile, budget, plan0, m_step),
    }
    row = PlannerBenchRow(
        batch_size=b,
        budget_bytes=budget,
        n_blocks=len(plan.modes),
        settings=results,
        modes=dict(plan.modes),
        modes_refine0=dict(plan0.modes),
        profile=_profile_data(profile),
        profile_s=profile_s,
        solve_s=solve_s,
        refine_s=refine_s,
    )
    log(
        f"batch {b}: step M {m_step:.3f} s, C {results['baseline-C'].step_time_s:.3f} s, plan "
        f"{results['plan'].step_time_s:.3f} s (x{row.speedup:.2f} over M); peak plan "
        f"{format_bytes(results['plan'].peak_bytes)} of {format_bytes(budget)}"
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
    saved = sum(blk.t_e_s for blk in profile.blocks if blk.name in c and blk.t_e_s > 0)
    additive = profile.m_o_bytes + sum(blk.m_bytes for blk in profile.blocks if blk.name in c)
    m = steps[name]
    return SettingResult(
        name=name,
        c_blocks=len(c),
        step_time_s=m.step_time_s,
        step_time_iqr_s=_iqr(m.times_s),
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


# --- tables -------------------------------------------------------------------------------------


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


def _profile_data(profile: Profile) -> dict[str, Any]:
    import json

    return json.loads(profile.to_json())


def _rel(predicted: float, measured: float) -> float:
    return (predicted - measured) / measured if measured else math.nan


def _iqr(values: Sequence[float]) -> float:
    if len(values) < 2:
        return 0.0
    q = statistics.quantiles(values, n=4, method="inclusive")
    return q[2] - q[0]


def _paired(num: Sequence[float], den: Sequence[float]) -> tuple[float, float]:
    ratios = [a / b for a, b in zip(num, den)]
    return statistics.median(ratios), _iqr(ratios)


def _free(dev: torch.device) -> None:
    gc.collect()
    if dev.type == "cuda":
        torch.cuda.empty_cache()
