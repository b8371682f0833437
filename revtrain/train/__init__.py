"""Training: the :class:`Trainer`, its :class:`TrainConfig`, optimizer and schedule, checkpoints.

Example::

    from revtrain.train import TrainConfig, Trainer, resolve_run

    summary = Trainer(TrainConfig(model="revnet38", epochs=10)).fit()
    print(summary["test_acc"])

    # continue that run for 10 more epochs, keeping every other setting it had
    Trainer(resolve_run({"resume": summary["run_dir"], "epochs": 20})).fit()
"""

from revtrain.train.checkpoint import (
    CheckpointError,
    CorruptCheckpointError,
    IncompatibleCheckpointError,
    NonFiniteCheckpointError,
    load_checkpoint,
    save_checkpoint,
)
from revtrain.train.config import ConfigError, TrainConfig, field_docs
from revtrain.train.divergence import TrainingDivergedError
from revtrain.train.files import DiskFullError
from revtrain.train.metrics import MetricsWriter, StepMemory, measure_step_memory
from revtrain.train.optim import LRSchedule, build_optimizer, build_scheduler, param_groups
from revtrain.train.resume import ResolvedRun, ResumeConflictError, resolve_run
from revtrain.train.runs import RUNS_ROOT, RunExistsError
from revtrain.train.state import Progress, TrainingState
from revtrain.train.interrupts import TrainingInterrupted
from revtrain.train.trainer import Trainer

__all__ = [
    "CheckpointError",
    "ConfigError",
    "CorruptCheckpointError",
    "DiskFullError",
    "IncompatibleCheckpointError",
    "LRSchedule",
    "MetricsWriter",
    "NonFiniteCheckpointError",
    "Progress",
    "RUNS_ROOT",
    "ResolvedRun",
    "ResumeConflictError",
    "RunExistsError",
    "StepMemory",
    "TrainConfig",
    "Trainer",
    "TrainingDivergedError",
    "TrainingInterrupted",
    "TrainingState",
    "build_optimizer",
    "build_scheduler",
    "field_docs",
    "load_checkpoint",
    "measure_step_memory",
    "param_groups",
    "resolve_run",
    "save_checkpoint",
]
