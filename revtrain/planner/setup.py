"""What every measurement of the planner runs on, prepared once at the planner's entry.

:func:`prepare` is the door: it resolves the device, moves the model and the example batch
there, and takes the one copy of the model's state (:class:`ModelState`) that puts the model
back as it was when the ``with`` block ends. It yields a :class:`MeasurementSetup` that every
stage receives (verify, profile, the refinement's measured peaks, the final measurement); no
stage below re-resolves the device, moves the batch again or copies the state::

    with prepare(model, (x, y), device="cpu") as setup:
        profile = profile_setup(setup)
        steps = measure_steps(setup, {"baseline-M": "M", "plan": plan.modes})
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from revtrain.core import get_modes, reversible_blocks, set_modes
from revtrain.device import resolve_device
from revtrain.planner.recompute import get_layer_options, plain_layers, set_layer_options

__all__ = [
    "LossFn",
    "MeasurementSetup",
    "ModelState",
    "Modes",
    "OptimizerFactory",
    "apply_setting",
    "call_model",
    "default_optimizer",
    "preserved_state",
    "prepare",
]

LossFn = Callable[[Any, Tensor], Tensor]
"""``loss_fn(model_output, targets) -> scalar loss``; the default is ``F.cross_entropy`` (a
:class:`revtrain.tasks.Task`'s ``loss`` method fits)."""
OptimizerFactory = Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]
"""``make_optimizer(trainable_parameters) -> optimizer``; the default is :func:`default_optimizer`."""
Modes = str | Mapping[str, str] | None
"""``"M"``, ``"C"``, a mode per block name (as :func:`revtrain.core.set_modes` takes), or None for
the modes the model had when it was prepared. A mapping may also name plain layers with
``"keep"``, ``"recompute"`` or ``"offload"`` (:mod:`revtrain.planner.recompute`); plain layers it
does not name, and every plain layer for a string, are as they were when the model was prepared."""


def default_optimizer(params: Iterable[nn.Parameter]) -> torch.optim.Optimizer:
    """SGD with momentum 0.9: one state tensor per parameter, as in the RevNet papers' training."""
    return torch.optim.SGD(params, lr=0.01, momentum=0.9)


class ModelState:
    """Everything measuring a model may change, captured once: parameter and buffer values (one
    copy, kept on the CPU so that it takes no device memory from the measurements), gradients,
    block modes, train/eval flags and the CPU and CUDA random generators."""

    def __init__(self, model: nn.Module) -> None:
        self.values = {
            k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items() if isinstance(v, Tensor)
        }
        self.grads = [(p, p.grad) for p in model.parameters()]
        self.modes = get_modes(model)
        self.layer_options = get_layer_options(model)
        self.flags = [(m, m.training) for m in model.modules()]
        self.cpu_rng = torch.get_rng_state()
        self.cuda_rng = (
            torch.cuda.get_rng_state_all() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
        )

    def reset(self, model: nn.Module) -> None:
        """Values, modes, flags and generators as captured, gradients cleared: the start of a
        measurement. Values are copied into the existing tensors, so nothing is re-allocated."""
        model.load_state_dict(self.values, strict=False)
        for p, _ in self.grads:
            p.grad = None
        if self.modes:
            set_modes(model, self.modes)
        if self.layer_options:
            set_layer_options(model, self.layer_options)
        for m, training in self.flags:
            m.training = training
        self._restore_rng()

    def restore(self, model: nn.Module) -> None:
        """Everything as captured, the gradients included."""
        self.reset(model)
        for p, g in self.grads:
            p.grad = g

    def _restore_rng(self) -> None:
        torch.set_rng_state(self.cpu_rng)
        if self.cuda_rng is not None:
            torch.cuda.set_rng_state_all(self.cuda_rng)


@contextmanager
def preserved_state(model: nn.Module) -> Iterator[ModelState]:
    """Run the body, then put the model back as it was (:class:`ModelState`): values, gradients,
    modes, train/eval flags and random generators. Optimizers that hold the model's tensors keep
    working, since values are copied back into the same tensors."""
    state = ModelState(model)
    try:
        yield state
    finally:
        state.restore(model)


