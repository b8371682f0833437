"""Per-stage checkpoints of a PETRA run: one file per stage, one manifest that completes them.

Checkpoints are taken at the end of an epoch, after the pipeline drained and every stage
applied its pending accumulation (:meth:`~revtrain.parallel.worker.StageWorker.flush`), so
nothing is in flight: a stage's file holds its units' parameters and buffers, its optimizer
and learning-rate scheduler, and its update counters; the first stage's file also holds the
data loader's position.

Layout of ``<run>/checkpoints/``::

    stage0-epoch3.pt  stage1-epoch3.pt  ...   one per stage, written by that stage's process
    latest.json                               {"epoch": 3, "num_stages": 2, "files": [...]}

Every stage file is a revtrain checkpoint (:func:`revtrain.train.checkpoint.save_checkpoint`:
format version and SHA-256 checksum, written to a temporary name and renamed, atomic on POSIX);
reading one checks its checksum and that its weights are finite. The manifest is written last, once every stage's file exists, so a run killed at any moment resumes from the
last complete epoch. The files of the previous epoch are removed after the manifest moved on.
The simulator and the multi-process engine write and read the same files, so a run can be
continued by either.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from revtrain.parallel.errors import PipelineConfigError
from revtrain.train.checkpoint import NonFiniteCheckpointError, load_checkpoint, non_finite_entries, save_checkpoint

__all__ = ["stage_file", "save_stage", "write_manifest", "read_manifest", "load_stage", "prune"]

MANIFEST = "latest.json"


def stage_file(directory: str | os.PathLike[str], stage: int, epoch: int) -> Path:
    """The file of ``stage`` after ``epoch`` completed epochs."""
    return Path(directory) / f"stage{stage}-epoch{epoch}.pt"


def save_stage(directory: str | os.PathLike[str], stage: int, epoch: int, state: dict[str, Any]) -> Path:
    """Write one stage's state atomically; returns the file."""
    path = stage_file(directory, stage, epoch)
    path.parent.mkdir(parents=True, exist_ok=True)
    return save_checkpoint({"epoch": epoch, "stage": stage, **state}, path)


def write_manifest(directory: str | os.PathLike[str], epoch: int, num_stages: int) -> None:
    """Declare the checkpoint of ``epoch`` complete (call once every stage file is written)."""
    files = [stage_file(directory, s, epoch).name for s in range(num_stages)]
    missing = [f for f in files if not (Path(directory) / f).exists()]
    if missing:
        raise RuntimeError(f"cannot complete the checkpoint of epoch {epoch}: {', '.join(missing)} missing")
    tmp = Path(directory) / f"{MANIFEST}.tmp{os.getpid()}"
    tmp.write_text(json.dumps({"epoch": epoch, "num_stages": num_stages, "files": files}))
    os.replace(tmp, Path(directory) / MANIFEST)


def read_manifest(directory: str | os.PathLike[str]) -> dict[str, Any] | None:
    """The last complete checkpoint's manifest, or None when there is none."""
    path = Path(directory) / MANIFEST
    if not path.exists():
        return None
    return json.loads(path.read_text())


def load_stage(directory: str | os.PathLike[str], stage: int, num_stages: int) -> dict[str, Any] | None:
    """The state of ``stage`` in the last complete checkpoint, or None when there is none.

    Raises:
        PipelineConfigError: the checkpoint was written for another number of stages.
        CheckpointError: a stage file is damaged (checksum), of another format, or not finite.
    """
    manifest = read_manifest(directory)
    if manifest is None:
        return None
    if manifest["num_stages"] != num_stages:
        raise PipelineConfigError(
            f"the checkpoint in {directory} has {manifest['num_stages']} stages, this run {num_stages}; "
            "resume with the same number of stages and split"
        )
    path = stage_file(directory, stage, manifest["epoch"])
    state = load_checkpoint(path)  # format, checksum, finite optimizer state
    bad = non_finite_entries(state.get("units"))
    if bad:
        raise NonFiniteCheckpointError(
            f"stage checkpoint {path} holds NaN or infinite weights ({', '.join(bad[:3])}): it was saved "
            "from a run that diverged; resume from an earlier run or start afresh with a lower --lr"
        )
    return state


def prune(directory: str | os.PathLike[str], stage: int, keep_epoch: int) -> None:
    """Remove ``stage``'s files of epochs other than ``keep_epoch``."""
    for path in Path(directory).glob(f"stage{stage}-epoch*.pt"):
        if path != stage_file(directory, stage, keep_epoch):
            path.unlink(missing_ok=True)
