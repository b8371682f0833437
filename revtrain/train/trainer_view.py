"""What an engine and a checkpoint store see of the :class:`~revtrain.train.Trainer` that drives them.

The engines (:mod:`revtrain.train.engine`, :mod:`revtrain.parallel.replicas`,
:mod:`revtrain.parallel.petra_engine`) and the checkpoint stores
(:mod:`revtrain.train.checkpoint_store`) are given the Trainer at every call; they are typed
with :class:`TrainerView`, the part of it they use, so that they need not import the Trainer
that imports them.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import nn

from revtrain.data.loader import DatasetInfo, ResumableLoader
from revtrain.tasks import Task
from revtrain.train.config import TrainConfig
from revtrain.train.optim import LRSchedule
from revtrain.train.state import Progress, TrainingState

__all__ = ["TrainerView", "FileWriter"]

Batch = tuple[torch.Tensor, torch.Tensor]


class FileWriter(Protocol):
    """What a checkpoint store asks of the run's engine."""

    writes_files: bool
    """True on the process that writes the run folder."""

    def saved(self) -> None:
        """Called on every process once the writer saved a checkpoint."""


class TrainerView(Protocol):
    """The Trainer as its engine and its checkpoint store use it (:class:`~revtrain.train.Trainer`
    documents each member)."""

    config: TrainConfig
    model: nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: Any
    scaler: torch.amp.GradScaler | None
    task: Task
    device: torch.device
    run_dir: Path
    schedule: LRSchedule
    state: TrainingState
    progress: Progress
    train_loader: ResumableLoader
    data_info: DatasetInfo
    batches_per_epoch: int
    resumed_state: dict[str, Any] | None
    engine: FileWriter

    @property
    def step(self) -> int: ...

    @property
    def history(self) -> list[dict[str, Any]]: ...

    @property
    def epoch_done(self) -> bool: ...

    def first_batch(self) -> Batch: ...

    def on_device(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]: ...

    def autocast(self) -> AbstractContextManager[Any]: ...

    def forward_backward(self, batch: Batch, *, total: int | None = None,
                         last: bool = True) -> tuple[torch.Tensor, dict[str, float]]: ...

    def optimizer_step(self) -> None: ...

    def advance_schedule(self) -> None: ...
