"""Per-stage files of a PETRA checkpoint: each stage's optimizer, schedule and counters.

A PETRA run's checkpoint is the Trainer's ``checkpoint.pt`` (the whole model's weights, the
loader's position, the run's progress; :meth:`~revtrain.train.Trainer.save_checkpoint`) plus one
file per stage with what only that stage's process holds: its units' parameters and buffers,
its optimizer and learning-rate scheduler, its update counters
(:meth:`~revtrain.parallel.worker.StageWorker.state_dict`). Each stage's process writes its
own file before ``checkpoint.pt`` is written; ``checkpoint.pt`` names the step of its stage files
(``"petra": {"step": ...}``), so a run killed at any moment resumes from the last complete
checkpoint. Files of other steps are removed once ``checkpoint.pt`` moved on.

Layout of ``<run>/checkpoints/``::

    stage0-step120.pt  stage1-step120.pt  ...   one per stage

Every stage file is a revtrain checkpoint (:func:`revtrain.train.checkpoint.save_checkpoint`:
format version and SHA-256 checksum, written to a temporary name and renamed); reading one
checks its checksum and that its weights are finite.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from revtrain.train.checkpoint import NonFiniteCheckpointError, load_checkpoint, non_finite_entries, save_checkpoint

__all__ = ["stage_file", "save_stage", "load_stage", "prune"]


def stage_file(directory: str | os.PathLike[str], stage: int, step: int) -> Path:
    """The file of ``stage`` in the checkpoint taken after ``step`` optimizer steps."""
    return Path(directory) / f"stage{stage}-step{step}.pt"


def save_stage(directory: str | os.PathLike[str], stage: int, step: int, state: dict[str, Any]) -> Path:
    """Write one stage's state atomically; returns the file."""
    path = stage_file(directory, stage, step)
    path.parent.mkdir(parents=True, exist_ok=True)
    return save_checkpoint({"step": step, "stage": stage, **state}, path)


def load_stage(directory: str | os.PathLike[str], stage: int, step: int) -> dict[str, Any]:
    """The state of ``stage`` saved at ``step``.

    Raises:
        CheckpointError: the file is missing, damaged (checksum), of another format, or not finite.
    """
    path = stage_file(directory, stage, step)
    state = load_checkpoint(path)  # exists, format, checksum, finite optimizer state
    bad = non_finite_entries(state.get("worker", {}).get("units"))
    if bad:
        raise NonFiniteCheckpointError(
            f"stage checkpoint {path} holds NaN or infinite weights ({', '.join(bad[:3])}): it was saved "
            "from a run that diverged; resume from an earlier run or start afresh with a lower --lr"
        )
    return state


def prune(directory: str | os.PathLike[str], stage: int, keep_step: int) -> None:
    """Remove ``stage``'s files of steps other than ``keep_step``."""
    for path in Path(directory).glob(f"stage{stage}-step*.pt"):
        if path != stage_file(directory, stage, keep_step):
            path.unlink(missing_ok=True)
