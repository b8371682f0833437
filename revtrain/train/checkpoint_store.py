"""Where a run's checkpoints go: one file (one process) or one folder per saved step (DCP).

An engine picks the store of its run (:meth:`~revtrain.train.engine.Engine.checkpoint_store`):

- :class:`FileStore` (single process, :class:`~revtrain.train.engine.LocalEngine`; PETRA,
  whose engine gathers the stages on rank 0): the state in the single-process format, written
  by the engine's writer to ``<run>/checkpoint.pt``; ``--keep-checkpoints K`` keeps links in
  ``<run>/checkpoints/`` (:class:`~revtrain.train.retention.CheckpointRetention`).
- :class:`FolderStore` (data-parallel runs): every process writes its part of the model and
  optimizer (rank 0 what every process holds whole) with ``torch.distributed.checkpoint``
  into ``<run>/checkpoints/step-<step>/`` (:mod:`revtrain.train.checkpoint_folder`); older
  folders are removed once the new one is in place, except, with ``--keep-checkpoints K``,
  those of the last K evaluated epochs and a copy of the best in ``<run>/checkpoints/best/``.

The trainer calls :meth:`CheckpointStore.prepare` (every process; the weights' finiteness,
agreed by every process) and then :meth:`CheckpointStore.save` (every process).
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

from revtrain.train.checkpoint import CHECKPOINT_NAME, non_finite_entries, save_checkpoint
from revtrain.train.checkpoint_folder import (
    CHECKPOINTS_FOLDER,
    FOLDER_PARTS,
    checkpoint_folders,
    folder_tensors,
    latest_checkpoint,
    local_non_finite,
    save_folder,
    step_folder,
)
from revtrain.train.retention import CheckpointRetention
from revtrain.train.trainer_view import TrainerView

__all__ = ["CheckpointStore", "FileStore", "FolderStore"]


class CheckpointStore(Protocol):
    """How a run's checkpoints are written (module docstring)."""

    def latest(self) -> Path | None:
        """The checkpoint a resume of this run would continue from, or None."""

    def prepare(self, state: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
        """The captured state as this store saves it, and the names of its non-finite weights
        (the same on every process)."""

    def save(self, state: dict[str, Any], path: str | os.PathLike[str] | None) -> Path:
        """Write ``prepare``'s state (to ``path``, or the run's own place with retention); every
        process calls it; returns what was written."""


class FileStore:
    """``<run>/checkpoint.pt`` in the single-process format, written by the engine's writer.

    Args:
        trainer: The run.
        full_state: Turns the captured state into the single-process format (every process
            calls it; an engine whose processes hold parts of the model gathers them here).
    """

    def __init__(self, trainer: TrainerView,
                 full_state: Callable[[dict[str, Any]], dict[str, Any]] | None = None) -> None:
        self.trainer, self.full_state = trainer, full_state
        self.path = trainer.run_dir / CHECKPOINT_NAME
        self.retention = _retention(trainer)

    def latest(self) -> Path | None:
        return latest_checkpoint(self.trainer.run_dir)

    def prepare(self, state: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
        if self.full_state is None:
            return state, non_finite_entries(state["model"])
        state = self.full_state(state)  # the processes held parts (PETRA's stages): agree on what any saw
        return state, local_non_finite(state["model"])

    def save(self, state: dict[str, Any], path: str | os.PathLike[str] | None) -> Path:
        target = Path(path) if path is not None else self.path
        engine = self.trainer.engine
        if engine.writes_files:
            save_checkpoint(state, target)
            if path is None and self.retention is not None:
                self.retention.after_save(target, self.trainer.step, self.trainer.history)
        engine.saved()
        return target


def _retention(trainer: TrainerView) -> CheckpointRetention | None:
    """The run's ``--keep-checkpoints`` rule over its checkpoints folder (None: keep only the latest)."""
    n = trainer.config.keep_checkpoints
    return CheckpointRetention(trainer.run_dir / CHECKPOINTS_FOLDER, n, f"test_{trainer.task.headline}",
                               trainer.task.higher_is_better) if n else None


class FolderStore:
    """One ``torch.distributed.checkpoint`` folder per saved step (module docstring)."""

    def __init__(self, trainer: TrainerView) -> None:
        # Imported now, not in the first save: a save that a stop signal asks for should not
        # wait for torch to import DCP (seconds on a busy machine).
        import torch.distributed.checkpoint  # noqa: F401
        import torch.distributed.checkpoint.state_dict  # noqa: F401

        self.trainer = trainer
        self.keep = trainer.config.keep_checkpoints or 0
        self.rank = _retention(trainer)

    def latest(self) -> Path | None:
        return latest_checkpoint(self.trainer.run_dir)

    def prepare(self, state: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
        t = self.trainer
        tensors = folder_tensors(t.model, t.optimizer)
        rest = {k: v for k, v in state.items() if k not in FOLDER_PARTS}
        return {**rest, "tensors": tensors}, local_non_finite(tensors["model"])

    def save(self, state: dict[str, Any], path: str | os.PathLike[str] | None) -> Path:
        t = self.trainer
        writer = t.engine.writes_files
        own = path is None
        target = step_folder(t.run_dir, t.step) if own else Path(path)  # type: ignore[arg-type]
        rest = {k: v for k, v in state.items() if k != "tensors"}
        save_folder(target, state["tensors"], rest, writer=writer)
        if writer and own:
            (t.run_dir / CHECKPOINT_NAME).unlink(missing_ok=True)  # an earlier single-process phase's: superseded
            self._retain(target, t.step, t.history)
        t.engine.saved()  # no process goes on before the old folders are gone
        return target

    def _retain(self, newest: Path, step: int, history: Sequence[Mapping[str, Any]]) -> None:
        """Remove the folders no longer kept: all but ``newest``, and, with ``--keep-checkpoints K``,
        the last K evaluated steps' folders; refresh ``best/`` when ``step`` is the best."""
        keep = {step}
        if self.rank is not None:
            keep |= {int(r["step"]) for r in history[-self.keep:]}
            best = self.rank.best(history)
            if best is not None and best.get("step") == step and history and history[-1].get("step") == step:
                _copy_folder(newest, newest.parent / "best")
        for old_step, folder in checkpoint_folders(self.trainer.run_dir):
            if old_step not in keep:
                shutil.rmtree(folder, ignore_errors=True)
        for stale in newest.parent.glob(".step-*"):  # killed saves' leftovers (.tmp) and replaced folders (.old)
            shutil.rmtree(stale, ignore_errors=True)


def _copy_folder(source: Path, target: Path) -> None:
    """``target`` becomes a copy of the folder ``source`` (hard links where possible), replaced
    only once complete."""
    tmp = target.with_name(f".{target.name}.tmp")
    old = target.with_name(f".{target.name}.old")
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(source, tmp, copy_function=_link_or_copy)
    shutil.rmtree(old, ignore_errors=True)
    if target.exists():
        os.replace(target, old)
    os.replace(tmp, target)
    shutil.rmtree(old, ignore_errors=True)


def _link_or_copy(src: str, dst: str) -> None:
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)
