"""Time and peak memory of real training steps: forward, loss, backward, ``optimizer.step()``.

:func:`measure_steps` is the one place the planner measures whole steps; baseline-M, baseline-C
and plans are all measured by it, so their numbers compare.

**Step memory**, the quantity a budget bounds and the one figure every command prints as "step
memory" (``revtrain plan``, ``revtrain train``'s summary, the benchmarks), is the peak of one
training step's tensor bytes, including what is live when the step starts:

* the parameters, buffers, optimizer state and the batch (resident at the start), plus
* the peak of what the step allocates above them: activations kept for backward, gradients,
  the backward's and the optimizer's transients.

It is counted on **CUDA** as ``torch.cuda.memory_allocated`` at the start of the step plus the
allocator's peak above it (:func:`revtrain.memory.track_peak_memory`): every tensor this process
holds on the device counts, the model included. On the **CPU** the resident part is the bytes of
the unique storages of the parameters, buffers, optimizer state and batch, and the rest is the
peak the dispatch-level tracker of :mod:`revtrain.memory` sees; other tensors of the process (a
dataset, other models) are not part of it.

The measured region starts after ``optimizer.zero_grad(set_to_none=True)`` and after at least one
warm-up step, so the optimizer state exists (steady state, as in training) and no gradient is
live at entry; it ends after ``optimizer.step()``.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from revtrain.memory import kept_tensors, track_peak_memory
from revtrain.planner.setup import MeasurementSetup, Modes, apply_setting
from revtrain.timing import median_is_stable, timed

__all__ = ["StepMeasurement", "step_memory_floor", "measure_steps", "param_storage_ptrs", "storage_bytes"]


@dataclass(frozen=True)
class StepMeasurement:
    """What :func:`measure_steps` measured for one setting."""

    step_time_s: float
    """Median seconds of a whole step (zero_grad, forward, loss, backward, optimizer step); NaN
    when no step was timed."""
    peak_bytes: int
    """Step memory: the peak bytes of the step, as the module docstring defines them."""
    resident_bytes: int
    """Bytes already live at the start of the measured step (part of ``peak_bytes``)."""
    fixed_bytes: int
    """Bytes that do not depend on the batch size: parameters, buffers, gradients and optimizer
    state (unique storages on the device)."""
    times_s: tuple[float, ...]
    """Every timed step, in order."""
    method: str
    """How memory was counted: ``"cuda-allocator"`` or ``"cpu-dispatch"``."""
    optimizer: str
    """Class name of the optimizer used."""


def measure_steps(
    setup: MeasurementSetup,
    settings: Mapping[str, Modes],
    *,
    repeats: int | None = None,
    warmup: int | None = None,
) -> dict[str, StepMeasurement]:
    """Measure training steps of ``setup``'s model in several mode settings so that they compare.

    The model starts from its prepared state (:meth:`MeasurementSetup.reset`). Each setting gets
    ``warmup`` untimed steps; then the timed steps of the settings alternate in rounds, the order
    rotating each round (``M, C``, ``C, M``, ...), so a change in the machine's load hits each
    setting alike; with more than one setting each timed step follows an untimed step of its
    own setting, so it is timed in the steady state of training with that setting (a step is
    faster or slower by what the step before it left in the allocator); then each setting
    gets one step under the memory tracker. One optimizer serves all settings (modes do not
    change the parameters).

    **Rounds.** By default at least ``setup.repeats`` rounds, then more while some setting's
    median step is not yet known to ``setup.step_precision`` of itself
    (:func:`revtrain.timing.median_is_stable`), up to ``setup.max_repeats``. Given ``repeats``,
    exactly that many.

    Args:
        setup: What to measure (:func:`~revtrain.planner.setup.prepare`).
        settings: Name -> modes, e.g. ``{"baseline-M": "M", "plan": plan.modes}``.
        repeats: Exactly this many timed rounds; 0 measures the peaks only.
        warmup: Untimed steps per setting first; default ``setup.warmup``; at least 1.

    Returns:
        A :class:`StepMeasurement` per setting, by name.
    """
    low, high = (setup.repeats, setup.max_repeats) if repeats is None else (repeats, repeats)
    warmup = setup.warmup if warmup is None else warmup
    if low < 0:
        raise ValueError(f"repeats must be >= 0, got {low}")
    if warmup < 1:
        raise ValueError(f"warmup must be >= 1 (the first step creates the optimizer state), got {warmup}")
    model, dev = setup.model, setup.device
    setup.reset()
    model.train()
    optimizer = setup.make_optimizer([p for p in model.parameters() if p.requires_grad])

    def use(modes: Modes) -> None:
        apply_setting(model, modes, setup.state)

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        setup.loss().backward()
        optimizer.step()

    for modes in settings.values():
        use(modes)
        for _ in range(warmup):
            step()
    times: dict[str, list[float]] = {name: [] for name in settings}

    def stable() -> bool:
        return all(median_is_stable(t, setup.step_precision) for t in times.values())

    order = list(settings.items())
    rounds = 0
    while rounds < high and (rounds < low or (low > 0 and not stable())):
        shift = rounds % len(order)
        for name, modes in order[shift:] + order[:shift]:
            use(modes)
            if len(order) > 1:
                step()  # settle: the timed step follows one of its own setting
            times[name].append(timed(step, dev))
        rounds += 1

    results: dict[str, StepMeasurement] = {}
    for name, modes in settings.items():
        use(modes)
        optimizer.zero_grad(set_to_none=True)
        base = 0
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
            base = torch.cuda.memory_allocated(dev)
        with track_peak_memory(dev) as mem:
            # CPU: what is live before the step is adopted (counted, and its frees seen): the model,
            # the optimizer state, the batch, and the entries of caches kept between steps (at
            # module level or on modules) that a step reads.
            mem.adopt(_state_tensors(model, optimizer, setup.inputs, setup.targets))
            read = mem.watch(kept_tensors(model))
            step()  # one step tracked whole first: what it leaves for the next step is counted
            optimizer.zero_grad(set_to_none=True)
            mem.adopt(read())
            mem.reset_peak()
            resident = base + mem.end_bytes
            loss = setup.loss()
            loss.backward()
            optimizer.step()
            del loss
            peak = base + mem.peak_bytes
        results[name] = StepMeasurement(
            step_time_s=statistics.median(times[name]) if times[name] else math.nan,
            peak_bytes=peak,
            resident_bytes=resident,
            fixed_bytes=storage_bytes(_fixed_tensors(model, optimizer), dev),
            times_s=tuple(times[name]),
            method=mem.method,
            optimizer=type(optimizer).__name__,
        )
    optimizer.zero_grad(set_to_none=True)
    return results


def step_memory_floor(setup: MeasurementSetup) -> int:
    """Bytes a training step holds whatever the modes, known before anything runs: the
    parameters and their gradients, the buffers and the batch. A lower bound of the step
    memory (the optimizer state and the activations come on top)."""
    model = setup.model
    params = storage_bytes(model.parameters(), setup.device)
    grads = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    return params + grads + storage_bytes(_batch_and_buffers(setup), setup.device)


def storage_bytes(tensors: Iterable[Tensor], device: torch.device) -> int:
    """Bytes of the unique storages behind ``tensors`` that live on ``device``'s type."""
    seen: dict[int, int] = {}
    for t in tensors:
        if t.device.type != device.type or t.layout != torch.strided:
            continue
        st = t.untyped_storage()
        if st.nbytes():
            seen[st.data_ptr()] = st.nbytes()
    return sum(seen.values())


