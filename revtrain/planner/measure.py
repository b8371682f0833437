"""Time and peak memory of one real training step: forward, loss, backward, ``optimizer.step()``.

This is the one place the planner measures whole steps; baseline-M, baseline-C and a plan are
all measured by :func:`measure_step`, so their numbers compare.

What a step's **peak** counts, in bytes (the quantity a budget bounds):

* **CUDA**: ``torch.cuda.memory_allocated`` at the start of the step plus the allocator's peak
  above it during the step (:func:`revtrain.memory.track_peak_memory`), i.e. the device's peak
  allocated bytes: everything this process holds on the device, the model included.
* **CPU**: the bytes of the storages resident at the start of the step — parameters, buffers,
  optimizer state and the batch — plus the peak of what the step allocates above them, as the
  CPU tracker of :mod:`revtrain.memory` counts it. Other tensors of the process (a dataset, other
  models) are not part of it.

The measured region starts after ``optimizer.zero_grad(set_to_none=True)`` and after at least one
warm-up step, so the optimizer state exists (steady state, as in training) and no gradient is
live at entry; it ends after ``optimizer.step()``. Gradients, the backward's transients and the
optimizer's temporaries are therefore inside the peak.

Measuring trains the model on the batch; every measurement here restores the model afterwards
(parameters, buffers such as batch-norm statistics, gradients, modes, train/eval flags and the
random generators), so calling it has no effect on the model but time.
"""

from __future__ import annotations

import contextlib
import math
import statistics
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from revtrain.core import get_modes, set_modes
from revtrain.device import resolve_device as _resolve
from revtrain.memory import track_peak_memory

__all__ = [
    "LossFn",
    "OptimizerFactory",
    "StepMeasurement",
    "default_optimizer",
    "measure_step",
    "measure_step_stats",
    "measure_steps",
    "preserved_state",
    "resolve_device",
]

LossFn = Callable[[Any, Tensor], Tensor]
"""``loss_fn(model_output, targets) -> scalar loss``; the default is ``F.cross_entropy``."""
OptimizerFactory = Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]
"""``make_optimizer(trainable_parameters) -> optimizer``; the default is :func:`default_optimizer`."""


def default_optimizer(params: Iterable[nn.Parameter]) -> torch.optim.Optimizer:
    """SGD with momentum 0.9: one state tensor per parameter, as in the RevNet papers' training."""
    return torch.optim.SGD(params, lr=0.01, momentum=0.9)


@dataclass(frozen=True)
class StepMeasurement:
    """What :func:`measure_step_stats` measured."""

    step_time_s: float
    """Median seconds of a whole step (zero_grad, forward, loss, backward, optimizer step); NaN
    when no step was timed."""
    peak_bytes: int
    """Peak bytes of the step, as the module docstring defines them."""
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


def resolve_device(model: nn.Module, device: torch.device | str | None) -> torch.device:
    """The device to run on: ``device`` if given ("auto" picks CUDA when present), else the model's."""
    if device is None:
        for tensor in _model_tensors(model):
            return tensor.device
        return torch.device("cpu")
    dev = _resolve(device)
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    return dev


def measure_step(
    model: nn.Module,
    batch: tuple[Any, Tensor],
    *,
    loss_fn: LossFn = F.cross_entropy,
    make_optimizer: OptimizerFactory | None = None,
    device: torch.device | str | None = None,
    modes: str | Mapping[str, str] | None = None,
    repeats: int = 3,
    warmup: int = 2,
) -> tuple[float, int]:
    """Measure one training step of ``model`` on ``batch``: ``(median seconds, peak bytes)``.

    Args:
        model: The model, already on ``device``; it is left exactly as it was.
        batch: ``(inputs, targets)``; ``inputs`` is a tensor or a tuple of positional arguments.
            Moved to ``device`` for the measurement.
        loss_fn: ``loss_fn(model(inputs), targets)``, a scalar.
        make_optimizer: Builds the optimizer from the trainable parameters; its state counts in
            the peak. Default :func:`default_optimizer` (SGD, momentum 0.9).
        device: Where to run; default the model's device.
        modes: Modes to measure with (``"M"``, ``"C"`` or a mapping by block name, as
            :func:`revtrain.core.set_modes`); default the model's current modes.
        repeats: Timed steps; the median is reported.
        warmup: Untimed steps first (at least 1: they create the optimizer state).

    Returns:
        ``(step_time_s, peak_bytes)``; see the module docstring for what the peak counts.
    """
    m = measure_step_stats(
        model, batch, loss_fn=loss_fn, make_optimizer=make_optimizer, device=device,
        modes=modes, repeats=repeats, warmup=warmup,
    )
    return m.step_time_s, m.peak_bytes


