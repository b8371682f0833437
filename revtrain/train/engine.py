"""The engine seam: how one optimizer step happens, apart from everything else a run does.

The :class:`~revtrain.train.Trainer` owns the run: its config, folder, epochs, evaluation,
metrics, checkpoints, interrupts, resume and memory report. An :class:`Engine` owns how a step's
micro-batches become an update and how the processes of a run agree:

- :meth:`Engine.attach` takes the trainer's model and optimizer (restored when resuming);
- :meth:`Engine.step` runs the step's ``k`` micro-batches (after the epoch's last step nothing
  may be in flight); :meth:`Engine.all_sum` adds the task's sums over
  the processes and gives the step's loss; :meth:`Engine.apply` makes the update once the
  trainer checked the loss;
- :meth:`Engine.eval_sums` evaluates one test batch, summed over the processes;
- :meth:`Engine.settle` finishes what is in flight before a checkpoint;
  :meth:`Engine.checkpoint_store` says where and how checkpoints are written: one file in
  the single-process format (:class:`~revtrain.train.checkpoint_store.FileStore`; an engine
  whose processes hold parts of the state, such as PETRA's stages, passes the function that
  assembles them) or one ``torch.distributed.checkpoint`` folder per saved step, each process
  writing its shards (:class:`~revtrain.train.checkpoint_store.FolderStore`);
  :meth:`Engine.saved` follows every checkpoint;
- :meth:`Engine.report` adds the engine's own entries to the finished run's summary;
- :attr:`Engine.writes_files` says whether this process writes the run folder and the log.

:class:`LocalEngine` is the single process; the data-parallel engine (DDP, FSDP2) lives in
:mod:`revtrain.parallel.replicas`, PETRA's in :mod:`revtrain.parallel.petra_engine`. Both
gradient engines share :class:`GradientEngine`'s step: every micro-batch backpropagates its share
of the step's mean loss (``b / total`` of its micro-batch's mean), so the accumulated gradient
is the gradient of the whole step's mean loss. The trainer's loop never asks which engine it has.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

import torch

from revtrain.tasks import add_sums
from revtrain.train.checkpoint_store import CheckpointStore, FileStore
from revtrain.train.config import ConfigError
from revtrain.train.trainer_view import Batch, TrainerView

__all__ = ["Engine", "GradientEngine", "LocalEngine"]


class Engine(Protocol):
    """How one optimizer step happens (module docstring)."""

    writes_files: bool
    """True on the process that writes the run folder and the log (one per run)."""
    measures_memory: bool
    """Whether the summary's step memory report (one process's step alone) describes this run."""

    def describe(self) -> str:
        """How the run is spread, for the header ('' for one process)."""

    def attach(self, trainer: TrainerView) -> None:
        """Take the trainer's model and optimizer, restored when resuming (wrap, shard, check)."""

    def step(self, trainer: TrainerView, batches: Sequence[Batch]) -> tuple[torch.Tensor | None, dict[str, float]]:
        """Run one step's micro-batches; returns this process's share of the step's loss (None
        when it has none) and the task's sums of what it ran. On the epoch's last step
        (``trainer.epoch_done``) nothing may be left in flight."""

    def apply(self, trainer: TrainerView) -> None:
        """Make the step's update once the trainer checked its loss, and count it
        (:meth:`Trainer.optimizer_step`, or :meth:`Trainer.advance_schedule` for an update made elsewhere)."""

    def report(self, trainer: TrainerView) -> tuple[dict[str, Any], list[str]]:
        """The engine's own entries of the finished run's summary, and their lines for the log."""

    def all_sum(self, sums: Mapping[str, float], loss: torch.Tensor | None) -> tuple[dict[str, float], float | None]:
        """The task's sums and the step's loss added over the run's processes (None: no batch finished)."""

    def eval_sums(self, trainer: TrainerView, batch: Batch) -> dict[str, float]:
        """The task's sums over one test batch, added over the run's processes."""

    def settle(self, trainer: TrainerView) -> None:
        """Before a checkpoint: finish what is in flight, so that the state can be captured (every process calls it)."""

    def checkpoint_store(self, trainer: TrainerView) -> CheckpointStore:
        """Where and how the run's checkpoints are written (called once, before ``attach``)."""

    def saved(self) -> None:
        """Called on every process once the writer saved a checkpoint (a barrier)."""

    def agree_stop(self, signum: int | None) -> int | None:
        """The stop request of any process (a signal number), so that every process stops at the same step."""


