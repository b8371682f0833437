"""SGD with decoupled parameter groups, and the per-step warm-up + cosine/step schedule.

Weight decay goes to convolution and linear weights only. Norm-layer parameters and biases
get none, as in PETRA's experimental setup (Rivaud et al. 2024, §4.1, after Goyal et al. 2017):
decaying a BatchNorm scale or a bias fights the normalisation rather than regularising.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.optim.lr_scheduler import LambdaLR

from revtrain.layers import InPlaceABN

__all__ = ["param_groups", "build_optimizer", "LRSchedule", "build_scheduler", "apply_hyperparameters"]

# Layers whose parameters are normalisation scales/shifts (BatchNorm, GroupNorm, LayerNorm, ...).
_NORM_TYPES: tuple[type[nn.Module], ...] = (
    nn.modules.batchnorm._NormBase,
    nn.GroupNorm,
    nn.LayerNorm,
    nn.LocalResponseNorm,
)
if hasattr(nn, "RMSNorm"):
    _NORM_TYPES += (nn.RMSNorm,)
# In-place ABN is a batch norm: decaying its scale towards 0 would make it non-invertible.
_NORM_TYPES += (InPlaceABN,)


def param_groups(model: nn.Module, weight_decay: float) -> list[dict[str, object]]:
    """Split the trainable parameters into a ``"decay"`` and a ``"no_decay"`` group.

    A parameter gets no decay when it belongs to a normalisation layer or is named ``bias``.
    Shared parameters appear once; frozen ones (``requires_grad=False``) not at all.

    Returns:
        Two param-group dicts for a ``torch.optim`` optimizer, each with a ``"name"`` key;
        a group with no parameters is left out.
    """
    decay: list[nn.Parameter] = []
    no_decay: list[nn.Parameter] = []
    seen: set[int] = set()
    for module in model.modules():
        is_norm = isinstance(module, _NORM_TYPES)
        for name, p in module.named_parameters(recurse=False):
            if not p.requires_grad or id(p) in seen:
                continue
            seen.add(id(p))
            (no_decay if is_norm or name == "bias" else decay).append(p)
    groups = [
        {"name": "decay", "params": decay, "weight_decay": weight_decay},
        {"name": "no_decay", "params": no_decay, "weight_decay": 0.0},
    ]
    return [g for g in groups if g["params"]]


ADAMW_BETAS = (0.9, 0.95)
"""AdamW's betas: the usual choice for Transformer language models (GPT-2/3, nanoGPT)."""


def build_optimizer(
    model: nn.Module, *, lr: float, momentum: float, nesterov: bool, weight_decay: float,
    kind: str = "sgd",
) -> torch.optim.Optimizer:
    """SGD or AdamW over :func:`param_groups` (arguments as in :class:`~revtrain.train.TrainConfig`)."""
    groups = param_groups(model, weight_decay)
    if kind == "adamw":
        return torch.optim.AdamW(groups, lr=lr, betas=ADAMW_BETAS)
    if kind != "sgd":
        raise ValueError(f"unknown optimizer {kind!r}; use 'sgd' or 'adamw'")
    return torch.optim.SGD(groups, lr=lr, momentum=momentum, nesterov=nesterov)


def optimizer_factory(config: Any) -> Callable[[Iterable[torch.Tensor]], torch.optim.Optimizer]:
    """``make_optimizer(params)`` building the run's optimizer (kind and settings of a
    :class:`~revtrain.train.TrainConfig`) over plain parameters: what the planner and the memory
    report need, since the optimizer's state counts in a step's peak."""

    def make_optimizer(params: Iterable[torch.Tensor]) -> torch.optim.Optimizer:
        if config.optimizer == "adamw":
            return torch.optim.AdamW(params, lr=config.lr, betas=ADAMW_BETAS, weight_decay=config.weight_decay)
        return torch.optim.SGD(params, lr=config.lr, momentum=config.momentum, nesterov=config.nesterov,
                               weight_decay=config.weight_decay)

    return make_optimizer


@dataclass(frozen=True, kw_only=True)
class LRSchedule:
    """The learning-rate multiplier of each optimizer step (0-based), a pure function of the step.

    Linear warm-up over ``warmup_steps`` (step ``s`` gets ``(s + 1) / warmup_steps``), then
    ``"cosine"`` decay to zero at ``total_steps`` or ``"step"`` decay by ``gamma`` at each
    milestone (fractions of ``total_steps``).
    """

    total_steps: int
    """Optimizer steps in the whole run."""
    warmup_steps: int = 0
    """Steps of linear warm-up (capped at ``total_steps``)."""
    kind: str = "cosine"
    """``"cosine"`` or ``"step"``."""
    milestones: Sequence[float] = (0.5, 0.75)
    """Step schedule: fractions of ``total_steps`` where the rate drops by ``gamma``."""
    gamma: float = 0.1
    """Step schedule: the drop factor."""

    def __post_init__(self) -> None:
        if self.total_steps < 1:
            raise ValueError(f"total_steps must be >= 1, got {self.total_steps}")
        if self.kind not in ("cosine", "step"):
            raise ValueError(f"unknown schedule {self.kind!r}; use 'cosine' or 'step'")

    def factor(self, step: int) -> float:
        """Multiplier of the peak learning rate at optimizer step ``step``."""
        warmup = min(self.warmup_steps, self.total_steps)
        if step < warmup:
            return (step + 1) / warmup
        if self.kind == "cosine":
            span = max(1, self.total_steps - warmup)
            progress = min(1.0, (step - warmup) / span)
            return 0.5 * (1.0 + math.cos(math.pi * progress))
        passed = sum(step >= round(m * self.total_steps) for m in self.milestones)
        return self.gamma**passed


def build_scheduler(optimizer: torch.optim.Optimizer, schedule: LRSchedule) -> LambdaLR:
    """A :class:`~torch.optim.lr_scheduler.LambdaLR` to be stepped after every optimizer step.

    The multiplier is passed as a plain function, so the scheduler's ``state_dict`` holds only
    its position: a resumed run keeps the schedule of its (possibly extended) config.
    """
    return LambdaLR(optimizer, lambda step: schedule.factor(step))


def apply_hyperparameters(
    optimizer: torch.optim.Optimizer, scheduler: LambdaLR, schedule: LRSchedule, *,
    lr: float, momentum: float, nesterov: bool, weight_decay: float,
) -> None:
    """Put these settings over the ones a checkpoint restored (a resumed run with new options).

    The learning rate becomes ``lr`` times ``schedule``'s factor at the scheduler's position, so
    a longer or reshaped schedule continues from the step reached; weight decay goes to the
    ``"decay"`` group only, as in :func:`param_groups`.
    """
    factor = schedule.factor(scheduler.last_epoch)
    scheduler.base_lrs = [lr] * len(optimizer.param_groups)
    momentum_settings = {"momentum": momentum, "nesterov": nesterov} if isinstance(optimizer, torch.optim.SGD) else {}
    for group in optimizer.param_groups:
        group.update(initial_lr=lr, lr=lr * factor, **momentum_settings,
                     weight_decay=weight_decay if group.get("name") == "decay" else 0.0)