def measure_step_stats(
    model: nn.Module,
    batch: tuple[Any, Tensor],
    *,
    loss_fn: LossFn = F.cross_entropy,
    make_optimizer: OptimizerFactory | None = None,
    device: torch.device | str | None = None,
    modes: str | Mapping[str, str] | None = None,
    repeats: int = 3,
    warmup: int = 2,
) -> StepMeasurement:
    """As :func:`measure_step`, returning every figure measured (:class:`StepMeasurement`).

    ``repeats=0`` measures the peak only; ``step_time_s`` is then NaN.
    """
    settings = {"step": modes}
    return measure_steps(
        model, batch, settings, loss_fn=loss_fn, make_optimizer=make_optimizer, device=device,
        repeats=repeats, warmup=warmup,
    )["step"]


def measure_steps(
    model: nn.Module,
    batch: tuple[Any, Tensor],
    settings: Mapping[str, str | Mapping[str, str] | None],
    *,
    loss_fn: LossFn = F.cross_entropy,
    make_optimizer: OptimizerFactory | None = None,
    device: torch.device | str | None = None,
    repeats: int = 3,
    warmup: int = 2,
) -> dict[str, StepMeasurement]:
    """Measure several mode settings of one model so that their times compare.

    The timed steps of the settings alternate (``M, C, M, C, ...``), so a change in the
    machine's load during the measurement hits each setting alike; each setting then gets one
    step under the memory tracker. One optimizer serves all settings (modes do not change the
    parameters).

    Args:
        settings: Name -> modes (``"M"``, ``"C"``, a mapping by block name, or None for the
            model's current modes), e.g. ``{"baseline-M": "M", "plan": plan.modes}``.
        model, batch, loss_fn, make_optimizer, device, repeats, warmup: As :func:`measure_step`;
            ``warmup`` steps are run per setting.

    Returns:
        A :class:`StepMeasurement` per setting, by name.
    """
    if repeats < 0:
        raise ValueError(f"repeats must be >= 0, got {repeats}")
    if warmup < 1:
        raise ValueError(f"warmup must be >= 1 (the first step creates the optimizer state), got {warmup}")
    dev = resolve_device(model, device)
    check_on_device(model, dev)
    inputs, targets = batch_to(batch, dev)
    factory = make_optimizer or default_optimizer
    results: dict[str, StepMeasurement] = {}
    with preserved_state(model):
        model.train()
        current = get_modes(model)
        optimizer = factory([p for p in model.parameters() if p.requires_grad])

        def use(modes: str | Mapping[str, str] | None) -> None:
            set_modes(model, current if modes is None else modes)

        def step() -> None:
            optimizer.zero_grad(set_to_none=True)
            loss = loss_fn(call_model(model, inputs), targets)
            loss.backward()
            optimizer.step()

        for modes in settings.values():
            use(modes)
            for _ in range(warmup):
                step()
        times: dict[str, list[float]] = {name: [] for name in settings}
        for _ in range(repeats):
            for name, modes in settings.items():
                use(modes)
                times[name].append(_timed(step, dev))

        for name, modes in settings.items():
            use(modes)
            optimizer.zero_grad(set_to_none=True)
            if dev.type == "cuda":
                torch.cuda.synchronize(dev)
                resident = torch.cuda.memory_allocated(dev)
            else:
                resident = storage_bytes(_state_tensors(model, optimizer, inputs, targets), dev)
            with track_peak_memory(dev) as mem:
                loss = loss_fn(call_model(model, inputs), targets)
                loss.backward()
                optimizer.step()
                del loss
            results[name] = StepMeasurement(
                step_time_s=statistics.median(times[name]) if times[name] else math.nan,
                peak_bytes=resident + mem.peak_bytes,
                resident_bytes=resident,
                fixed_bytes=storage_bytes(_fixed_tensors(model, optimizer), dev),
                times_s=tuple(times[name]),
                method=mem.method,
                optimizer=type(optimizer).__name__,
            )
        del optimizer
    return results


# --- helpers shared with the profiler ---------------------------------------------------------


def call_model(model: nn.Module, inputs: Any) -> Any:
    """``model(*inputs)`` for a tuple of positional arguments, else ``model(inputs)``."""
    return model(*inputs) if isinstance(inputs, tuple) else model(inputs)