@dataclass(frozen=True, kw_only=True)
class MeasurementSetup:
    """The model, the batch and the training step's parts, ready on one device.

    Made by :func:`prepare`; read-only. Every stage of the planner takes one.
    """

    model: nn.Module
    """The model, on ``device``."""
    inputs: Any
    """The batch's inputs on ``device``: a tensor, or a tuple of positional arguments."""
    targets: Any
    """The batch's targets on ``device``."""
    loss_fn: LossFn
    """``loss_fn(model(inputs), targets)``, a scalar that backward starts from."""
    make_optimizer: OptimizerFactory
    """Builds the training's optimizer, whose state counts in a step's peak."""
    device: torch.device
    """Where everything runs."""
    repeats: int
    """Timed rounds of a whole-step measurement, at least (medians are reported); 0 measures peaks
    only."""
    max_repeats: int
    """Timed rounds at most: after ``repeats`` rounds, rounds go on until every setting's median
    step is known to ``step_precision`` of itself (:func:`revtrain.timing.median_is_stable`)."""
    step_precision: float
    """See ``max_repeats``."""
    warmup: int
    """Untimed repetitions before each measurement (at least 1: it creates the optimizer state)."""
    model_name: str
    """Name recorded in profiles and plans."""
    autocast: Callable[[], AbstractContextManager[Any]] = nullcontext
    """Context of the forward and the loss, e.g. ``torch.autocast`` for mixed precision."""
    state: ModelState
    """The one copy of the model's state, taken by :func:`prepare`."""

    @property
    def batch(self) -> tuple[Any, Any]:
        """``(inputs, targets)``."""
        return self.inputs, self.targets

    @property
    def first_input(self) -> Tensor:
        """The batch's (first) input tensor."""
        return self.inputs[0] if isinstance(self.inputs, tuple) else self.inputs

    @property
    def batch_size(self) -> int:
        """Size of the leading dimension of the batch's (first) input."""
        return int(self.first_input.shape[0])

    def with_batch(self, batch: tuple[Any, Any]) -> MeasurementSetup:
        """The same setup with another batch (e.g. another batch size), moved to the device once."""
        inputs, targets = _batch_to(batch, self.device)
        return dataclasses.replace(self, inputs=inputs, targets=targets)

    def reset(self) -> None:
        """Put the model back to its prepared state before a measurement (see :meth:`ModelState.reset`):
        every measurement then starts from the same weights, statistics, modes and generators."""
        self.state.reset(self.model)

    def loss(self) -> Tensor:
        """Forward and loss of the batch, under ``autocast``."""
        with self.autocast():
            return self.loss_fn(call_model(self.model, self.inputs), self.targets)


