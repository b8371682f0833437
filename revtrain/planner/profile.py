"""Stage 2 of the planner: measure ``t_e``, ``m`` and ``m_o`` of a model on this machine.

For a model, a batch and a dtype, :func:`profile_model` measures (Jiang et al. 2021, §3.2, §4.2):

* **m_o** — the peak of a whole baseline-M training step (every block in M-mode; forward, loss,
  backward, ``optimizer.step()``), by :func:`~revtrain.planner.measure.measure_step_stats`: the
  parameters, gradients, optimizer state, batch, non-reversible activations and the backward's
  transients (see :mod:`revtrain.planner.measure` for exactly what is counted). Its
  batch-independent part (parameters, buffers, gradients, optimizer state) is recorded as
  ``fixed_bytes``, the intercept of the linear memory model.
* **m_i** — what block ``i`` keeps for backward in C-mode beyond M-mode, *in context*: one
  forward of the whole model (with the loss) in baseline-M, then one per block with only that
  block in C-mode, each under both

  - ``torch.autograd.graph.saved_tensors_hooks``, summing the bytes of the unique storages saved
    for backward (parameters and buffers excluded), and
  - the memory tracker of :mod:`revtrain.memory`, reading the bytes the forward left live;

  ``m_i`` is each count's increase over baseline-M. In context matters: a C-mode block in the
  middle of a run of M-mode blocks also makes the run before it keep its output. The two counts
  differ by what is live but not saved (the M-mode blocks' random-generator snapshots, for
  instance); the profile keeps both and uses the larger, so the prediction errs on the safe side.
* **t_e** — the extra time of M-mode, ``(t_f1 + t_b1) - (t_f2 + t_b2)`` (§3.2): each block is
  run alone on its real input (taken by a pre-hook inside a no-grad forward of the whole model),
  forward and backward, in M-mode and in C-mode back to back; the median of the differences
  (:func:`time_blocks`). The paper approximates it by ``t_f1``, one forward of the block (§4.2),
  which serves when the measured difference is lost in noise. Cross-checked against whole steps:
  ``step_time_M_s - step_time_C_s`` should be close to the sum of ``t_e``.
* **baseline-C** — a whole step with every block in C-mode, when its predicted peak
  ``m_o + sum(m_i)`` fits the memory the device has (on CUDA an out-of-memory error also just
  skips it). Its timed steps alternate with baseline-M's, so the two times compare.

Profiling runs the model; the model is left exactly as it was (see
:func:`~revtrain.planner.measure.preserved_state`).
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from revtrain.core import ReversibleBlock, reversible_blocks, set_modes
from revtrain.memory import track_peak_memory
from revtrain.planner.budget import available_memory_bytes
from revtrain.planner.measure import (
    LossFn,
    OptimizerFactory,
    batch_size_of,
    StepMeasurement,
    batch_to,
    call_model,
    check_on_device,
    measure_step_stats,
    measure_steps,
    param_storage_ptrs,
    preserved_state,
    resolve_device,
    timer,
)
from revtrain.planner.plan import BlockProfile, Profile

__all__ = ["BlockTiming", "profile_model", "saved_bytes_in_context", "time_blocks"]

# Run baseline-C during profiling only when its predicted peak is below this share of what the
# device can give: a CPU out-of-memory kills the process instead of raising.
_C_HEADROOM = 0.8


def profile_model(
    model: nn.Module,
    batch: tuple[Any, Tensor],
    *,
    loss_fn: LossFn = F.cross_entropy,
    make_optimizer: OptimizerFactory | None = None,
    device: torch.device | str | None = None,
    repeats: int = 3,
    warmup: int = 2,
    model_name: str | None = None,
    run_baseline_c: bool | None = None,
) -> Profile:
    """Measure every reversible block's ``t_e`` and ``m`` and the model's ``m_o`` (module docstring).

    Args:
        model: A model with :class:`~revtrain.core.ReversibleBlock` s, already on ``device``.
        batch: ``(inputs, targets)`` of the batch size to profile.
        loss_fn: ``loss_fn(model(inputs), targets)``.
        make_optimizer: Optimizer factory whose state counts in ``m_o`` (default: SGD, momentum).
        device: Where to run; default the model's device.
        repeats: Timed repetitions per measurement (medians are kept).
        warmup: Untimed repetitions first (at least 1).
        model_name: Name recorded in the profile; default the model's class name.
        run_baseline_c: Measure baseline-C: True always, False never, None when its predicted
            peak fits the device's free memory.

    Raises:
        ValueError: the model has no reversible block, or is not on ``device``.
    """
    dev = resolve_device(model, device)
    check_on_device(model, dev)
    blocks = reversible_blocks(model)
    if not blocks:
        raise ValueError(
            f"{type(model).__name__} has no ReversibleBlock, so there is nothing to plan; the "
            "planner chooses modes for reversible blocks only"
        )
    inputs, targets = batch_to(batch, dev)
    kwargs: dict[str, Any] = dict(
        loss_fn=loss_fn, make_optimizer=make_optimizer, device=dev, repeats=repeats, warmup=warmup
    )
    with preserved_state(model):
        model.train()
        # Baseline-M's peak first (m_o); its time is taken below, alternating with baseline-C's.
        # The warm-up steps also absorb the slow first steps of a process (lazy initialisation,
        # first-touch page faults, kernel selection) before anything is timed.
        base_m = measure_step_stats(model, (inputs, targets), modes="M", **{**kwargs, "repeats": 0})
        m_hooks, m_tracker = saved_bytes_in_context(model, (inputs, targets), loss_fn=loss_fn, device=dev)
        m_bytes = {name: max(m_hooks[name], m_tracker[name]) for name, _ in blocks}
        predicted_c = base_m.peak_bytes + sum(m_bytes.values())
        if run_baseline_c is None:
            try:
                room, _ = available_memory_bytes(dev)
                room += base_m.resident_bytes if dev.type == "cpu" else 0
                run_baseline_c = predicted_c <= _C_HEADROOM * room
            except ValueError:
                run_baseline_c = False
        steps: dict[str, StepMeasurement] = {}
        if run_baseline_c:
            try:
                steps = measure_steps(model, (inputs, targets), {"M": "M", "C": "C"}, **kwargs)
            except torch.cuda.OutOfMemoryError:
                torch.cuda.empty_cache()
        if not steps:
            steps = measure_steps(model, (inputs, targets), {"M": "M"}, **kwargs)
        base_c = steps.get("C")
        timing = time_blocks(model, inputs, device=dev, repeats=repeats, warmup=warmup)
    block_profiles = [
        BlockProfile(
            name=name,
            t_e_s=timing[name].t_e_s,
            m_bytes=m_bytes[name],
            t_forward_s=timing[name].forward_M_s,
            t_backward_M_s=timing[name].backward_M_s,
            t_backward_C_s=timing[name].backward_C_s,
            t_forward_C_s=timing[name].forward_C_s,
            m_hooks_bytes=m_hooks[name],
            m_tracker_bytes=m_tracker[name],
        )
        for name, _ in blocks
    ]
    dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)
    first = inputs[0] if isinstance(inputs, tuple) else inputs
    return Profile(
        model=model_name or type(model).__name__,
        batch_size=batch_size_of((inputs, targets)),
        input_shape=tuple(first.shape[1:]),
        dtype=str(dtype).removeprefix("torch."),
        device=_describe(dev),
        blocks=block_profiles,
        m_o_bytes=base_m.peak_bytes,
        fixed_bytes=min(base_m.fixed_bytes, base_m.peak_bytes),
        step_time_M_s=steps["M"].step_time_s,
        step_time_C_s=base_c.step_time_s if base_c else None,
        peak_M_bytes=base_m.peak_bytes,
        peak_C_bytes=base_c.peak_bytes if base_c else None,
        memory_method=base_m.method,
        optimizer=base_m.optimizer,
    )


def saved_bytes_in_context(
    model: nn.Module,
    batch: tuple[Any, Tensor],
    *,
    loss_fn: LossFn = F.cross_entropy,
    device: torch.device | str | None = None,
) -> tuple[dict[str, int], dict[str, int]]:
    """Bytes each block keeps for backward in C-mode beyond baseline-M, counted two ways.

    Runs the forward (with the loss) once in baseline-M and once per block with that block alone
    in C-mode. Returns ``(by_hooks, by_tracker)``, both keyed by block name: the increase of the
    unique non-parameter storages saved for backward (``saved_tensors_hooks``), and the increase of
    the bytes the forward left live (:func:`revtrain.memory.track_peak_memory`). Negative
    increases (possible when a block's C-mode lets another tensor go) are reported as 0.

    The model's modes, parameters and buffers are restored afterwards.
    """
    dev = resolve_device(model, device)
    inputs, targets = batch_to(batch, dev)
    names = [name for name, _ in reversible_blocks(model)]
    exclude = param_storage_ptrs(model)
    with preserved_state(model):
        model.train()
        set_modes(model, "M")
        base_hooks, base_live = _forward_saved(model, inputs, targets, loss_fn, dev, exclude)
        by_hooks: dict[str, int] = {}
        by_tracker: dict[str, int] = {}
        for name in names:
            set_modes(model, {name: "C"})
            hooks, live = _forward_saved(model, inputs, targets, loss_fn, dev, exclude)
            set_modes(model, {name: "M"})
            by_hooks[name] = max(0, hooks - base_hooks)
            by_tracker[name] = max(0, live - base_live)
    return by_hooks, by_tracker


def _forward_saved(
    model: nn.Module,
    inputs: Any,
    targets: Tensor,
    loss_fn: LossFn,
    device: torch.device,
    exclude: set[int],
) -> tuple[int, int]:
    """One forward with the loss: (bytes of unique saved storages, bytes left live)."""
    saved: dict[int, torch.UntypedStorage] = {}

    def pack(t: Tensor) -> Tensor:
        if t.device.type == device.type and t.layout == torch.strided:
            st = t.untyped_storage()
            ptr = st.data_ptr()
            if ptr not in exclude and st.nbytes():
                saved[ptr] = st
        return t

    with track_peak_memory(device) as mem:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss = loss_fn(call_model(model, inputs), targets)
        live = mem.end_bytes
    hooks = sum(st.nbytes() for st in saved.values())
    del loss, saved
    return hooks, live


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
    """Median over repetitions of ``(t_f1 + t_b1) - (t_f2 + t_b2)``, the two modes timed back to
    back in each repetition so that a change of machine load hits both. M-mode does everything
    C-mode does plus a rebuild, so a median <= 0 is noise; ``t_f1`` (the paper's estimate,
    §4.2) is used instead."""


def time_blocks(
    model: nn.Module,
    inputs: Any,
    *,
    device: torch.device | str | None = None,
    repeats: int = 3,
    warmup: int = 2,
) -> dict[str, BlockTiming]:
    """Time each reversible block's forward and backward in M-mode and in C-mode.

    One no-grad forward of the whole model; just before each block runs, a pre-hook takes the
    block's actual input, makes it require grad as in training, and runs the block alone
    ``warmup + repeats`` times in each mode, forward then backward (upstream gradient of ones),
    timing the last ``repeats`` (CUDA events on a GPU). Parameters, buffers, gradients, modes and
    random generators are restored afterwards.
    """
    dev = resolve_device(model, device)
    inputs = batch_to((inputs, None), dev)[0]
    start = timer(dev)
    names = {id(block): name for name, block in reversible_blocks(model)}
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

    def pre(block: ReversibleBlock, args: tuple) -> None:
        x1, x2 = block.to_state(args[0])  # a tensor (split in halves) or a pair (x1, x2)
        rows = []
        for k in range(warmup + repeats):
            fm, bm = run(block, x1, x2, "M")
            fc, bc = run(block, x1, x2, "C")
            if k >= warmup:
                rows.append((fm, bm, fc, bc, (fm + bm) - (fc + bc)))
        fm, bm, fc, bc, t_e = (statistics.median(col) for col in zip(*rows))
        result[names[id(block)]] = BlockTiming(fm, bm, fc, bc, t_e if t_e > 0 else fm)

    with preserved_state(model):
        model.train()
        handles = [block.register_forward_pre_hook(pre) for _, block in reversible_blocks(model)]
        try:
            with torch.no_grad():
                call_model(model, inputs)
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


def _describe(dev: torch.device) -> str:
    if dev.type == "cuda":
        return f"{dev} ({torch.cuda.get_device_name(dev)})"
    return str(dev)
