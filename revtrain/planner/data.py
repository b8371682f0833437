"""The data the planner's stages exchange: a profile (stage 2's output) and a plan (stage 3's).

Both are plain data that round-trip through JSON (:mod:`revtrain.planner.envelope`). The knapsack
that turns one into the other (Jiang et al. 2021, §3.2-3.3, Problem 6) is in
:mod:`revtrain.planner.solve`; in its terms a block is an **item**, chosen means **C-mode**, its
**value** is ``t_e`` (seconds per step C-mode saves), its **weight** ``m`` (bytes C-mode keeps),
and the **capacity** is ``budget - m_o``.

Memory model for the batch size (§3.4): ``m_o`` is taken as linear in the batch size,
``m_o(b) = fixed_bytes + (m_o_bytes - fixed_bytes) * b / batch_size``; a profile that records
``fixed_bytes`` (what does not grow with the batch) lets errors say which batch size would fit.
"""

from __future__ import annotations

import dataclasses
import math
import os
import sys
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any

import torch

from revtrain.memory import format_bytes
from revtrain.planner.apply import apply_plan
from revtrain.planner.envelope import dump_envelope, read_dataclass

__all__ = ["BlockProfile", "LayerProfile", "Plan", "Profile"]

_MODES = ("M", "C")
_LAYER_OPTIONS = ("keep", "recompute", "offload")


@dataclass(kw_only=True)
class BlockProfile:
    """What profiling measured for one reversible block, at the profile's batch size."""

    name: str
    """Module name of the block, as in ``model.named_modules()``."""
    t_e_s: float
    """Extra seconds per step of M-mode over C-mode: ``(t_f1 + t_b1) - (t_f2 + t_b2)`` in the paper,
    close to one forward of the block. May be <= 0 from noise; such a block stays in M-mode."""
    m_bytes: int
    """Bytes that C-mode keeps alive at the peak beyond what M-mode keeps (the saved input)."""
    t_forward_s: float | None = None
    """Seconds of the block's forward (either mode); None when not measured."""
    t_backward_M_s: float | None = None
    """Seconds of the block's backward in M-mode, reconstruction included; None when not measured."""
    t_backward_C_s: float | None = None
    """Seconds of the block's backward in C-mode; None when not measured."""
    t_forward_C_s: float | None = None
    """Seconds of the block's forward in C-mode (``t_forward_s`` is then M-mode's); None when not
    measured."""
    m_hooks_bytes: int | None = None
    """``m`` as counted by saved-tensor hooks (unique storages saved for backward); None if not."""
    m_tracker_bytes: int | None = None
    """``m`` as counted by the memory tracker (bytes the forward left live); None if not.
    ``m_bytes`` is the larger of the two when both are measured."""
    t_e_iqr_s: float | None = None
    """Spread of ``t_e``: the interquartile range of the per-pair differences
    ``(t_f1 + t_b1) - (t_f2 + t_b2)`` it is the median of; None when not measured."""
    t_e_pairs: int | None = None
    """How many M/C pairs were timed for ``t_e`` (the stopping rule's count); None if unknown."""
    t_e_low_s: float | None = None
    """Low end of the 95% interval of the median per-pair difference
    (:func:`revtrain.timing.median_interval`); None when not measured."""
    t_e_high_s: float | None = None
    """High end of that interval; None when not measured."""

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"BlockProfile.name must be a non-empty module name, got {self.name!r}")
        for attr in ("t_e_low_s", "t_e_high_s"):
            if getattr(self, attr) is not None:
                setattr(self, attr, _finite(getattr(self, attr), f"block {self.name!r}: {attr}"))
        self.t_e_s = _finite(self.t_e_s, f"block {self.name!r}: t_e_s")
        self.m_bytes = _nonneg_int(self.m_bytes, f"block {self.name!r}: m_bytes")
        for attr in ("t_forward_s", "t_backward_M_s", "t_backward_C_s", "t_forward_C_s"):
            value = getattr(self, attr)
            if value is not None:
                setattr(self, attr, _nonneg_float(value, f"block {self.name!r}: {attr}"))
        if self.t_e_iqr_s is not None:
            self.t_e_iqr_s = _nonneg_float(self.t_e_iqr_s, f"block {self.name!r}: t_e_iqr_s")
        for attr in ("m_hooks_bytes", "m_tracker_bytes", "t_e_pairs"):
            value = getattr(self, attr)
            if value is not None:
                setattr(self, attr, _nonneg_int(value, f"block {self.name!r}: {attr}"))


