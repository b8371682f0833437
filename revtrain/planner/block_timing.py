"""``t_e`` per block: the extra time of M-mode, timed in pairs until the estimate is stable.

``t_e = (t_f1 + t_b1) - (t_f2 + t_b2)`` (Jiang et al. 2021, §3.2): forward plus backward of a
block in M-mode minus the same in C-mode. A block is any reversible layer
(:class:`~revtrain.core.Invertible`): a RevNet or Transformer coupling block, an In-place ABN
layer. :func:`time_blocks` takes each block's real arguments with a pre-hook during one no-grad
forward of the whole model and runs the block alone on them, M and C **paired**: one M run and
one C run back to back, in alternating order (M then C, then C then M), so that a change of
machine load, or a cost of running first, hits both modes alike. Each run's backward starts
from a gradient of ones on every output. Each pair gives one difference; ``t_e`` is their
median.

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
from typing import Any

import torch
from torch import Tensor

from revtrain.core import Invertible, reversible_blocks
from revtrain.device import synchronize
from revtrain.planner.recompute import tensors_in
from revtrain.planner.setup import MeasurementSetup, call_model
from revtrain.timing import iqr, median_interval, median_is_stable, timer

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
    t_e_low_s: float | None = None
    """Low end of the 95% interval of the median difference (:func:`revtrain.timing.median_interval`)."""
    t_e_high_s: float | None = None
    """High end of that interval."""


def time_blocks(
    setup: MeasurementSetup,
    rule: TimingRule | None = None,
    *,
    progress: Callable[[str], None] | None = None,
) -> dict[str, BlockTiming]:
    """Time every reversible layer of ``setup``'s model, M and C paired, until stable (module docstring).

    A reversible layer is any :class:`~revtrain.core.Invertible`: a coupling block
    (:class:`~revtrain.core.ReversibleBlock`, called on a tensor or on a pair of halves) or an
    invertible layer such as :class:`~revtrain.layers.InPlaceABN` (one tensor in, one out). Each
    is timed on exactly the arguments the model's forward called it with
    (:func:`_fresh_arguments`), so a layer's timing does not depend on how its call is spelled.

    Args:
        setup: The prepared model and batch; the model starts from its prepared state.
        rule: When to stop; default :class:`TimingRule`.
        progress: Called with a line after each layer.

    Returns:
        A :class:`BlockTiming` per reversible layer, by module name.
    """
    rule = rule or TimingRule()
    dev = setup.device
    start = timer(dev)
    layers = reversible_blocks(setup.model)
    names = {id(layer): name for name, layer in layers}
    result: dict[str, BlockTiming] = {}

    def run(layer: Invertible, args: tuple, kwargs: dict, mode: str) -> tuple[float, float]:
        layer.mode = mode
        return time_forward_backward(layer.forward, args, kwargs, dev, start)

    def pair(layer: Invertible, args: tuple, kwargs: dict, k: int) -> tuple[float, float, float, float]:
        if k % 2 == 0:
            fm, bm = run(layer, args, kwargs, "M")
            fc, bc = run(layer, args, kwargs, "C")
        else:
            fc, bc = run(layer, args, kwargs, "C")
            fm, bm = run(layer, args, kwargs, "M")
        return fm, bm, fc, bc

    def pre(layer: Invertible, args: tuple, kwargs: dict) -> None:
        for k in range(rule.warmup_pairs):
            pair(layer, args, kwargs, k)
        rows: list[tuple[float, float, float, float]] = []
        diffs: list[float] = []
        while not rule.settled(diffs):
            fm, bm, fc, bc = pair(layer, args, kwargs, len(rows))
            rows.append((fm, bm, fc, bc))
            diffs.append((fm + bm) - (fc + bc))
        fm, bm, fc, bc = (statistics.median(col) for col in zip(*rows))
        t_e = statistics.median(diffs)
        name = names[id(layer)]
        interval = median_interval(diffs)
        result[name] = BlockTiming(fm, bm, fc, bc, t_e if t_e > 0 else fm, iqr(diffs), len(diffs),
                                   interval.low, interval.high)
        if progress is not None:
            t = result[name]
            progress(f"  t_e of {name}: {t.t_e_s * 1e3:.2f} ms (IQR {t.t_e_iqr_s * 1e3:.2f} ms, {t.pairs} pairs)")

    setup.reset()
    setup.model.train()
    handles = [layer.register_forward_pre_hook(pre, with_kwargs=True) for _, layer in layers]
    try:
        with torch.no_grad():
            call_model(setup.model, setup.inputs)
    finally:
        for h in handles:
            h.remove()
    missing = [n for n in names.values() if n not in result]
    if missing:
        raise RuntimeError(
            f"reversible layers {missing[:5]} were not called in the model's forward; the planner "
            "needs every reversible layer (ReversibleBlock or other Invertible) to run on the example batch"
        )
    return result


def _fresh_arguments(args: Any) -> Any:
    """The layer's positional arguments as new leaves: every floating-point tensor detached and
    requiring grad (in training, the activations they stand for carry gradients), other tensors
    (token ids, masks) detached; tuples and lists keep their structure."""
    if isinstance(args, Tensor):
        leaf = args.detach()
        return leaf.requires_grad_() if leaf.is_floating_point() else leaf
    if isinstance(args, (tuple, list)):
        return type(args)(_fresh_arguments(a) for a in args)
    return args


def time_forward_backward(forward: Callable[..., Any], args: tuple, kwargs: dict, dev: torch.device,
                          start: Callable[[], Callable[[], float]]) -> tuple[float, float]:
    """Seconds of ``forward`` on fresh copies of ``args`` (see :func:`_fresh_arguments`) and of the
    backward of a gradient of ones on every output that requires grad. Pass a module's
    ``forward``, not the module: from inside its forward pre-hook, ``__call__`` would re-enter it."""
    inputs = _fresh_arguments(args)
    with torch.enable_grad():
        synchronize(dev)
        stop = start()
        out = forward(*inputs, **kwargs)
        t_fwd = stop()
        outs = [t for t in tensors_in(out) if t.requires_grad]
        grads = [torch.ones_like(t) for t in outs]
        synchronize(dev)
        stop = start()
        if outs:
            torch.autograd.backward(outs, grads)
        t_bwd = stop()
    return t_fwd, t_bwd
