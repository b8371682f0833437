"""Choose the batch size too: sweep it with costs linear in the batch size (Jiang et al. 2021, §3.4).

Problem 8 of the paper (modes and batch size together) is solved the way the paper suggests: by
sweeping the batch size. :func:`sweep_batch_sizes`

1. profiles a few batch sizes of the range (three by default: smallest, middle, largest);
2. fits, by least squares, every per-block ``t_e`` and ``m``, the baseline-M peak ``m_o``, the
   baseline-M step time and (where measured) the baseline-C peak as lines ``a + k * b`` in the batch
   size ``b``. Memory lines are then raised by their largest shortfall at the profiled sizes, so
   they never predict less than was measured there;
3. solves the knapsack at every batch size of the range from the fitted costs, predicting step
   time, time per sample and peak for the plan and both baselines;
4. measures the plans of the best few batch sizes (by predicted time per sample) and picks the best
   measured one that kept within the budget.

The result is plain data that serialises to JSON; :mod:`revtrain.planner.plots` draws it.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from revtrain.core import verify_invertible
from revtrain.planner.budget import resolve_budget
from revtrain.planner.measure import (
    LossFn,
    OptimizerFactory,
    batch_size_of,
    batch_to,
    measure_step,
    resolve_device,
)
from revtrain.planner.plan import BlockProfile, BudgetTooSmallError, Profile, make_plan
from revtrain.planner.profile import profile_model

__all__ = ["SweepPoint", "SweepResult", "parse_batch_sizes", "resize_batch", "sweep_batch_sizes"]

_FORMAT = "revtrain.sweep"
_VERSION = 1

BatchFactory = Callable[[int], tuple[Any, Tensor]]
"""``make_batch(batch_size) -> (inputs, targets)``."""


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
        """Serialise to JSON text; also write it to ``path`` when given."""
        data = {"format": _FORMAT, "version": _VERSION, **dataclasses.asdict(self)}
        text = json.dumps(data, indent=2, allow_nan=False) + "\n"
        if path is not None:
            Path(path).write_text(text)
        return text

    @classmethod
    def from_json(cls, source: str | os.PathLike[str]) -> SweepResult:
        """Load from a file path, or from JSON text (a ``str`` starting with ``{``)."""
        if isinstance(source, str) and source.lstrip().startswith("{"):
            where, text = "JSON text", source
        else:
            where, text = f"file {os.fspath(source)!r}", Path(source).read_text()
        data = json.loads(text)
        if not isinstance(data, dict) or data.pop("format", None) != _FORMAT:
            raise ValueError(f"{where} is not a revtrain sweep result (format {_FORMAT!r} expected)")
        version = data.pop("version", None)
        if version != _VERSION:
            raise ValueError(f"{where} has sweep format version {version!r}; this revtrain reads {_VERSION}")
        return cls(**data)


def parse_batch_sizes(text: str) -> list[int]:
    """Batch sizes from ``"32,64,128"`` or a range ``"32:256:32"`` (start:stop:step, stop included).

    Raises:
        ValueError: not positive integers, or an empty range.
    """
    try:
        if ":" in text:
            parts = [int(p) for p in text.split(":")]
            if len(parts) not in (2, 3):
                raise ValueError
            start, stop = parts[0], parts[1]
            step = parts[2] if len(parts) == 3 else 1
            if step < 1:
                raise ValueError
            sizes = list(range(start, stop + 1, step))
        else:
            sizes = [int(p) for p in text.split(",") if p.strip()]
    except ValueError:
        raise ValueError(
            f"cannot read batch sizes from {text!r}: give a list '32,64,128' or a range "
            "'32:256:32' (start:stop:step, stop included)"
        ) from None
    if not sizes or min(sizes) < 1:
        raise ValueError(f"batch sizes must be positive integers, got {text!r}")
    return sorted(set(sizes))


def resize_batch(batch: tuple[Any, Tensor], batch_size: int) -> tuple[Any, Tensor]:
    """The example batch repeated (or cut) along dim 0 to ``batch_size`` samples."""

    def resize(t: Any) -> Any:
        if not isinstance(t, Tensor):
            return t
        reps = -(-batch_size // t.shape[0])
        return t.repeat(reps, *([1] * (t.dim() - 1)))[:batch_size].contiguous()

    inputs, targets = batch
    inputs = tuple(resize(x) for x in inputs) if isinstance(inputs, (tuple, list)) else resize(inputs)
    return inputs, resize(targets)


def sweep_batch_sizes(
    model: nn.Module,
    batches: tuple[Any, Tensor] | BatchFactory,
    batch_sizes: Sequence[int],
    budget: int | str | None = None,
    *,
    profile_sizes: Sequence[int] | None = None,
    confirm: int = 2,
    loss_fn: LossFn = F.cross_entropy,
    make_optimizer: OptimizerFactory | None = None,
    device: torch.device | str | None = None,
    repeats: int = 3,
    warmup: int = 2,
    verify: bool = True,
    model_name: str | None = None,
) -> SweepResult:
    """Plan at every batch size of a range and find the one with the best throughput (§3.4).

    Args:
        model: A model with reversible blocks; moved to ``device``, otherwise left as it was.
        batches: An example ``(inputs, targets)`` batch, repeated or cut to each size
            (:func:`resize_batch`), or a function ``batch_size -> (inputs, targets)``.
        batch_sizes: The candidate batch sizes.
        budget: As :func:`~revtrain.planner.plan_for_model`.
        profile_sizes: Batch sizes to profile; default the smallest, the middle and the largest
            candidate (all of them when there are at most three).
        confirm: How many of the best predicted batch sizes to measure with their plan.
        loss_fn, make_optimizer, device, repeats, warmup, verify, model_name: As
            :func:`~revtrain.planner.plan_for_model`.

    Raises:
        ValueError: an empty range, or a malformed budget.
    """
    sizes = sorted({int(b) for b in batch_sizes})
    if not sizes or sizes[0] < 1:
        raise ValueError(f"batch sizes must be a non-empty list of positive integers, got {batch_sizes}")
    if profile_sizes is None:
        profile_sizes = sizes if len(sizes) <= 3 else [sizes[0], sizes[len(sizes) // 2], sizes[-1]]
    profile_sizes = sorted({int(b) for b in profile_sizes})
    dev = resolve_device(model, device)
    model.to(dev)
    budget_bytes, explanation = resolve_budget(budget, dev)
    make_batch: BatchFactory = batches if callable(batches) else (lambda b: resize_batch(batches, b))

    def batch_of(b: int) -> tuple[Any, Tensor]:
        got = batch_to(make_batch(b), dev)
        if batch_size_of(got) != b:
            raise ValueError(f"the batch factory returned {batch_size_of(got)} samples for batch size {b}")
        return got

    if verify:
        verify_invertible(model, batch_of(profile_sizes[0])[0])
    common = dict(loss_fn=loss_fn, make_optimizer=make_optimizer, device=dev, repeats=repeats, warmup=warmup)
    profiles: list[Profile] = []
    for b in profile_sizes:
        try:
            profiles.append(profile_model(model, batch_of(b), model_name=model_name, **common))
        except torch.cuda.OutOfMemoryError:
            torch.cuda.empty_cache()  # too big for the device even in baseline-M: fit without it
    if not profiles:
        raise RuntimeError(
            f"no batch size of {profile_sizes} could be profiled: each ran out of device memory; "
            "sweep smaller batch sizes"
        )
    fits = _fit(profiles)
    names = [b.name for b in profiles[0].blocks]
    by_size = {p.batch_size: p for p in profiles}
    points = [_predict(fits, names, profiles[0], b, budget_bytes, by_size.get(b)) for b in sizes]

    ranked = sorted((p for p in points if p.feasible), key=lambda p: p.predicted_time_per_sample_s or math.inf)
    for p in ranked[: max(0, confirm)]:
        assert p.modes is not None
        try:
            p.measured_step_time_s, p.measured_peak_bytes = measure_step(
                model, batch_of(p.batch_size), modes=p.modes, **common
            )
        except torch.cuda.OutOfMemoryError:
            torch.cuda.empty_cache()
    kept = [p for p in points if p.confirmed and (p.measured_peak_bytes or 0) <= budget_bytes]
    if kept:
        best = min(kept, key=lambda p: p.measured_time_per_sample_s or math.inf)
        best_size, basis = best.batch_size, "measured"
    elif ranked:
        best_size, basis = ranked[0].batch_size, "predicted"
    else:
        best_size, basis = None, "none"
    first = profiles[0]
    return SweepResult(
        model=first.model,
        device=first.device,
        dtype=first.dtype,
        budget_bytes=budget_bytes,
        budget_source=explanation,
        block_names=names,
        profiled_batch_sizes=[p.batch_size for p in profiles],
        fits={k: [float(a), float(s)] for k, (a, s) in fits.items()},
        points=points,
        best_batch_size=best_size,
        best_basis=basis,
    )


# --- fitting and prediction -------------------------------------------------------------------


def _line(xs: Sequence[float], ys: Sequence[float], *, upper: bool, through: float = 0.0) -> tuple[float, float]:
    """Least-squares line ``a + k x``; from one point, the line through ``(0, through)``.

    ``upper`` raises the line by its largest shortfall at the data, so it never predicts less
    than was measured there.
    """
    x = np.asarray(xs, dtype=np.float64)
    y = np.asarray(ys, dtype=np.float64)
    if len(set(xs)) >= 2:
        k, a = np.polyfit(x, y, 1)
    else:
        a = through
        k = (float(y.mean()) - a) / float(x[0])
    if upper:
        a += max(0.0, float(np.max(y - (a + k * x))))
    return float(a), float(k)


def _fit(profiles: list[Profile]) -> dict[str, tuple[float, float]]:
    bs = [p.batch_size for p in profiles]
    fits: dict[str, tuple[float, float]] = {}
    for i, block in enumerate(profiles[0].blocks):
        fits[f"t_e/{block.name}"] = _line(bs, [p.blocks[i].t_e_s for p in profiles], upper=False)
        fits[f"m/{block.name}"] = _line(bs, [p.blocks[i].m_bytes for p in profiles], upper=True)
    fixed = min(p.fixed_bytes or 0 for p in profiles)
    fits["m_o"] = _line(bs, [p.m_o_bytes for p in profiles], upper=True, through=fixed)
    fits["step_M"] = _line(bs, [p.step_time_M_s for p in profiles], upper=False)
    if all(p.peak_C_bytes is not None for p in profiles):
        fits["peak_C"] = _line(bs, [p.peak_C_bytes or 0 for p in profiles], upper=True, through=fixed)
    return fits


def _at(fit: tuple[float, float], b: int) -> float:
    return fit[0] + fit[1] * b


def _predict(
    fits: dict[str, tuple[float, float]],
    names: list[str],
    template: Profile,
    b: int,
    budget: int,
    measured: Profile | None,
) -> SweepPoint:
    blocks = [
        BlockProfile(
            name=n,
            t_e_s=_at(fits[f"t_e/{n}"], b),
            m_bytes=max(0, math.ceil(_at(fits[f"m/{n}"], b))),
        )
        for n in names
    ]
    m_o = max(0, math.ceil(_at(fits["m_o"], b)))
    step_m = max(0.0, _at(fits["step_M"], b))
    peak_c_model = m_o + sum(x.m_bytes for x in blocks)
    peak_c_fit = max(m_o, math.ceil(_at(fits["peak_C"], b))) if "peak_C" in fits else None
    profile = Profile(
        model=template.model,
        batch_size=b,
        input_shape=template.input_shape,
        dtype=template.dtype,
        device=template.device,
        blocks=blocks,
        m_o_bytes=m_o,
        fixed_bytes=min(template.fixed_bytes or 0, m_o),
        step_time_M_s=step_m,
        peak_C_bytes=peak_c_fit,
    )
    peak_c = peak_c_model if peak_c_fit is None else min(peak_c_model, peak_c_fit)
    point = SweepPoint(
        batch_size=b,
        feasible=False,
        modes=None,
        predicted_step_time_s=None,
        predicted_peak_bytes=None,
        baseline_M_step_time_s=step_m,
        baseline_M_peak_bytes=m_o,
        baseline_C_step_time_s=max(0.0, step_m - sum(x.t_e_s for x in blocks)),
        baseline_C_peak_bytes=peak_c,
        baseline_C_fits=peak_c <= budget,
    )
    try:
        plan = make_plan(profile, budget, use_measured_baseline_c=True)
    except BudgetTooSmallError:
        pass
    else:
        point.feasible = True
        point.modes = plan.modes
        point.predicted_step_time_s = max(0.0, plan.predicted_step_time_s)
        point.predicted_peak_bytes = plan.predicted_peak_bytes
    if measured is not None:
        point.profiled = True
        point.measured_baseline_M_step_time_s = measured.step_time_M_s
        point.measured_baseline_M_peak_bytes = measured.m_o_bytes
        point.measured_baseline_C_step_time_s = measured.step_time_C_s
        point.measured_baseline_C_peak_bytes = measured.peak_C_bytes
    return point