@dataclass(kw_only=True)
class LayerProfile:
    """What profiling measured for one plain (non-reversible) layer: what recomputing it (and, on
    CUDA, offloading what it saves) costs in time and saves in bytes, against keeping, in the
    context of baseline-M (:mod:`revtrain.planner.recompute`)."""

    name: str
    """Module name of the layer (:func:`~revtrain.planner.recompute.plain_layers`)."""
    recompute_s: float
    """Extra seconds per step of recomputing over keeping: the median per-pair difference of the
    layer's forward plus backward, about one more forward; > 0."""
    recompute_saves_bytes: int
    """Bytes that recomputing frees at the end of the forward against keeping, in context."""
    recompute_low_s: float | None = None
    """Low end of the 95% interval of ``recompute_s``'s median; None when not measured."""
    recompute_high_s: float | None = None
    """High end of that interval; None when not measured."""
    offload_s: float | None = None
    """Extra seconds per step of offloading over keeping; None where not offered (CPU)."""
    offload_saves_bytes: int | None = None
    """Device bytes offloading frees against keeping; None where not offered."""
    offload_low_s: float | None = None
    """Low end of the 95% interval of ``offload_s``'s median; None when not measured."""
    offload_high_s: float | None = None
    """High end of that interval; None when not measured."""
    pairs: int | None = None
    """Timed rounds (each option once per round, order rotating)."""

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"LayerProfile.name must be a non-empty module name, got {self.name!r}")
        self.recompute_s = _nonneg_float(self.recompute_s, f"layer {self.name!r}: recompute_s")
        self.recompute_saves_bytes = _nonneg_int(self.recompute_saves_bytes, f"layer {self.name!r}: recompute_saves_bytes")
        for attr in ("recompute_low_s", "recompute_high_s", "offload_low_s", "offload_high_s"):
            if getattr(self, attr) is not None:
                setattr(self, attr, _finite(getattr(self, attr), f"layer {self.name!r}: {attr}"))
        if self.offload_s is not None:
            self.offload_s = _nonneg_float(self.offload_s, f"layer {self.name!r}: offload_s")
        for attr in ("offload_saves_bytes", "pairs"):
            if getattr(self, attr) is not None:
                setattr(self, attr, _nonneg_int(getattr(self, attr), f"layer {self.name!r}: {attr}"))

    def options(self) -> dict[str, tuple[float, int]]:
        """``option -> (seconds it costs, bytes it frees)`` against keeping, keep included."""
        out = {"keep": (0.0, 0), "recompute": (self.recompute_s, self.recompute_saves_bytes)}
        if self.offload_s is not None and self.offload_saves_bytes is not None:
            out["offload"] = (self.offload_s, self.offload_saves_bytes)
        return out