@contextmanager
def prepare(
    model: nn.Module,
    batch: tuple[Any, Any],
    *,
    loss_fn: LossFn = F.cross_entropy,
    make_optimizer: OptimizerFactory | None = None,
    device: torch.device | str | None = None,
    repeats: int = 3,
    warmup: int = 2,
    max_repeats: int | None = None,
    step_precision: float = 0.02,
    model_name: str | None = None,
    autocast: Callable[[], AbstractContextManager[Any]] | None = None,
) -> Iterator[MeasurementSetup]:
    """Prepare ``model`` and ``batch`` for measuring; on exit the model is as it was (but moved).

    Args:
        model: The model to measure.
        batch: ``(inputs, targets)``; ``inputs`` is a tensor or a tuple of positional arguments.
        loss_fn: ``loss_fn(model(inputs), targets)``; default cross-entropy.
        make_optimizer: The training's optimizer factory; default :func:`default_optimizer`.
        device: Where to measure: ``"auto"``, ``"cpu"``, ``"cuda:1"``, a ``torch.device``; the
            model is moved there (``model.to(device)``, once). None: the model's device.
        repeats: Timed rounds per whole-step measurement, at least (``>= 0``).
        warmup: Untimed steps before each (``>= 1``).
        max_repeats: Timed rounds at most, spent only while some setting's median step is not
            yet known to ``step_precision``; default ``4 * repeats``.
        step_precision: Relative standard error of the median step at which timing stops.
        model_name: Name for profiles and plans; default the model's class name.
        autocast: Context for the forward and the loss; default none.

    Raises:
        ValueError: bad ``repeats`` or ``warmup``, a model whose tensors are not all on the
            device, or a batch that is not an ``(inputs, targets)`` pair.
    """
    if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 0:
        raise ValueError(f"repeats must be an integer >= 0, got {repeats!r}")
    if isinstance(warmup, bool) or not isinstance(warmup, int) or warmup < 1:
        raise ValueError(f"warmup must be an integer >= 1 (the first step creates the optimizer state), got {warmup!r}")
    max_repeats = 4 * repeats if max_repeats is None else max_repeats
    if isinstance(max_repeats, bool) or not isinstance(max_repeats, int) or max_repeats < repeats:
        raise ValueError(f"max_repeats must be an integer >= repeats ({repeats}), got {max_repeats!r}")
    if not step_precision > 0:
        raise ValueError(f"step_precision must be > 0, got {step_precision!r}")
    if device is None:
        dev = next((t.device for t in _model_tensors(model)), torch.device("cpu"))
    else:
        dev = resolve_device(device)
        model.to(dev)
    _check_on_device(model, dev)
    inputs, targets = _batch_to(batch, dev)
    with preserved_state(model) as state:
        yield MeasurementSetup(
            model=model, inputs=inputs, targets=targets, loss_fn=loss_fn,
            make_optimizer=make_optimizer or default_optimizer, device=dev, repeats=repeats,
            max_repeats=max_repeats, step_precision=step_precision, warmup=warmup,
            model_name=model_name or type(model).__name__,
            autocast=autocast or nullcontext, state=state,
        )


def apply_setting(model: nn.Module, modes: Modes, state: ModelState) -> None:
    """Put ``model`` in one setting of :data:`Modes`: block modes and plain-layer options, the
    ones not named as in ``state`` (the prepared model)."""
    if modes is None:
        set_modes(model, state.modes)
        set_layer_options(model, state.layer_options)
        return
    if isinstance(modes, str):
        set_modes(model, modes)
        set_layer_options(model, state.layer_options)
        return
    blocks = {name for name, _ in reversible_blocks(model)}
    layer_names = {name for name, _ in plain_layers(model)}
    set_modes(model, {**state.modes, **{k: v for k, v in modes.items() if k in blocks or k not in layer_names}})
    set_layer_options(model, {**state.layer_options, **{k: v for k, v in modes.items() if k in layer_names}})


def call_model(model: nn.Module, inputs: Any) -> Any:
    """``model(*inputs)`` for a tuple of positional arguments, else ``model(inputs)``."""
    return model(*inputs) if isinstance(inputs, tuple) else model(inputs)


def _batch_to(batch: tuple[Any, Any], device: torch.device) -> tuple[Any, Any]:
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
    first = inputs[0] if isinstance(inputs, tuple) else inputs
    if not isinstance(first, Tensor) or first.dim() == 0:
        raise TypeError("the batch's inputs must be tensors with a leading batch dimension")
    return inputs, move(targets)


def _model_tensors(model: nn.Module) -> Iterator[Tensor]:
    yield from model.parameters()
    yield from model.buffers()


def _check_on_device(model: nn.Module, device: torch.device) -> None:
    elsewhere = {str(t.device) for t in _model_tensors(model) if not _same_device(t.device, device)}
    if elsewhere:
        raise ValueError(
            f"the model has tensors on {sorted(elsewhere)} but the measurement runs on {device}; "
            f"move the model first (model.to({str(device)!r}))"
        )


def _same_device(a: torch.device, b: torch.device) -> bool:
    if a.type != b.type:
        return False
    if a.type != "cuda":
        return True
    return (a.index or 0) == (b.index if b.index is not None else torch.cuda.current_device())