class GradientEngine(ABC):
    """The step of engines that compute the whole model's gradients on every process: each
    micro-batch through :meth:`forward_backward`, then one optimizer update."""

    def step(self, trainer: TrainerView, batches: Sequence[Batch]) -> tuple[torch.Tensor | None, dict[str, float]]:
        trainer.optimizer.zero_grad(set_to_none=True)
        total = sum(len(b[1]) for b in batches)
        loss: torch.Tensor | float = 0.0
        sums: dict[str, float] = {}
        for i, batch in enumerate(batches):
            share, mine = trainer.forward_backward(batch, total=total, last=i == len(batches) - 1)
            loss = loss + share
            add_sums(sums, mine)
        return torch.as_tensor(loss), sums

    def apply(self, trainer: TrainerView) -> None:
        trainer.optimizer_step()

    def settle(self, trainer: TrainerView) -> None:
        pass  # nothing is in flight between two steps

    def report(self, trainer: TrainerView) -> tuple[dict[str, Any], list[str]]:
        return {}, []

    @abstractmethod
    def forward_backward(self, trainer: TrainerView, batch: Batch, total: int, *,
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


class LocalEngine(GradientEngine):
    """Every step in this process: today's single-process training."""

    writes_files = True
    measures_memory = True

    def describe(self) -> str:
        return ""

    def attach(self, trainer: TrainerView) -> None:
        refuse_stages(trainer)
        refuse_processes(trainer)

    def checkpoint_store(self, trainer: TrainerView) -> CheckpointStore:
        return FileStore(trainer)

    def forward_backward(self, trainer: TrainerView, batch: Batch, total: int, *,
                         last: bool) -> tuple[torch.Tensor, dict[str, float]]:
        x, y = trainer.on_device(batch)
        return backward_share(trainer, trainer.model, x, y, x.shape[0] / total)

    def all_sum(self, sums: Mapping[str, float], loss: torch.Tensor | None) -> tuple[dict[str, float], float | None]:
        return dict(sums), None if loss is None else float(loss)

    def eval_sums(self, trainer: TrainerView, batch: Batch) -> dict[str, float]:
        x, y = trainer.on_device(batch)
        with trainer.autocast():
            output = trainer.model(x)
        return trainer.task.batch_sums(output, y)

    def saved(self) -> None:
        pass

    def agree_stop(self, signum: int | None) -> int | None:
        return signum


def backward_share(trainer: TrainerView, model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor,
                   weight: float) -> tuple[torch.Tensor, dict[str, float]]:
    """Forward ``x``, backpropagate ``weight`` times its mean loss; returns that share and the sums."""
    with trainer.autocast():
        output = model(x)
        loss = trainer.task.loss(output, y)
    share = loss * weight
    (trainer.scaler.scale(share) if trainer.scaler is not None else share).backward()
    return share.detach(), trainer.task.batch_sums(output.detach(), y, loss.detach())


def refuse_stages(trainer: TrainerView) -> None:
    """A run configured for PETRA stages (a resumed one, say) needs the PETRA engine."""
    if trainer.config.stages is not None:
        j = trainer.config.stages
        raise ConfigError(f"this run trains {j} PETRA stages (its checkpoint holds one state per stage); pass "
                          f"--stages {j} --engine simulator to train them in one process, or --stages {j} for one "
                          "process per stage")


def refuse_processes(trainer: TrainerView) -> None:
    """A run configured for several data-parallel processes needs them (one process would write
    that it ran on N)."""
    n = trainer.config.data_parallel
    if n is not None:
        raise ConfigError(f"this run is configured for --data-parallel {n}: start it with `revtrain train "
                          f"--data-parallel {n}` (or torchrun), or drop data_parallel to train in one process")
