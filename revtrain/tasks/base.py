"""The task seam: what a model learns, separate from how it is trained.

A :class:`Task` owns the loss that backward starts from, the metrics reported per step and
per epoch, and the example batch a planner or a memory report uses. The trainer, the planner
and stage-parallel training take a task instead of hard-coding cross-entropy and accuracy, so
a new kind of learning (language modelling with bits per byte, say) is a new task, not a
branch inside the training loop.

Metrics are built from *sums*: :meth:`Task.batch_sums` returns additive quantities for one
batch (always ``"loss_sum"`` and ``"count"``); sums over any number of batches (an epoch, an
evaluation, several processes) are added key by key and turned into metrics once by
:meth:`Task.summarize`. That keeps epoch metrics exact whatever the batch sizes.
"""

from __future__ import annotations

import abc
from collections.abc import Mapping
from typing import ClassVar

import torch
from torch import Tensor

from revtrain.models.inputs import InputKind, InputSpec

__all__ = ["Task", "add_sums"]


class Task(abc.ABC):
    """Loss, metrics and example inputs of one kind of learning problem."""

    name: ClassVar[str]
    """Registered name (``"classification"``, ``"language_modeling"``)."""
    input_kind: ClassVar[InputKind]
    """The :class:`~revtrain.models.inputs.InputSpec` kind this task trains on."""
    headline: ClassVar[str]
    """The metric shown first in progress lines and summaries (``"acc"``, ``"bpb"``)."""
    higher_is_better: ClassVar[bool]
    """Whether a larger ``headline`` is better (accuracy) or worse (bits per byte)."""

    @abc.abstractmethod
    def loss(self, output: Tensor, target: Tensor) -> Tensor:
        """The mean loss of the batch, a scalar that backward starts from."""

    @abc.abstractmethod
    def batch_sums(self, output: Tensor, target: Tensor, loss: Tensor | None = None) -> dict[str, float]:
        """Additive statistics of one batch, computed without a graph.

        Must contain ``"loss_sum"`` (the loss summed over the ``count`` items) and ``"count"``
        (items the loss averages over: samples, or tokens). ``loss`` is this batch's
        :meth:`loss` when the caller already has it, to avoid computing it twice.
        """

    @abc.abstractmethod
    def summarize(self, sums: Mapping[str, float]) -> dict[str, float]:
        """Metrics from sums added over batches: ``"loss"``, ``headline`` and any others."""

    def format(self, metrics: Mapping[str, float]) -> str:
        """One short human-readable line of metrics (``"loss 0.1234 acc 97.50%"``)."""
        return f"loss {metrics['loss']:.4f} {self.headline} {metrics[self.headline]:.4f}"

    def samples(self, target: Tensor) -> int:
        """Samples in a batch (for samples per second): the batch dimension of the target."""
        return int(target.shape[0])

    def example_batch(self, spec: InputSpec, batch_size: int, device: torch.device | str = "cpu",
                      *, seed: int = 0) -> tuple[Tensor, Tensor]:
        """A random batch the task can train on, shaped as ``spec`` says."""
        if spec.kind != self.input_kind:
            raise ValueError(f"the {self.name} task trains on {self.input_kind!r} inputs, and this "
                             f"model takes {spec.kind!r}; pick the task that fits the model")
        return spec.example(batch_size, device, seed=seed)


def add_sums(total: dict[str, float], batch: Mapping[str, float]) -> dict[str, float]:
    """Add one batch's sums into ``total`` (in place) and return it."""
    for key, value in batch.items():
        total[key] = total.get(key, 0.0) + float(value)
    return total
