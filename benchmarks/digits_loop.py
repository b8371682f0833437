"""A small, fixed training loop on the digits for the core's measurements (exact mode, gradient
angles): the recipe of ``revtrain train``'s defaults (SGD with Nesterov momentum 0.9, lr 0.1 after
one warm-up epoch, cosine decay, weight decay 5e-4 on weights only, batch 64, 10 epochs) written
out, so that a benchmark can change the model or look at every step without the trainer."""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from revtrain.data.digits import load_digits_split

__all__ = ["DigitsRun", "train_digits", "digits_tensors"]


@dataclass
class DigitsRun:
    test_accuracy: float
    final_train_loss: float
    seconds: float
    steps: int


def digits_tensors() -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The fixed split, normalised with the training split's mean and standard deviation."""
    train_x, train_y, test_x, test_y = load_digits_split()
    mean, std = train_x.mean(), train_x.std()
    return (train_x - mean) / std, train_y, (test_x - mean) / std, test_y


def _param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    norms = (nn.BatchNorm1d, nn.BatchNorm2d, nn.GroupNorm, nn.LayerNorm)
    decay, no_decay = [], []
    for module in model.modules():
        for name, p in module.named_parameters(recurse=False):
            (no_decay if isinstance(module, norms) or name == "bias" else decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def train_digits(
    model: nn.Module,
    *,
    seed: int,
    epochs: int = 10,
    batch_size: int = 64,
    lr: float = 0.1,
    on_step: Callable[[int, nn.Module, tuple[Tensor, Tensor]], None] | None = None,
) -> DigitsRun:
    """Train ``model`` on the digits; ``on_step(step, model, batch)`` runs before each step."""
    train_x, train_y, test_x, test_y = digits_tensors()
    gen = torch.Generator().manual_seed(seed)
    opt = torch.optim.SGD(_param_groups(model, 5e-4), lr=lr, momentum=0.9, nesterov=True)
    steps_per_epoch = math.ceil(len(train_y) / batch_size)
    total, warmup = epochs * steps_per_epoch, steps_per_epoch

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        return 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(1, total - warmup)))

    sched = torch.optim.lr_scheduler.LambdaLR(opt, factor)
    loss_fn = nn.functional.cross_entropy
    start, step, loss = time.perf_counter(), 0, torch.tensor(0.0)
    model.train()
    for _ in range(epochs):
        order = torch.randperm(len(train_y), generator=gen)
        for i in range(0, len(order), batch_size):
            idx = order[i : i + batch_size]
            batch = (train_x[idx], train_y[idx])
            if on_step is not None:
                on_step(step, model, batch)
            loss = loss_fn(model(batch[0]), batch[1])
            if not torch.isfinite(loss):
                raise FloatingPointError(f"the loss became {float(loss)} at step {step}; lower the learning rate")
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
            step += 1
    model.eval()
    with torch.no_grad():
        accuracy = float((model(test_x).argmax(1) == test_y).float().mean())
    return DigitsRun(accuracy, float(loss.detach()), time.perf_counter() - start, step)