def batch_to(batch: tuple[Any, Tensor], device: torch.device) -> tuple[Any, Tensor]:
    """``(inputs, targets)`` moved to ``device``; ``inputs`` may be a tuple of tensors."""
    if not isinstance(batch, (tuple, list)) or len(batch) != 2:
        raise TypeError(
            f"the batch must be a pair (inputs, targets), got {type(batch).__name__}; pass e.g. "
            "(x, y) with x of shape (B, C, H, W) and y of shape (B,)"
        )
    inputs, targets = batch

    def move(x: Any) -> Any:
        return x.to(device) if isinstance(x, Tensor) else x

    inputs = tuple(move(x) for x in inputs) if isinstance(inputs, (tuple, list)) else move(inputs)
    return inputs, move(targets)


def batch_size_of(batch: tuple[Any, Tensor]) -> int:
    """Size of the leading dimension of the batch's (first) input tensor."""
    inputs = batch[0]
    first = inputs[0] if isinstance(inputs, (tuple, list)) else inputs
    if not isinstance(first, Tensor) or first.dim() == 0:
        raise TypeError("the batch's inputs must be tensors with a leading batch dimension")
    return int(first.shape[0])


def check_on_device(model: nn.Module, device: torch.device) -> None:
    """Raise a clear error when the model's tensors are not all on ``device``."""
    elsewhere = {str(t.device) for t in _model_tensors(model) if not _same_device(t.device, device)}
    if elsewhere:
        raise ValueError(
            f"the model has tensors on {sorted(elsewhere)} but the measurement runs on {device}; "
            f"move the model first (model.to({str(device)!r}))"
        )


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


@contextlib.contextmanager
def preserved_state(model: nn.Module) -> Iterator[None]:
    """Run the body, then put the model back as it was.

    Restores parameters and buffers (values copied back into the same tensors, so optimizers
    that hold them keep working), ``.grad`` of every parameter (cleared during the body), block
    modes, every module's train/eval flag, and the CPU and CUDA random generators.
    """
    state = {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items() if isinstance(v, Tensor)}
    params = list(model.parameters())
    grads = [p.grad for p in params]
    modes = get_modes(model)
    flags = [(m, m.training) for m in model.modules()]
    cpu_rng = torch.get_rng_state()
    cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
    for p in params:
        p.grad = None
    try:
        yield
    finally:
        model.load_state_dict(state, strict=False)
        for p, g in zip(params, grads):
            p.grad = g
        if modes:
            set_modes(model, modes)
        for m, training in flags:
            m.training = training
        torch.set_rng_state(cpu_rng)
        if cuda_rng is not None:
            torch.cuda.set_rng_state_all(cuda_rng)


def timer(device: torch.device) -> Callable[[], Callable[[], float]]:
    """``start = timer(dev)(); ...; seconds = start()``: CUDA events on a GPU, else perf_counter."""
    if device.type == "cuda":

        def start_cuda() -> Callable[[], float]:
            begin = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            begin.record()

            def stop() -> float:
                end.record()
                end.synchronize()
                return begin.elapsed_time(end) / 1000.0

            return stop

        return start_cuda

    def start_cpu() -> Callable[[], float]:
        begin = time.perf_counter()
        return lambda: time.perf_counter() - begin

    return start_cpu


def _timed(fn: Callable[[], object], device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    stop = timer(device)()
    fn()
    return stop()


def _model_tensors(model: nn.Module) -> Iterator[Tensor]:
    yield from model.parameters()
    yield from model.buffers()


def _optimizer_state_tensors(optimizer: torch.optim.Optimizer) -> Iterator[Tensor]:
    for state in optimizer.state.values():
        for value in state.values():
            if isinstance(value, Tensor):
                yield value


def _fixed_tensors(model: nn.Module, optimizer: torch.optim.Optimizer) -> Iterator[Tensor]:
    yield from _model_tensors(model)
    yield from (p.grad for p in model.parameters() if p.grad is not None)
    yield from _optimizer_state_tensors(optimizer)


def _state_tensors(model: nn.Module, optimizer: torch.optim.Optimizer, inputs: Any, targets: Any) -> Iterator[Tensor]:
    yield from _fixed_tensors(model, optimizer)
    for x in (*(inputs if isinstance(inputs, tuple) else (inputs,)), targets):
        if isinstance(x, Tensor):
            yield x


def _same_device(a: torch.device, b: torch.device) -> bool:
    if a.type != b.type:
        return False
    if a.type != "cuda":
        return True
    return (a.index or 0) == (b.index if b.index is not None else torch.cuda.current_device())
