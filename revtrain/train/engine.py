"""The engine seam: how one optimizer step happens, apart from everything else a run does.

The :class:`~revtrain.train.Trainer` owns the run: its config, folder, epochs, evaluation,
metrics, checkpoints, interrupts, resume and memory report. An :class:`Engine` owns how the
gradients of a step's micro-batches are computed and how the processes of a run agree:

- :meth:`Engine.forward_backward` runs one micro-batch and backpropagates its share of the
  step's mean loss (the step's ``k`` micro-batches hold ``total`` samples; a micro-batch of
  ``b`` adds ``b / total`` of its mean loss, so the accumulated gradient is the gradient of
  the whole step's mean loss);
- :meth:`Engine.all_sum` adds the task's sums (and the loss) over the run's processes;
- :meth:`Engine.eval_sums` evaluates one test batch, summed over the processes;
- :meth:`Engine.checkpoint_store` says where and how checkpoints are written: one file in
  the single-process format (:class:`~revtrain.train.checkpoint_store.FileStore`; an engine
  whose processes hold parts of the state passes the function that assembles them) or one
  ``torch.distributed.checkpoint`` folder per saved step, each process writing its shards
  (:class:`~revtrain.train.checkpoint_store.FolderStore`);
- :attr:`Engine.writes_files` says whether this process writes the run folder and the log.

:class:`LocalEngine` is the single process; the data-parallel engine (DDP, FSDP2) lives in
:mod:`revtrain.parallel.replicas`. The trainer's loop never asks which engine it has.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Protocol

import torch

from revtrain.train.checkpoint_store import CheckpointStore, FileStore

if TYPE_CHECKING:
    from revtrain.train.trainer import Trainer

__all__ = ["Engine", "LocalEngine"]

Batch = tuple[torch.Tensor, torch.Tensor]


class Engine(Protocol):
    """How one optimizer step happens (module docstring)."""

    writes_files: bool
    """True on the process that writes the run folder and the log (one per run)."""
    measures_memory: bool
    """Whether the summary's step memory report (one process's step alone) describes this run."""

    def describe(self) -> str:
        """How the run is spread, for the header ('' for one process)."""

    def attach(self, trainer: Trainer) -> None:
        """Take the trainer's model and optimizer, restored when resuming (wrap, shard, check)."""

    def forward_backward(self, trainer: Trainer, batch: Batch, total: int, *,
                         last: bool) -> tuple[torch.Tensor, dict[str, float]]:
        """One micro-batch of a step of ``total`` samples: forward, loss, backward.

        Args:
            trainer: The run (model, task, autocast, scaler, device).
            batch: ``(inputs, targets)`` on the CPU.
            total: Samples of the whole step (every micro-batch).
            last: The step's last micro-batch (gradients may be synchronised now).

        Returns:
            This process's share of the step's mean loss (detached: ``b / total`` times its
            micro-batch's mean) and the task's sums over the part of the batch it ran.
        """

    def all_sum(self, sums: Mapping[str, float], loss: torch.Tensor) -> tuple[dict[str, float], float]:
        """The task's sums and the loss added over the run's processes."""

    def eval_sums(self, trainer: Trainer, batch: Batch) -> dict[str, float]:
        """The task's sums over one test batch, added over the run's processes."""

    def checkpoint_store(self, trainer: Trainer) -> CheckpointStore:
        """Where and how the run's checkpoints are written (called once, before ``attach``)."""

    def saved(self) -> None:
        """Called on every process once the writer saved a checkpoint file (a barrier)."""

    def agree_stop(self, signum: int | None) -> int | None:
        """The stop request of any process (a signal number), so that every process stops at the same step."""


class LocalEngine:
    """Every step in this process: today's single-process training."""

    writes_files = True
    measures_memory = True

    def describe(self) -> str:
        return ""

    def attach(self, trainer: Trainer) -> None:
        pass

    def checkpoint_store(self, trainer: Trainer) -> CheckpointStore:
        return FileStore(trainer)

    def forward_backward(self, trainer: Trainer, batch: Batch, total: int, *,
                         last: bool) -> tuple[torch.Tensor, dict[str, float]]:
        x, y = trainer.on_device(batch)
        return backward_share(trainer, trainer.model, x, y, x.shape[0] / total)

    def all_sum(self, sums: Mapping[str, float], loss: torch.Tensor) -> tuple[dict[str, float], float]:
        return dict(sums), float(loss)

    def eval_sums(self, trainer: Trainer, batch: Batch) -> dict[str, float]:
        x, y = trainer.on_device(batch)
        with trainer.autocast():
            output = trainer.model(x)
        return trainer.task.batch_sums(output, y)

    def saved(self) -> None:
        pass

    def agree_stop(self, signum: int | None) -> int | None:
        return signum


def backward_share(trainer: Trainer, model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor,
                   weight: float) -> tuple[torch.Tensor, dict[str, float]]:
    """Forward ``x``, backpropagate ``weight`` times its mean loss; returns that share and the sums."""
    with trainer.autocast():
        output = model(x)
        loss = trainer.task.loss(output, y)
    share = loss * weight
    (trainer.scaler.scale(share) if trainer.scaler is not None else share).backward()
    return share.detach(), trainer.task.batch_sums(output.detach(), y, loss.detach())