@dataclass(kw_only=True)
class Profile:
    """Stage 2's output: per-block costs and whole-model baselines, measured on one machine.

    Every figure holds for ``batch_size``, ``dtype`` and ``device``; a plan solved from it is only
    valid there.
    """

    model: str
    """Model name (registry name or a description)."""
    batch_size: int
    """Mini-batch size that was profiled."""
    input_shape: tuple[int, ...]
    """Shape of one input sample, without the batch dimension, e.g. ``(3, 32, 32)``."""
    dtype: str
    """Parameter and activation dtype, e.g. ``"float32"``."""
    device: str
    """Device the figures were measured on, e.g. ``"cuda:0 (NVIDIA H100)"`` or ``"cpu"``."""
    blocks: list[BlockProfile]
    """One entry per reversible block, in module order; names are unique."""
    m_o_bytes: int
    """Peak bytes of baseline-M (every block in M-mode): everything the plan cannot trade away."""
    step_time_M_s: float
    """Measured seconds per training step of baseline-M (forward, backward, optimizer)."""
    fixed_bytes: int | None = None
    """Part of ``m_o_bytes`` that does not grow with the batch size (parameters, gradients,
    optimizer state, workspaces); None when unknown. The rest is taken as proportional to it."""
    step_time_C_s: float | None = None
    """Measured seconds per step of baseline-C (every block in C-mode); None if not run (e.g. OOM)."""
    peak_M_bytes: int | None = None
    """Measured peak bytes of baseline-M, when measured apart from ``m_o_bytes``."""
    peak_C_bytes: int | None = None
    """Measured peak bytes of baseline-C; None if not run. The model predicts
    ``m_o_bytes + sum(m_bytes)``."""
    memory_method: str | None = None
    """How the peaks were counted (``"cuda-allocator"``, ``"cpu-dispatch"``); None if unknown."""
    optimizer: str | None = None
    """Class name of the optimizer whose state is inside ``m_o_bytes``; None if unknown."""
    t_e_scale: float | None = None
    """What a second of ``t_e`` saves in a whole step: ``(step_time_M_s - step_time_C_s) / sum(t_e)``,
    both whole steps measured in one interleaved run. ``t_e`` is timed per block in isolation,
    where C-mode's kept memory costs less than in a whole step; plans predict their step time as
    ``step_time_M_s - t_e_scale * sum(t_e over C-mode blocks)``, exact at both baselines. None
    (baseline-C not measured, or a profile from before it was recorded): 1, the paper's model.
    The knapsack's choices do not depend on it (all values scale alike)."""
    step_time_M_interval_s: list[float] | None = None
    """95% interval ``[low, high]`` of the median baseline-M step (:func:`revtrain.timing.median_interval`);
    None when not measured."""
    step_time_C_interval_s: list[float] | None = None
    """95% interval of the median baseline-C step; None when not measured."""
    layers: list[LayerProfile] = field(default_factory=list)
    """One entry per plain (non-reversible) layer that recomputing can shrink, in module order;
    empty for a profile of reversible layers only (Jiang et al.'s M/C choice, or a profile saved
    before plain layers were profiled)."""
    warnings: list[str] = field(default_factory=list)
    """What the profile's timings cannot be trusted for, in words (intervals too wide, a
    baseline-C timed slower than baseline-M); the report prints them."""
    torch_version: str = field(default_factory=lambda: str(torch.__version__))
    """``torch.__version__`` of the profiling run."""
    timestamp: str = field(default_factory=lambda: datetime.now(timezone.utc).isoformat())
    """When the profile was taken, ISO 8601."""

    def __post_init__(self) -> None:
        self.batch_size = _pos_int(self.batch_size, "Profile.batch_size")
        self.layers = [x if isinstance(x, LayerProfile) else LayerProfile(**x) for x in self.layers]
        for attr in ("step_time_M_interval_s", "step_time_C_interval_s"):
            setattr(self, attr, _interval(getattr(self, attr), f"Profile.{attr}"))
        self.warnings = [str(w) for w in self.warnings]
        self.input_shape = tuple(_pos_int(d, "Profile.input_shape entries") for d in self.input_shape)
        self.blocks = [b if isinstance(b, BlockProfile) else BlockProfile(**b) for b in self.blocks]
        names = [b.name for b in self.blocks]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise ValueError(f"Profile.blocks has duplicate block names: {dupes}")
        self.m_o_bytes = _nonneg_int(self.m_o_bytes, "Profile.m_o_bytes")
        self.step_time_M_s = _nonneg_float(self.step_time_M_s, "Profile.step_time_M_s")
        if self.fixed_bytes is not None:
            self.fixed_bytes = _nonneg_int(self.fixed_bytes, "Profile.fixed_bytes")
            if self.fixed_bytes > self.m_o_bytes:
                raise ValueError(
                    f"Profile.fixed_bytes ({self.fixed_bytes}) cannot exceed m_o_bytes "
                    f"({self.m_o_bytes}): it is the batch-independent part of it"
                )
        if self.step_time_C_s is not None:
            self.step_time_C_s = _nonneg_float(self.step_time_C_s, "Profile.step_time_C_s")
        for attr in ("peak_M_bytes", "peak_C_bytes"):
            if getattr(self, attr) is not None:
                setattr(self, attr, _nonneg_int(getattr(self, attr), f"Profile.{attr}"))
        if self.t_e_scale is not None:
            self.t_e_scale = _finite(self.t_e_scale, "Profile.t_e_scale")
            if self.t_e_scale <= 0:
                raise ValueError(
                    f"Profile.t_e_scale must be > 0, got {self.t_e_scale}: M-mode never saves time over "
                    "C-mode, so a scale <= 0 comes from noisy baselines; leave it None (the paper's model)"
                )

    def saved_time_s(self, c_mode_t_e_s: float) -> float:
        """Seconds per step that C-mode blocks whose ``t_e`` add up to ``c_mode_t_e_s`` save."""
        return c_mode_t_e_s * (1.0 if self.t_e_scale is None else self.t_e_scale)

    @property
    def floor_bytes(self) -> int:
        """The smallest predicted step memory any plan of this profile has: baseline-M's peak
        ``m_o`` less what recomputing (or offloading) every plain layer frees."""
        return self.m_o_bytes - sum(max(saves for _, saves in x.options().values()) for x in self.layers)

    def m_o_at(self, batch_size: int) -> int:
        """Baseline-M peak predicted at another batch size by the linear memory model.

        With ``fixed_bytes`` unknown the whole of ``m_o_bytes`` is taken as proportional to the
        batch size, which underestimates the peak of smaller batches.
        """
        b = _pos_int(batch_size, "batch_size")
        fixed = self.fixed_bytes or 0
        return fixed + -(-(self.m_o_bytes - fixed) * b // self.batch_size)  # ceil, in integers: exact at any size

    def max_batch_size(self, budget_bytes: int) -> int:
        """Largest batch size whose predicted baseline-M peak fits ``budget_bytes``.

        0 when none does; ``sys.maxsize`` when the model has no per-sample memory.

        An upper bound, not an estimate, when ``fixed_bytes`` is unknown (see :meth:`m_o_at`).
        """
        fixed = self.fixed_bytes or 0
        grows = self.m_o_bytes - fixed  # bytes that grow with the batch, at batch_size
        if budget_bytes < fixed:
            return 0
        if grows == 0:
            return sys.maxsize
        # m_o_at(b) <= budget  <=>  grows * b / batch_size <= budget - fixed (integers, no rounding)
        return (budget_bytes - fixed) * self.batch_size // grows

    def to_json(self, path: str | os.PathLike[str] | None = None) -> str:
        """Serialise to JSON text (kind ``revtrain.profile``); also write it to ``path`` when given."""
        return dump_envelope("profile", dataclasses.asdict(self), path)

    @classmethod
    def from_json(cls, source: str | os.PathLike[str]) -> Profile:
        """Load from a file path, or from JSON text (a ``str`` starting with ``{``)."""
        return read_dataclass(cls, "profile", source)


@dataclass(kw_only=True)
class Plan:
    """Stage 3's output: a mode per reversible block, plain data that round-trips through JSON."""

    modes: dict[str, str]
    """``"M"`` or ``"C"`` per reversible block, keyed by module name, in module order."""
    budget_bytes: int
    """Memory budget the plan was solved for."""
    granularity: int
    """Bytes per unit of the knapsack table (1: solved in exact bytes)."""
    predicted_step_time_s: float
    """Baseline-M step time minus what the C-mode blocks save: their ``t_e``, times the profile's
    ``t_e_scale`` when it has one."""
    predicted_peak_bytes: int
    """``m_o`` plus the ``m`` of the C-mode blocks; never above ``budget_bytes`` for a solved plan."""
    model: str = ""
    """Name of the model the plan was solved for, as in its profile."""
    batch_size: int | None = None
    """Batch size the plan was solved for; the plan holds only at this batch size."""
    input_shape: tuple[int, ...] | None = None
    """Shape of one sample the plan was solved for, as in its profile: ``(C, H, W)`` for images,
    ``(T,)`` (the sequence length) for token models. With the batch size it is the plan's
    workload: activation memory grows with both (attention with ``T²``). None in plans saved
    before it was recorded."""
    measured_step_time_s: float | None = None
    """Seconds per step measured when training with the plan; None until measured."""
    measured_peak_bytes: int | None = None
    """Peak bytes measured when training with the plan; None until measured."""
    budget_source: str = ""
    """How the budget was arrived at, in words (e.g. ``"50% of the total memory of cuda:0"``)."""
    measured_step_time_interval_s: list[float] | None = None
    """95% interval ``[low, high]`` of the measured median step; None until measured."""
    layers: dict[str, str] = field(default_factory=dict)
    """``"keep"``, ``"recompute"`` or ``"offload"`` per plain (non-reversible) layer, keyed by
    module name (:mod:`revtrain.planner.recompute`); layers not named keep. Empty in plans of
    reversible layers only, and in plans saved before plain layers had options."""
    recompute_cost_s: float = 0.0
    """Predicted seconds per step that the recomputed and offloaded layers cost (part of
    ``predicted_step_time_s``)."""

    def __post_init__(self) -> None:
        self.modes = dict(self.modes)
        bad = {name: mode for name, mode in self.modes.items() if mode not in _MODES}
        if bad:
            raise ValueError(f"Plan.modes must map block names to 'M' or 'C'; got {bad}")
        self.layers = dict(self.layers)
        bad = {name: opt for name, opt in self.layers.items() if opt not in _LAYER_OPTIONS}
        if bad:
            raise ValueError(f"Plan.layers must map layer names to one of {_LAYER_OPTIONS}; got {bad}")
        self.recompute_cost_s = _nonneg_float(self.recompute_cost_s, "Plan.recompute_cost_s")
        self.measured_step_time_interval_s = _interval(self.measured_step_time_interval_s, "Plan.measured_step_time_interval_s")
        self.budget_bytes = _nonneg_int(self.budget_bytes, "Plan.budget_bytes")
        self.granularity = _pos_int(self.granularity, "Plan.granularity")
        self.predicted_step_time_s = _finite(self.predicted_step_time_s, "Plan.predicted_step_time_s")
        self.predicted_peak_bytes = _nonneg_int(self.predicted_peak_bytes, "Plan.predicted_peak_bytes")
        if self.batch_size is not None:
            self.batch_size = _pos_int(self.batch_size, "Plan.batch_size")
        if self.input_shape is not None:
            self.input_shape = tuple(_pos_int(d, "Plan.input_shape entries") for d in self.input_shape)
        if self.measured_step_time_s is not None:
            self.measured_step_time_s = _nonneg_float(self.measured_step_time_s, "Plan.measured_step_time_s")
        if self.measured_peak_bytes is not None:
            self.measured_peak_bytes = _nonneg_int(self.measured_peak_bytes, "Plan.measured_peak_bytes")

    @property
    def c_mode_blocks(self) -> list[str]:
        """Names of the blocks the plan runs in C-mode, in module order."""
        return [name for name, mode in self.modes.items() if mode == "C"]

    def setting(self) -> dict[str, str]:
        """The plan as one setting for :func:`~revtrain.planner.measure.measure_steps`: block modes
        and plain-layer options by name."""
        return {**self.modes, **self.layers}

    @property
    def recomputed_layers(self) -> list[str]:
        """Names of the plain layers the plan recomputes or offloads, in module order."""
        return [name for name, opt in self.layers.items() if opt != "keep"]

    def workload_mismatch(self, batch_size: int, input_shape: tuple[int, ...]) -> str | None:
        """Why this plan does not hold for batches of ``batch_size`` samples of ``input_shape``
        (the batch size, or the sample shape, e.g. the sequence length, differs from the one it
        was solved for), in words; None when it holds or the plan does not say."""
        reasons = []
        if self.batch_size is not None and self.batch_size != batch_size:
            reasons.append(f"batch size {self.batch_size} (this run: {batch_size})")
        shape = tuple(input_shape)
        if self.input_shape is not None and tuple(self.input_shape) != shape:
            reasons.append(f"{describe_sample(self.input_shape)} (this run: {'x'.join(map(str, shape))})")
        if not reasons:
            return None
        return f"the plan was solved for {' and '.join(reasons)}"

    def summary(self) -> str:
        """One line for logs: blocks in C-mode, predicted peak against budget, predicted step
        time, and the measured step and peak next to them once measured."""
        line = (
            f"plan for {self.model or 'model'}: {len(self.c_mode_blocks)}/{len(self.modes)} blocks in "
            f"C-mode, predicted peak {format_bytes(self.predicted_peak_bytes)} of "
            f"{format_bytes(self.budget_bytes)} budget, predicted step {self.predicted_step_time_s:.4g} s"
        )
        changed = self.recomputed_layers
        if changed:
            shown = ", ".join(f"{n} ({self.layers[n]})" for n in changed[:4]) + (" ..." if len(changed) > 4 else "")
            line += f"; {len(changed)} plain layer(s) recomputed/offloaded: {shown}, costing {self.recompute_cost_s:.4g} s"
        if self.measured_step_time_s is not None and self.measured_step_time_s > 0:
            error = self.predicted_step_time_s / self.measured_step_time_s - 1
            line += f"; measured step {self.measured_step_time_s:.4g} s (prediction {error:+.1%})"
        if self.measured_peak_bytes is not None:
            line += f", measured peak {format_bytes(self.measured_peak_bytes)}"
        return line

    def apply(self, model: Any) -> Any:
        """Stage 4: set every reversible block of ``model`` to its planned mode; returns ``model``.

        Raises:
            PlanMismatchError: the plan's block names differ from the model's reversible blocks.
        """
        return apply_plan(self, model)

    def to_json(self, path: str | os.PathLike[str] | None = None) -> str:
        """Serialise to JSON text (kind ``revtrain.plan``); also write it to ``path`` when given."""
        return dump_envelope("plan", dataclasses.asdict(self), path)

    @classmethod
    def from_json(cls, source: str | os.PathLike[str]) -> Plan:
        """Load from a file path, or from JSON text (a ``str`` starting with ``{``)."""
        return read_dataclass(cls, "plan", source)


# --- small helpers ---------------------------------------------------------------------------


def _finite(x: Any, name: str) -> float:
    try:
        v = float(x)
    except (TypeError, ValueError):
        raise TypeError(f"{name} must be a number, got {x!r}") from None
    if not math.isfinite(v):
        raise ValueError(f"{name} must be finite, got {v}")
    return v


def _interval(x: Any, name: str) -> list[float] | None:
    if x is None:
        return None
    values = [_finite(v, name) for v in x]
    if len(values) != 2 or values[0] > values[1]:
        raise ValueError(f"{name} must be [low, high] with low <= high, got {x!r}")
    return values


def _nonneg_float(x: Any, name: str) -> float:
    v = _finite(x, name)
    if v < 0:
        raise ValueError(f"{name} must be >= 0, got {v}")
    return v


def _int(x: Any, name: str) -> int:
    if isinstance(x, bool) or not hasattr(x, "__index__"):
        raise TypeError(f"{name} must be an integer, got {x!r}")
    return int(x.__index__())


def _nonneg_int(x: Any, name: str) -> int:
    v = _int(x, name)
    if v < 0:
        raise ValueError(f"{name} must be >= 0, got {v}")
    return v


def _pos_int(x: Any, name: str) -> int:
    v = _int(x, name)
    if v < 1:
        raise ValueError(f"{name} must be >= 1, got {v}")
    return v


def describe_sample(shape: tuple[int, ...]) -> str:
    """One sample's shape in words: ``"sequence length 512"`` for a token sequence ``(T,)``,
    ``"samples of shape 3x32x32"`` otherwise."""
    if len(shape) == 1:
        return f"sequence length {shape[0]}"
    return f"samples of shape {'x'.join(map(str, shape))}"
