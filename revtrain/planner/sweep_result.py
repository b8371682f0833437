"""The result of a batch-size sweep: one :class:`SweepPoint` per batch size, plain data.

Made by :func:`revtrain.planner.sweep.sweep_batch_sizes`, drawn by :mod:`revtrain.planner.plots`,
written and read as JSON (kind ``revtrain.sweep``, :mod:`revtrain.planner.envelope`).
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from datetime import datetime, timezone

import torch

from revtrain.planner.envelope import dump_envelope, read_dataclass

__all__ = ["SweepPoint", "SweepResult"]


@dataclass(kw_only=True)
class SweepPoint:
    """Predictions (and measurements, where taken) at one batch size."""

    batch_size: int
    """The batch size."""
    feasible: bool
    """Whether some plan fits the budget (baseline-M's predicted peak does)."""
    modes: dict[str, str] | None
    """The plan's mode per block, by name; None when infeasible."""
    predicted_step_time_s: float | None
    """Predicted seconds per step of the plan; None when infeasible."""
    predicted_peak_bytes: int | None
    """Predicted peak of the plan; None when infeasible."""
    baseline_M_step_time_s: float
    """Predicted seconds per step of baseline-M (fitted)."""
    baseline_M_peak_bytes: int
    """Predicted peak of baseline-M (fitted)."""
    baseline_C_step_time_s: float
    """Predicted seconds per step of baseline-C: baseline-M minus every ``t_e``."""
    baseline_C_peak_bytes: int
    """Predicted peak of baseline-C."""
    baseline_C_fits: bool
    """Whether baseline-C's predicted peak fits the budget."""
    profiled: bool = False
    """Whether this batch size was profiled (its baselines were measured)."""
    measured_baseline_M_step_time_s: float | None = None
    """Measured seconds per step of baseline-M, at profiled sizes."""
    measured_baseline_M_peak_bytes: int | None = None
    """Measured peak of baseline-M, at profiled sizes."""
    measured_baseline_C_step_time_s: float | None = None
    """Measured seconds per step of baseline-C, at profiled sizes where it was run."""
    measured_baseline_C_peak_bytes: int | None = None
    """Measured peak of baseline-C, at profiled sizes where it was run."""
    measured_step_time_s: float | None = None
    """Measured seconds per step of the plan, where confirmed."""
    measured_peak_bytes: int | None = None
    """Measured peak of the plan, where confirmed."""
    measured_intervals: dict[str, list[float]] = field(default_factory=dict)
    """95% intervals ``[low, high]`` of the measured median steps, by ``"baseline-M"``,
    ``"baseline-C"``, ``"plan"`` where measured (:func:`revtrain.timing.median_interval`)."""
    planned: bool = False
    """Whether the plan here is the full pipeline's (this batch size profiled, solved and refined
    against measured peaks), as ``revtrain plan --batch-size`` makes it; otherwise the plan is
    solved from the fitted lines."""

    @property
    def predicted_time_per_sample_s(self) -> float | None:
        """Predicted seconds per sample of the plan (the inverse of throughput)."""
        if self.predicted_step_time_s is None:
            return None
        return self.predicted_step_time_s / self.batch_size

    @property
    def measured_time_per_sample_s(self) -> float | None:
        """Measured seconds per sample of the plan, where confirmed."""
        if self.measured_step_time_s is None:
            return None
        return self.measured_step_time_s / self.batch_size

    @property
    def confirmed(self) -> bool:
        """Whether the plan was measured at this batch size."""
        return self.measured_step_time_s is not None


@dataclass(kw_only=True)
class SweepResult:
    """The outcome of :func:`sweep_batch_sizes`: one :class:`SweepPoint` per batch size."""

    model: str
    """Model name."""
    device: str
    """Device measured on."""
    dtype: str
    """Parameter dtype."""
    budget_bytes: int
    """The budget every plan was solved for."""
    budget_source: str
    """How the budget was read, in words."""
    block_names: list[str]
    """Reversible blocks, in module order (the heat map's columns)."""
    profiled_batch_sizes: list[int]
    """Batch sizes that were profiled."""
    fits: dict[str, list[float]]
    """The fitted lines ``[a, k]`` (value ``a + k * batch_size``): ``"t_e/<block>"`` and
    ``"m/<block>"`` per block, ``"m_o"``, ``"step_M"``, and ``"peak_C"`` when baseline-C was measured
    at every profiled size."""
    points: list[SweepPoint]
    """One per batch size of the range, ascending."""
    best_batch_size: int | None
    """The batch size with the lowest time per sample: measured among confirmed plans that kept
    within the budget, else predicted; None when no batch size fits."""
    best_basis: str
    """``"measured"`` or ``"predicted"`` (how ``best_batch_size`` was chosen), ``"none"``."""
    torch_version: str = field(default_factory=lambda: str(torch.__version__))
    """``torch.__version__`` of the run."""
    timestamp: str = field(default_factory=lambda: datetime.now(timezone.utc).isoformat())
    """When the sweep ran, ISO 8601."""

    def __post_init__(self) -> None:
        self.points = [p if isinstance(p, SweepPoint) else SweepPoint(**p) for p in self.points]

    def point(self, batch_size: int) -> SweepPoint:
        """The point of one batch size; ``KeyError`` if it was not in the range."""
        for p in self.points:
            if p.batch_size == batch_size:
                return p
        raise KeyError(f"batch size {batch_size} is not in the sweep ({[p.batch_size for p in self.points]})")

    def to_json(self, path: str | os.PathLike[str] | None = None) -> str:
        """Serialise to JSON text (kind ``revtrain.sweep``); also write it to ``path`` when given."""
        return dump_envelope("sweep", dataclasses.asdict(self), path)

    @classmethod
    def from_json(cls, source: str | os.PathLike[str]) -> SweepResult:
        """Load from a file path, or from JSON text (a ``str`` starting with ``{``)."""
        return read_dataclass(cls, "sweep", source)
