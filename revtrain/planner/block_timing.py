"""``t_e`` per block: the extra time of M-mode, timed in pairs until the estimate is stable.

``t_e = (t_f1 + t_b1) - (t_f2 + t_b2)`` (Jiang et al. 2021, §3.2): forward plus backward of a
block in M-mode minus the same in C-mode. :func:`time_blocks` takes each block's real input with
a pre-hook during one no-grad forward of the whole model and runs the block alone on it, M and C
**paired**: one M run and one C run back to back, in alternating order (M then C, then C then
M), so that a change of machine load, or a cost of running first, hits both modes alike. Each
pair gives one difference; ``t_e`` is their median.

**Stopping rule** (:class:`TimingRule`). After the warm-up pairs and at least ``min_pairs``
pairs, timing stops as soon as the median is known to ``precision`` of itself: the standard
error of a median, ``1.2533 * sigma / sqrt(n)`` for normal noise, with ``sigma`` estimated
robustly as ``IQR / 1.349``, i.e. ``0.929 * IQR / sqrt(n) <= precision * |median|``. Noisy
blocks get more pairs, up to ``max_pairs``. The profile records each block's IQR and pair count.

M-mode does everything C-mode does plus a rebuild, so a median ``<= 0`` is noise: the paper's
own estimate ``t_e ~ t_f1`` (one forward of the block, §4.2) is used instead.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from revtrain.core import ReversibleBlock, reversible_blocks
from revtrain.planner.setup import MeasurementSetup, call_model
from revtrain.timing import iqr, median_is_stable, timer

__all__ = ["BlockTiming", "TimingRule", "time_blocks"]

@dataclass(frozen=True, kw_only=True)
class TimingRule:
    """When to stop timing a block's M/C pairs (module docstring)."""

    warmup_pairs: int = 2
    """Untimed pairs first (kernel selection, allocator warm-up)."""
    min_pairs: int = 5
    """Timed pairs at least, before the stopping rule is consulted."""
    max_pairs: int = 30
    """Timed pairs at most: the cap for blocks whose timings never settle."""
    precision: float = 0.05
    """Stop when the standard error of the median ``t_e`` is at most this fraction of it."""

    def __post_init__(self) -> None:
        if self.warmup_pairs < 0:
            raise ValueError(f"TimingRule.warmup_pairs must be >= 0, got {self.warmup_pairs}")
        if not 1 <= self.min_pairs <= self.max_pairs:
            raise ValueError(
                f"TimingRule needs 1 <= min_pairs <= max_pairs, got {self.min_pairs} and {self.max_pairs}"
            )
        if not self.precision > 0:
            raise ValueError(f"TimingRule.precision must be > 0, got {self.precision}")

    @classmethod
    def with_cap(cls, precision: float, max_pairs: int) -> TimingRule:
        """The rule with this precision and cap (``--t-e-precision``, ``--t-e-max-pairs``); the
        minimum number of pairs is lowered to the cap when the cap is below it."""
        return cls(precision=precision, min_pairs=min(cls.min_pairs, max_pairs), max_pairs=max_pairs)

    def settled(self, differences: list[float]) -> bool:
        """Whether the median of these per-pair differences is known well enough to stop."""
        n = len(differences)
        if n >= self.max_pairs:
            return True
        return n >= self.min_pairs and median_is_stable(differences, self.precision)


@dataclass(frozen=True)
class BlockTiming:
    """Median seconds of one block's forward and backward in each mode, on its real input."""

    forward_M_s: float
    """Forward in M-mode (no graph kept): ``t_f1`` of the paper."""
    backward_M_s: float
    """Backward in M-mode, the rebuild included: ``t_b1``."""
    forward_C_s: float
    """Forward in C-mode (plain autograd): ``t_f2``."""
    backward_C_s: float
    """Backward in C-mode: ``t_b2``."""
    t_e_s: float
    """Median over pairs of ``(t_f1 + t_b1) - (t_f2 + t_b2)``; ``t_f1`` when that is <= 0."""
    t_e_iqr_s: float
    """Interquartile range of the per-pair differences."""
    pairs: int
    """Timed pairs."""


def time_blocks(
    setup: MeasurementSetup,
    rule: TimingRule | None = None,
    *,
    progress: Callable[[str], None] | None = None,
) -> dict[str, BlockTiming]:
    """Time every reversible block of ``setup``'s model, M and C paired, until stable (module docstring).

    Args:
        setup: The prepared model and batch; the model starts from its prepared state.
        rule: When to stop; default :class:`TimingRule`.
        progress: Called with a line after each block.

    Returns:
        A :class:`BlockTiming` per block, by module name.
    """
    rule = rule or TimingRule()
    dev = setup.device
    start = timer(dev)
    blocks = reversible_blocks(setup.model)
    names = {id(block): name for name, block in blocks}
    result: dict[str, BlockTiming] = {}

    def run(block: ReversibleBlock, x1: Tensor, x2: Tensor, mode: str) -> tuple[float, float]:
        block.mode = mode
        z1 = x1.detach().requires_grad_()
        z2 = x2.detach().requires_grad_()
        with torch.enable_grad():
            if dev.type == "cuda":
                torch.cuda.synchronize(dev)
            stop = start()
            y1, y2 = block.forward((z1, z2))  # not __call__: that would re-enter this pre-hook
            t_fwd = stop()
            grads = (torch.ones_like(y1), torch.ones_like(y2))
            if dev.type == "cuda":
                torch.cuda.synchronize(dev)
            stop = start()
            torch.autograd.backward((y1, y2), grads)
            t_bwd = stop()
        return t_fwd, t_bwd

    def pair(block: ReversibleBlock, x1: Tensor, x2: Tensor, k: int) -> tuple[float, float, float, float]:
        if k % 2 == 0:
            fm, bm = run(block, x1, x2, "M")
            fc, bc = run(block, x1, x2, "C")
        else:
            fc, bc = run(block, x1, x2, "C")
            fm, bm = run(block, x1, x2, "M")
        return fm, bm, fc, bc

    def pre(block: ReversibleBlock, args: tuple) -> None:
        x1, x2 = block.to_state(args[0])  # a tensor (split in halves) or a pair (x1, x2)
        for k in range(rule.warmup_pairs):
            pair(block, x1, x2, k)
        rows: list[tuple[float, float, float, float]] = []
        diffs: list[float] = []
        while not rule.settled(diffs):
            fm, bm, fc, bc = pair(block, x1, x2, len(rows))
            rows.append((fm, bm, fc, bc))
            diffs.append((fm + bm) - (fc + bc))
        fm, bm, fc, bc = (statistics.median(col) for col in zip(*rows))
        t_e = statistics.median(diffs)
        name = names[id(block)]
        result[name] = BlockTiming(fm, bm, fc, bc, t_e if t_e > 0 else fm, iqr(diffs), len(diffs))
        if progress is not None:
            t = result[name]
            progress(f"  t_e of {name}: {t.t_e_s * 1e3:.2f} ms (IQR {t.t_e_iqr_s * 1e3:.2f} ms, {t.pairs} pairs)")

    setup.reset()
    setup.model.train()
    handles = [block.register_forward_pre_hook(pre) for _, block in blocks]
    try:
        with torch.no_grad():
            call_model(setup.model, setup.inputs)
    finally:
        for h in handles:
            h.remove()
    missing = [n for n in names.values() if n not in result]
    if missing:
        raise RuntimeError(
            f"reversible blocks {missing[:5]} were not called in the model's forward; the planner "
            "needs every reversible block to run on the example batch"
        )
    return result
