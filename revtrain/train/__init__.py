"""Training: the :class:`Trainer`, its :class:`TrainConfig`, optimizer and schedule, checkpoints.

Example::

    from revtrain.train import TrainConfig, Trainer

    summary = Trainer(TrainConfig(model="revnet38", epochs=10)).fit()
    print(summary["test_acc"])
"""

from revtrain.train.checkpoint import (
    CheckpointError,
    CorruptCheckpointError,
    IncompatibleCheckpointError,
    load_checkpoint,
    save_checkpoint,
)
from revtrain.train.config import ConfigError, TrainConfig, field_docs
from revtrain.train.metrics import MetricsWriter, StepMemory, measure_step_memory
from revtrain.train.optim import LRSchedule, build_optimizer, build_scheduler, param_groups
from revtrain.train.runs import RUNS_ROOT, resolve_config
from revtrain.train.trainer import Trainer

__all__ = [
    "CheckpointError",
    "ConfigError",
    "CorruptCheckpointError",
    "IncompatibleCheckpointError",
    "LRSchedule",
    "MetricsWriter",
    "RUNS_ROOT",
    "StepMemory",
    "TrainConfig",
    "Trainer",
    "build_optimizer",
    "build_scheduler",
    "field_docs",
    "load_checkpoint",
    "measure_step_memory",
    "param_groups",
    "resolve_config",
    "save_checkpoint",
]
