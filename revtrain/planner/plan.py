"""The planner's data: what profiling measured, and the plan solved from it.

Interpretation of the knapsack (Jiang et al. 2021, §3.2–3.3, Problem 6). Take baseline-M
(every reversible block in M-mode) as the reference. Then

* an **item** is a reversible block, and an item **chosen** is a block run in **C-mode**;
* its **value** is ``t_e``, the time per step that C-mode saves (M-mode rebuilds the block's input
  in backward; C-mode keeps it);
* its **weight** is ``m``, the bytes C-mode keeps beyond M-mode;
* the **capacity** is ``budget - m_o``, where ``m_o`` is the peak of baseline-M (parameters,
  gradients, optimizer state, non-reversible activations, the backward's transients).

So the solver maximises the time saved over baseline-M while the predicted peak
``m_o + sum(m over C-mode blocks)`` stays within the budget, in exact bytes. The predicted step time
is ``baseline-M step time - sum(t_e over C-mode blocks)``.

Memory model for the batch size (§3.4): ``m_o`` is taken as linear in the batch size,
``m_o(b) = fixed_bytes + (m_o_bytes - fixed_bytes) * b / batch_size``; a profile that records
``fixed_bytes`` (what does not grow with the batch) lets errors say which batch size would fit.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import sys
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, TypeVar

import torch

from revtrain.errors import RevtrainError
from revtrain.memory import format_bytes, parse_bytes
from revtrain.planner.knapsack import solve_knapsack

__all__ = [
    "BlockProfile",
    "BudgetTooSmallError",
    "Plan",
    "PlanMismatchError",
    "Profile",
    "make_plan",
]

_FORMAT_VERSION = 1
_MODES = ("M", "C")


class BudgetTooSmallError(RevtrainError, ValueError):
    """The memory budget is below the baseline-M peak: no plan can meet it."""

    def __init__(
        self,
        message: str,
        *,
        budget_bytes: int,
        required_bytes: int,
        batch_size: int,
        max_batch_size: int,
    ) -> None:
        super().__init__(message)
        self.budget_bytes = budget_bytes
        """The budget that was asked for."""
        self.required_bytes = required_bytes
        """The smallest budget that works at this batch size (the baseline-M peak)."""
        self.batch_size = batch_size
        """The profiled batch size."""
        self.max_batch_size = max_batch_size
        """Estimated largest batch size whose baseline-M peak fits the budget (0: none does)."""


class PlanMismatchError(RevtrainError, ValueError):
    """A plan names blocks that the model does not have, or misses some it has."""


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

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"BlockProfile.name must be a non-empty module name, got {self.name!r}")
        self.t_e_s = _finite(self.t_e_s, f"block {self.name!r}: t_e_s")
        self.m_bytes = _nonneg_int(self.m_bytes, f"block {self.name!r}: m_bytes")
        for attr in ("t_forward_s", "t_backward_M_s", "t_backward_C_s", "t_forward_C_s"):
            value = getattr(self, attr)
            if value is not None:
                setattr(self, attr, _nonneg_float(value, f"block {self.name!r}: {attr}"))
        for attr in ("m_hooks_bytes", "m_tracker_bytes"):
            value = getattr(self, attr)
            if value is not None:
                setattr(self, attr, _nonneg_int(value, f"block {self.name!r}: {attr}"))


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
    torch_version: str = field(default_factory=lambda: str(torch.__version__))
    """``torch.__version__`` of the profiling run."""
    timestamp: str = field(default_factory=lambda: datetime.now(timezone.utc).isoformat())
    """When the profile was taken, ISO 8601."""

    def __post_init__(self) -> None:
        self.batch_size = _pos_int(self.batch_size, "Profile.batch_size")
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

    def m_o_at(self, batch_size: int) -> int:
        """Baseline-M peak predicted at another batch size by the linear memory model.

        With ``fixed_bytes`` unknown the whole of ``m_o_bytes`` is taken as proportional to the
        batch size, which underestimates the peak of smaller batches.
        """
        b = _pos_int(batch_size, "batch_size")
        fixed = self.fixed_bytes or 0
        return fixed + math.ceil((self.m_o_bytes - fixed) * b / self.batch_size)

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
        """Serialise to JSON text; also write it to ``path`` when given."""
        return _dump(self, "profile", path)

    @classmethod
    def from_json(cls, source: str | os.PathLike[str]) -> Profile:
        """Load from a file path, or from JSON text (a ``str`` starting with ``{``)."""
        return _load(cls, "profile", source)


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
    """Baseline-M step time minus the ``t_e`` of the C-mode blocks."""
    predicted_peak_bytes: int
    """``m_o`` plus the ``m`` of the C-mode blocks; never above ``budget_bytes`` for a solved plan."""
    model: str = ""
    """Name of the model the plan was solved for, as in its profile."""
    batch_size: int | None = None
    """Batch size the plan was solved for; the plan holds only at this batch size."""
    measured_step_time_s: float | None = None
    """Seconds per step measured when training with the plan; None until measured."""
    measured_peak_bytes: int | None = None
    """Peak bytes measured when training with the plan; None until measured."""
    budget_source: str = ""
    """How the budget was arrived at, in words (e.g. ``"50% of the total memory of cuda:0"``)."""

    def __post_init__(self) -> None:
        self.modes = dict(self.modes)
        bad = {name: mode for name, mode in self.modes.items() if mode not in _MODES}
        if bad:
            raise ValueError(f"Plan.modes must map block names to 'M' or 'C'; got {bad}")
        self.budget_bytes = _nonneg_int(self.budget_bytes, "Plan.budget_bytes")
        self.granularity = _pos_int(self.granularity, "Plan.granularity")
        self.predicted_step_time_s = _finite(self.predicted_step_time_s, "Plan.predicted_step_time_s")
        self.predicted_peak_bytes = _nonneg_int(self.predicted_peak_bytes, "Plan.predicted_peak_bytes")
        if self.batch_size is not None:
            self.batch_size = _pos_int(self.batch_size, "Plan.batch_size")
        if self.measured_step_time_s is not None:
            self.measured_step_time_s = _nonneg_float(self.measured_step_time_s, "Plan.measured_step_time_s")
        if self.measured_peak_bytes is not None:
            self.measured_peak_bytes = _nonneg_int(self.measured_peak_bytes, "Plan.measured_peak_bytes")

    @property
    def c_mode_blocks(self) -> list[str]:
        """Names of the blocks the plan runs in C-mode, in module order."""
        return [name for name, mode in self.modes.items() if mode == "C"]

    def summary(self) -> str:
        """One line for logs: blocks in C-mode, predicted peak against budget, predicted step time."""
        return (
            f"plan for {self.model or 'model'}: {len(self.c_mode_blocks)}/{len(self.modes)} blocks in "
            f"C-mode, predicted peak {format_bytes(self.predicted_peak_bytes)} of "
            f"{format_bytes(self.budget_bytes)} budget, predicted step {self.predicted_step_time_s:.4g} s"
        )

    def apply(self, model: Any) -> Any:
        """Set every reversible block of ``model`` to its planned mode; returns ``model``.

        Raises:
            PlanMismatchError: if the plan's block names differ from the model's reversible blocks.
        """
        from revtrain.core import reversible_blocks, set_modes  # core imports torch; keep it lazy

        names = [name for name, _ in reversible_blocks(model)]
        in_model = set(names)
        missing = [name for name in self.modes if name not in in_model]
        extra = [name for name in names if name not in self.modes]
        if missing or extra:
            parts = []
            if missing:
                parts.append(f"{len(missing)} block(s) in the plan are not in the model: {_few(missing)}")
            if extra:
                parts.append(
                    f"{len(extra)} reversible block(s) of the model are not in the plan: {_few(extra)}"
                )
            origin = ""
            if self.model:
                at = f" at batch size {self.batch_size}" if self.batch_size else ""
                origin = f" (it was made for {self.model!r}{at})"
            raise PlanMismatchError(
                "plan does not match the model: " + "; ".join(parts) + ". The plan was probably "
                f"made for another model{origin}; profile and plan this model again."
            )
        set_modes(model, dict(self.modes))
        return model

    def to_json(self, path: str | os.PathLike[str] | None = None) -> str:
        """Serialise to JSON text; also write it to ``path`` when given."""
        return _dump(self, "plan", path)

    @classmethod
    def from_json(cls, source: str | os.PathLike[str]) -> Plan:
        """Load from a file path, or from JSON text (a ``str`` starting with ``{``)."""
        return _load(cls, "plan", source)


def make_plan(
    profile: Profile,
    budget_bytes: int | str,
    *,
    granularity: int | None = None,
    use_measured_baseline_c: bool = False,
) -> Plan:
    """Solve for the fastest mode per block whose predicted peak fits ``budget_bytes``.

    Chooses the C-mode blocks by :func:`~revtrain.planner.solve_knapsack` with value ``t_e``,
    weight ``m`` and capacity ``budget_bytes - m_o`` (see the module docstring).

    Args:
        profile: Measurements at one batch size.
        budget_bytes: Memory the training step may use at its peak: bytes, or a size such as
            ``"6GiB"`` (see :func:`revtrain.memory.parse_bytes`).
        granularity: Passed to :func:`~revtrain.planner.solve_knapsack`; None picks it.
        use_measured_baseline_c: When the profile's *measured* baseline-C peak
            (``peak_C_bytes``) fits the budget, run every block that C-mode speeds up in C-mode,
            with predicted peak ``min(m_o + sum(m), peak_C_bytes)``. ``m_o + sum(m)`` adds each
            block's bytes as if all were live at baseline-M's peak moment, which overestimates
            when they are not (measured: baseline-C's real peak is often well below it); the
            measured baseline-C peak is the tighter bound, on the assumption that moving a
            block from C-mode to M-mode never raises the peak.

    Raises:
        BudgetTooSmallError: if the budget is below the baseline-M peak ``m_o``.
    """
    if isinstance(budget_bytes, str):
        budget = parse_bytes(budget_bytes)
    else:
        budget = _nonneg_int(budget_bytes, "budget_bytes")
    capacity = budget - profile.m_o_bytes
    if capacity < 0:
        raise _budget_too_small(profile, budget)
    measured_c = profile.peak_C_bytes
    if use_measured_baseline_c and measured_c is not None and profile.m_o_bytes <= measured_c <= budget:
        capacity = max(capacity, sum(b.m_bytes for b in profile.blocks))  # every useful block fits
    else:
        measured_c = None
    sol = solve_knapsack(
        [b.t_e_s for b in profile.blocks],
        [b.m_bytes for b in profile.blocks],
        capacity,
        granularity=granularity,
    )
    chosen = set(sol.chosen)
    peak = profile.m_o_bytes + sol.total_weight
    if measured_c is not None:
        peak = min(peak, measured_c)
    return Plan(
        modes={b.name: ("C" if i in chosen else "M") for i, b in enumerate(profile.blocks)},
        budget_bytes=budget,
        granularity=sol.granularity,
        predicted_step_time_s=profile.step_time_M_s - sol.total_value,
        predicted_peak_bytes=peak,
        model=profile.model,
        batch_size=profile.batch_size,
    )


def _budget_too_small(profile: Profile, budget: int) -> BudgetTooSmallError:
    need = profile.m_o_bytes
    b_max = profile.max_batch_size(budget)
    msg = (
        f"budget {format_bytes(budget)} is below the {format_bytes(need)} that even all-M-mode "
        f"needs (baseline-M peak of {profile.model!r} at batch size {profile.batch_size}); raise "
        f"the budget to at least {format_bytes(need)} ({need} bytes) or reduce the batch size"
    )
    if profile.fixed_bytes is None:
        how = (
            "assuming all of the baseline-M peak grows with the batch size; record the profile's "
            "fixed_bytes for an estimate"
        )
        fits = f"the largest batch size that fits is at most {b_max}"
    else:
        per_sample = (profile.m_o_bytes - profile.fixed_bytes) / profile.batch_size
        how = (
            f"memory taken as linear in the batch size: {format_bytes(profile.fixed_bytes)} "
            f"fixed + {format_bytes(round(per_sample))} per sample"
        )
        fits = f"the largest batch size that fits is about {b_max}"
    if b_max < 1:
        fits = "not even batch size 1 fits"
    msg += f"; at this budget {fits} ({how})"
    return BudgetTooSmallError(
        msg, budget_bytes=budget, required_bytes=need, batch_size=profile.batch_size, max_batch_size=b_max
    )


# --- JSON ------------------------------------------------------------------------------------

_T = TypeVar("_T", Profile, Plan)


def _dump(obj: Profile | Plan, kind: str, path: str | os.PathLike[str] | None) -> str:
    data = {"format": f"revtrain.{kind}", "version": _FORMAT_VERSION, **dataclasses.asdict(obj)}
    text = json.dumps(data, indent=2, allow_nan=False) + "\n"
    if path is not None:
        Path(path).write_text(text)
    return text


def _load(cls: type[_T], kind: str, source: str | os.PathLike[str]) -> _T:
    if isinstance(source, str) and source.lstrip().startswith("{"):
        where, text = "JSON text", source
    else:
        where, text = f"file {os.fspath(source)!r}", Path(source).read_text()
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"cannot read a revtrain {kind} from {where}: invalid JSON ({e})") from None
    if not isinstance(data, dict) or data.get("format") != f"revtrain.{kind}":
        found = data.get("format") if isinstance(data, dict) else type(data).__name__
        raise ValueError(f"{where} is not a revtrain {kind} (format {found!r}, expected 'revtrain.{kind}')")
    version = data.pop("version", None)
    if version != _FORMAT_VERSION:
        raise ValueError(
            f"{where} has {kind} format version {version!r}; this revtrain reads version "
            f"{_FORMAT_VERSION} (upgrade revtrain, or re-run the planner)"
        )
    del data["format"]
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - names)
    if unknown:
        raise ValueError(f"{where} has unknown {kind} field(s) {unknown}")
    missing = sorted(f.name for f in dataclasses.fields(cls) if f.name not in data and _required(f))
    if missing:
        raise ValueError(f"{where} lacks required {kind} field(s) {missing}")
    if "input_shape" in data:
        data["input_shape"] = tuple(data["input_shape"])
    return cls(**data)


def _required(f: dataclasses.Field[Any]) -> bool:
    return f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING


# --- small helpers ---------------------------------------------------------------------------


def _few(names: list[str], k: int = 5) -> str:
    shown = ", ".join(repr(n) for n in names[:k])
    return f"[{shown}{', ...' if len(names) > k else ''}]"


def _finite(x: Any, name: str) -> float:
    try:
        v = float(x)
    except (TypeError, ValueError):
        raise TypeError(f"{name} must be a number, got {x!r}") from None
    if not math.isfinite(v):
        raise ValueError(f"{name} must be finite, got {v}")
    return v


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
