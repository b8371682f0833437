"""What the planner benchmark is asked (:class:`PlannerBenchConfig`) and what it records.

Rows and results are plain data with ``to_dict`` / ``from_dict``, so a results file can be read
back (``PlannerBenchResult.from_dict``).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field, fields
from typing import Any, Literal

from revtrain.device import float_dtype, resolve_device
from revtrain.planner import TimingRule
from revtrain.planner.budget import check_budget
from revtrain.timing import iqr

__all__ = ["SETTINGS", "PlannerBenchConfig", "PlannerBenchResult", "PlannerBenchRow", "SettingResult"]

SETTINGS: tuple[str, ...] = ("baseline-M", "baseline-C", "plan", "plan (refine=0)")
"""The settings measured at every batch size, in table order."""


@dataclass(kw_only=True)
class PlannerBenchConfig:
    """What to plan and measure, and how often."""

    model: str = "revnet110"
    """Zoo model name (``revtrain models``): any model with reversible layers (RevNet or Transformer
    coupling blocks, In-place ABN layers)."""
    model_options: tuple[str, ...] = ()
    """Keyword overrides of the model's builder as key=value, e.g. depth=12 width=128 for a Transformer
    (values read as int, float, true/false, else text)."""
    batch_sizes: tuple[int, ...] = (8, 16, 32, 64)
    """Batch sizes to plan and measure, ascending."""
    budget: str | None = None
    """Step memory allowed at every batch size: bytes, 120MiB, a fraction 50% of the device's memory
    (see revtrain.planner.resolve_budget); default automatic (see budget_margin)."""
    budget_margin: float = 1.2
    """Without --budget: the budget is this factor times the larger of baseline-C's peak at the
    smallest batch size and baseline-M's peak at the largest, rounded up to a MiB."""
    device: str = "auto"
    """auto (CUDA when available), cpu, cuda or cuda:N."""
    dtype: Literal["float32", "float64", "bfloat16", "float16"] = "float32"
    """Parameter dtype (and input dtype of image models)."""
    input_shape: tuple[int, ...] | None = None
    """One sample's shape: C H W for images, e.g. 3 32 32, or the sequence length T for a token model,
    e.g. 256 (the model is built with that context); default the model's."""
    num_classes: int | None = None
    """Classifier outputs, or the vocabulary of a token model; default the model's."""
    repeats: int = 5
    """Timed steps per setting in the final, interleaved measurement (medians are reported)."""
    warmup: int = 2
    """Untimed steps per setting before each measurement."""
    profile_repeats: int = 3
    """Timed steps of each whole-step measurement while profiling and planning."""
    refine: int = 4
    """plan_for_model(refine=...) of the plan; 'plan (refine=0)' is always solved too."""
    t_e_precision: float = 0.05
    """Time each block's M/C pairs until the standard error of its median t_e is this fraction of it."""
    t_e_max_pairs: int = 30
    """At most this many M/C pairs per block."""
    threads: int | None = 1
    """CPU intra-op threads during the run, restored afterwards. One by default: on a shared 2-core
    machine two threads spin-wait for each other and timings become unusable under any load."""
    seed: int = 0
    """Seed of the model's weights and of the example batches."""

    def __post_init__(self) -> None:
        self.batch_sizes = tuple(sorted({int(b) for b in self.batch_sizes}))
        if not self.batch_sizes or self.batch_sizes[0] < 1:
            raise ValueError(f"batch_sizes must be positive integers, got {self.batch_sizes}")
        float_dtype(self.dtype)
        check_budget(self.budget)
        resolve_device(self.device)
        self.timing_rule()
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
        from revtrain.models import model_info

        spec = model_info(self.model).inputs  # an unknown model fails here, with close matches
        if self.input_shape is not None and (len(self.input_shape) != len(spec.shape) or min(self.input_shape) < 1):
            raise ValueError(
                f"input_shape for {self.model} ({spec.kind} inputs of shape {' '.join(map(str, spec.shape))}) "
                f"must be {len(spec.shape)} positive number(s), got {' '.join(map(str, self.input_shape))}"
            )
        self.model_options = tuple(self.model_options)
        self.model_overrides()

    def model_overrides(self) -> dict[str, Any]:
        """``model_options`` as keyword arguments of ``create_model``."""
        out: dict[str, Any] = {}
        for item in self.model_options:
            key, sep, text = str(item).partition("=")
            if not sep or not key.isidentifier():
                raise ValueError(f"model_options must be key=value like depth=12, got {item!r}")
            out[key] = _option_value(text)
        return out

    def timing_rule(self) -> TimingRule:
        """How each block's ``t_e`` is timed while profiling."""
        return TimingRule.with_cap(self.t_e_precision, self.t_e_max_pairs)

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
    """Measured step memory (:mod:`revtrain.planner.measure`)."""
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
    """The profile's fields (:class:`revtrain.planner.Profile` as a dict)."""
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
    layer_kinds: dict[str, int] = field(default_factory=dict)
    """Reversible layers by class name, e.g. ``{"InPlaceABN": 28}``."""
    input_kind: str = "image"
    """``"image"`` or ``"tokens"`` (the model's :class:`~revtrain.models.InputSpec` kind)."""

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> PlannerBenchResult:
        """Inverse of :meth:`to_dict`: re-render a results file's tables without measuring again."""
        names = {f.name for f in fields(cls)}
        kwargs = {k: v for k, v in data.items() if k in names}
        config = dict(data["config"])
        config["batch_sizes"] = tuple(config["batch_sizes"])
        config["model_options"] = tuple(config.get("model_options", ()))  # results from before the field
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
            "layer_kinds": self.layer_kinds,
            "input_kind": self.input_kind,
            "rows": [r.to_dict() for r in self.rows],
        }


def _option_value(text: str) -> Any:
    """``"12"`` -> 12, ``"0.1"`` -> 0.1, ``"true"`` -> True, anything else stays text."""
    if text.lower() in ("true", "false"):
        return text.lower() == "true"
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def _rel(predicted: float, measured: float) -> float:
    return (predicted - measured) / measured if measured else math.nan


def _paired(num: Sequence[float], den: Sequence[float]) -> tuple[float, float]:
    """Median and IQR over rounds of the per-round ratio ``num / den``."""
    ratios = [a / b for a, b in zip(num, den)]
    return statistics.median(ratios), iqr(ratios)