def param_storage_ptrs(model: nn.Module) -> set[int]:
    """``data_ptr`` of every parameter and buffer storage: never an activation."""
    return {t.untyped_storage().data_ptr() for t in _model_tensors(model)}


def _model_tensors(model: nn.Module) -> Iterator[Tensor]:
    yield from model.parameters()
    yield from model.buffers()


def _fixed_tensors(model: nn.Module, optimizer: torch.optim.Optimizer) -> Iterator[Tensor]:
    yield from _model_tensors(model)
    yield from (p.grad for p in model.parameters() if p.grad is not None)
    for state in optimizer.state.values():
        yield from (v for v in state.values() if isinstance(v, Tensor))


def _batch_tensors(inputs: Any, targets: Any) -> Iterator[Tensor]:
    for x in (*(inputs if isinstance(inputs, tuple) else (inputs,)), targets):
        if isinstance(x, Tensor):
            yield x


def _batch_and_buffers(setup: MeasurementSetup) -> Iterator[Tensor]:
    yield from setup.model.buffers()
    yield from _batch_tensors(setup.inputs, setup.targets)


def _state_tensors(model: nn.Module, optimizer: torch.optim.Optimizer, inputs: Any, targets: Any) -> Iterator[Tensor]:
    yield from _fixed_tensors(model, optimizer)
    yield from _batch_tensors(inputs, targets)
