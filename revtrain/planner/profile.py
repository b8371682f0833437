"""Stage 2 of the planner: measure ``t_e``, ``m`` and ``m_o`` of a model on this machine.

For a prepared model and batch, :func:`profile_setup` measures (Jiang et al. 2021, §3.2, §4.2):

* **m_o** — the step memory of baseline-M (every block in M-mode; forward, loss, backward,
  ``optimizer.step()``), by :func:`~revtrain.planner.measure.measure_steps`: the parameters,
  gradients, optimizer state, batch, non-reversible activations and the backward's transients.
  Its batch-independent part (parameters, buffers, gradients, optimizer state) is recorded as
  ``fixed_bytes``, the intercept of the linear memory model.
* **m_i** — what block ``i`` keeps for backward in C-mode beyond M-mode, *in context*: one
  forward of the whole model (with the loss) in baseline-M, then one per block with only that
  block in C-mode, each under both

  - ``torch.autograd.graph.saved_tensors_hooks``, summing the bytes of the unique storages saved
    for backward (parameters and buffers excluded), and
  - the memory tracker of :mod:`revtrain.memory`, reading the bytes the forward left live;

  ``m_i`` is each count's increase over baseline-M. In context matters: a C-mode block in the
  middle of a run of M-mode blocks also makes the run before it keep its output. The profile
  keeps both counts and uses the larger, so the prediction errs on the safe side.
* **t_e** — the extra time of M-mode, timed per block in M/C pairs until stable
  (:mod:`revtrain.planner.block_timing`).
* **baseline-M and baseline-C** — whole steps with every block in M-mode and in C-mode, their
  timed steps alternating until both medians are stable, baseline-C only when its predicted
  peak ``m_o + sum(m_i)`` fits the memory the device has (on CUDA an out-of-memory error also
  just skips it). ``step_time_M_s - step_time_C_s`` is what C-mode saves in a whole step; its
  ratio to ``sum(t_e)``, ``t_e_scale``, turns the isolated ``t_e`` into whole-step savings when
  a plan predicts its step time (:attr:`~revtrain.planner.data.Profile.t_e_scale`).

Profiling runs the model; :func:`~revtrain.planner.setup.prepare` puts it back afterwards.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from revtrain.core import reversible_blocks, set_modes
from revtrain.memory import track_peak_memory
from revtrain.planner.block_timing import BlockTiming, TimingRule, time_blocks
from revtrain.planner.layer_profile import profile_plain_layers
from revtrain.planner.budget import available_memory_bytes
from revtrain.planner.data import BlockProfile, Profile
from revtrain.planner.measure import StepMeasurement, measure_steps, param_storage_ptrs
from revtrain.planner.setup import LossFn, MeasurementSetup, OptimizerFactory, prepare
from revtrain.timing import median_interval

__all__ = ["profile_model", "profile_setup", "saved_bytes_in_context", "whole_step_scale"]

# Run baseline-C during profiling only when its predicted peak is below this share of what the
# device can give: a CPU out-of-memory kills the process instead of raising.
_C_HEADROOM = 0.8

Progress = Callable[[str], None]


def profile_model(
    model: nn.Module,
    batch: tuple[Any, Tensor],
    *,
    loss_fn: LossFn = F.cross_entropy,
    make_optimizer: OptimizerFactory | None = None,
    device: torch.device | str | None = None,
    repeats: int = 3,
    warmup: int = 2,
    max_repeats: int | None = None,
    model_name: str | None = None,
    run_baseline_c: bool | None = None,
    timing: TimingRule | None = None,
    plain_layers: bool = True,
) -> Profile:
    """Prepare ``model`` and ``batch`` (:func:`~revtrain.planner.setup.prepare`) and profile them.

    The arguments other than ``run_baseline_c``, ``timing`` and ``plain_layers`` are
    :func:`prepare`'s; see :func:`profile_setup` for those. The model is left as it was.
    """
    with prepare(
        model, batch, loss_fn=loss_fn, make_optimizer=make_optimizer, device=device,
        repeats=repeats, warmup=warmup, max_repeats=max_repeats, model_name=model_name,
    ) as setup:
        return profile_setup(setup, timing=timing, run_baseline_c=run_baseline_c, plain_layers=plain_layers)


def profile_setup(
    setup: MeasurementSetup,
    *,
    timing: TimingRule | None = None,
    run_baseline_c: bool | None = None,
    progress: Progress | None = None,
    plain_layers: bool = True,
) -> Profile:
    """Measure every reversible block's ``t_e`` and ``m`` and the model's ``m_o`` (module docstring).

    Args:
        setup: The prepared model and batch.
        timing: When to stop timing each block's M/C pairs; default :class:`TimingRule`.
        run_baseline_c: Measure baseline-C: True always, False never, None when its predicted
            peak fits the device's free memory.
        progress: Called with a line as each part starts.
        plain_layers: Also profile recomputing (and on CUDA offloading) the plain layers
            (:mod:`~revtrain.planner.layer_profile`); False profiles Jiang et al.'s M/C choice only.

    Raises:
        ValueError: the model has no reversible layer (ReversibleBlock or other Invertible).
    """
    say = progress or (lambda line: None)
    blocks = reversible_blocks(setup.model)
    if not blocks:
        raise ValueError(
            f"{type(setup.model).__name__} has no reversible layer (ReversibleBlock or other Invertible), "
            "so there is nothing to plan; the planner chooses modes for reversible layers only"
        )
    # Baseline-M's peak first (m_o); its time is taken below, alternating with baseline-C's.
    # The warm-up steps also absorb the slow first steps of a process (lazy initialisation,
    # first-touch page faults, kernel selection) before anything is timed.
    say("profiling: the peak of a baseline-M step (m_o) ...")
    base_m = measure_steps(setup, {"M": "M"}, repeats=0)["M"]
    say(f"profiling: the bytes each of the {len(blocks)} blocks keeps in C-mode (m_i) ...")
    m_hooks, m_tracker = saved_bytes_in_context(setup)
    m_bytes = {name: max(m_hooks[name], m_tracker[name]) for name, _ in blocks}
    predicted_c = base_m.peak_bytes + sum(m_bytes.values())
    if run_baseline_c is None:
        try:
            room, _ = available_memory_bytes(setup.device)
            room += base_m.resident_bytes if setup.device.type == "cpu" else 0
            run_baseline_c = predicted_c <= _C_HEADROOM * room
        except ValueError:
            run_baseline_c = False
    say("profiling: t_e of each block, M and C timed in pairs until stable ...")
    timing_by_name = time_blocks(setup, timing, progress=progress)
    layer_profiles = []
    if plain_layers:
        say("profiling: what recomputing each plain (non-reversible) layer costs and frees ...")
        layer_profiles = profile_plain_layers(setup, timing, progress=progress)
    # The whole steps last: their baseline-M time anchors the plan's predicted step, and the
    # final measurement of the plan comes soon after.
    say("profiling: whole baseline-M" + (" and baseline-C" if run_baseline_c else "") + " steps ...")
    steps: dict[str, StepMeasurement] = {}
    if run_baseline_c:
        try:
            steps = measure_steps(setup, {"M": "M", "C": "C"})
        except torch.cuda.OutOfMemoryError:
            torch.cuda.empty_cache()
    if not steps:
        steps = measure_steps(setup, {"M": "M"})
    base_c = steps.get("C")
    t_e_scale, warnings = whole_step_scale(
        steps["M"].times_s, base_c.times_s if base_c else (), list(timing_by_name.values()),
    )
    block_profiles = [
        BlockProfile(
            name=name,
            t_e_s=timing_by_name[name].t_e_s,
            m_bytes=m_bytes[name],
            t_forward_s=timing_by_name[name].forward_M_s,
            t_backward_M_s=timing_by_name[name].backward_M_s,
            t_backward_C_s=timing_by_name[name].backward_C_s,
            t_forward_C_s=timing_by_name[name].forward_C_s,
            m_hooks_bytes=m_hooks[name],
            m_tracker_bytes=m_tracker[name],
            t_e_iqr_s=timing_by_name[name].t_e_iqr_s,
            t_e_pairs=timing_by_name[name].pairs,
            t_e_low_s=timing_by_name[name].t_e_low_s,
            t_e_high_s=timing_by_name[name].t_e_high_s,
        )
        for name, _ in blocks
    ]
    dtype = next((p.dtype for p in setup.model.parameters() if p.is_floating_point()), torch.float32)
    return Profile(
        model=setup.model_name,
        batch_size=setup.batch_size,
        input_shape=tuple(setup.first_input.shape[1:]),
        dtype=str(dtype).removeprefix("torch."),
        device=describe_device(setup.device),
        blocks=block_profiles,
        m_o_bytes=base_m.peak_bytes,
        fixed_bytes=min(base_m.fixed_bytes, base_m.peak_bytes),
        step_time_M_s=steps["M"].step_time_s,
        step_time_C_s=base_c.step_time_s if base_c else None,
        peak_M_bytes=base_m.peak_bytes,
        peak_C_bytes=base_c.peak_bytes if base_c else None,
        memory_method=base_m.method,
        optimizer=base_m.optimizer,
        t_e_scale=t_e_scale,
        step_time_M_interval_s=_interval_of(steps["M"].times_s),
        step_time_C_interval_s=_interval_of(base_c.times_s) if base_c else None,
        layers=layer_profiles,
        warnings=warnings,
    )


def _interval_of(times: tuple[float, ...]) -> list[float] | None:
    if not times:
        return None
    iv = median_interval(times)
    return [iv.low, iv.high]


# The isolated t_e are trusted as a total when their 95% intervals add up to at most this share
# of it; beyond, the report says by how much they are not.
_WIDE = 0.5


def whole_step_scale(
    times_m: tuple[float, ...] | list[float],
    times_c: tuple[float, ...] | list[float],
    timings: list[BlockTiming],
) -> tuple[float | None, list[str]]:
    """``t_e_scale`` from whole baseline-M and baseline-C steps timed in alternating rounds, and
    warnings on what the timings cannot support.

    The scale is the median paired difference ``M - C`` over ``sum(t_e)``, only when the 95%
    interval of that median (:func:`revtrain.timing.median_interval`) lies above zero: a
    baseline-C not shown faster than baseline-M says nothing about what C-mode saves (M-mode
    does everything C-mode does plus a rebuild), so the scale is then None, the paper's model,
    and a warning says why. Never 0 or negative.
    """
    warnings: list[str] = []
    sum_t_e = sum(t.t_e_s for t in timings)
    spread = sum((t.t_e_high_s - t.t_e_low_s) / 2 for t in timings if t.t_e_low_s is not None and t.t_e_high_s is not None)
    if sum_t_e > 0 and spread > _WIDE * sum_t_e:
        unsure = sum(1 for t in timings if t.t_e_low_s is not None and t.t_e_low_s <= 0)
        warnings.append(
            f"the per-block t_e are uncertain: their 95% intervals add up to +/-{spread * 1e3:.2f} ms against a "
            f"total of {sum_t_e * 1e3:.2f} ms ({spread / sum_t_e:.0%}); {unsure} of {len(timings)} intervals "
            "include zero. Which blocks go to C-mode rests on noise; the measured step is the ground truth "
            "(profile on a quieter machine, or raise --t-e-max-pairs)"
        )
    pairs = list(zip(times_m, times_c))
    if not pairs or sum_t_e <= 0:
        return None, warnings
    interval = median_interval([m - c for m, c in pairs])
    if interval.low <= 0:
        med_m = statistics.median(times_m)
        med_c = statistics.median(times_c)
        warnings.append(
            f"whole steps do not show C-mode faster than M-mode: baseline-C {med_c:.4f} s against baseline-M "
            f"{med_m:.4f} s, M - C = {interval.median * 1e3:+.2f} ms with 95% interval "
            f"[{interval.low * 1e3:+.2f}, {interval.high * 1e3:+.2f}] ms over {len(pairs)} rounds; predicted "
            "savings use the isolated t_e unscaled (the paper's model), so predicted steps below baseline-M may "
            "not be reached"
        )
        return None, warnings
    return interval.median / sum_t_e, warnings


def saved_bytes_in_context(setup: MeasurementSetup) -> tuple[dict[str, int], dict[str, int]]:
    """Bytes each block keeps for backward in C-mode beyond baseline-M, counted two ways.

    Runs the forward (with the loss) once in baseline-M and once per block with that block alone
    in C-mode. Returns ``(by_hooks, by_tracker)``, both keyed by block name: the increase of the
    unique non-parameter storages saved for backward (``saved_tensors_hooks``), and the increase of
    the bytes the forward left live (:func:`revtrain.memory.track_peak_memory`). Negative
    increases (possible when a block's C-mode lets another tensor go) are reported as 0.
    """
    model = setup.model
    names = [name for name, _ in reversible_blocks(model)]
    exclude = param_storage_ptrs(model)
    setup.reset()
    model.train()
    set_modes(model, "M")
    base_hooks, base_live = _forward_saved(setup, exclude)
    by_hooks: dict[str, int] = {}
    by_tracker: dict[str, int] = {}
    for name in names:
        set_modes(model, {name: "C"})
        hooks, live = _forward_saved(setup, exclude)
        set_modes(model, {name: "M"})
        by_hooks[name] = max(0, hooks - base_hooks)
        by_tracker[name] = max(0, live - base_live)
    return by_hooks, by_tracker


def describe_device(dev: torch.device) -> str:
    """The device as a profile records it: ``"cpu"``, or ``"cuda:0 (NVIDIA H100 ...)"``."""
    if dev.type == "cuda":
        return f"{dev} ({torch.cuda.get_device_name(dev)})"
    return str(dev)


def _forward_saved(setup: MeasurementSetup, exclude: set[int]) -> tuple[int, int]:
    """One forward with the loss: (bytes of unique saved storages, bytes left live)."""
    device = setup.device
    saved: dict[int, torch.UntypedStorage] = {}

    def pack(t: Tensor) -> Tensor:
        if t.device.type == device.type and t.layout == torch.strided:
            st = t.untyped_storage()
            ptr = st.data_ptr()
            if ptr not in exclude and st.nbytes():
                saved[ptr] = st
        # A detached alias (same storage, no grad_fn), never ``t`` itself: packing an output of
        # the node that saves it would make a cycle through autograd's C++ graph (tensor ->
        # grad_fn -> saved value -> tensor) that Python's gc cannot see, so the whole forward's
        # graph and activations would outlive ``loss``.
        return t.detach()

    with track_peak_memory(device) as mem:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss = setup.loss()
        live = mem.end_bytes
    hooks = sum(st.nbytes() for st in saved.values())
    del loss
    saved.clear()  # the storages, not the name: pack (a closure) refers to it
    return hooks, live
