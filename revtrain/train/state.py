"""What a checkpoint holds, gathered from its owners and handed back to them.

:class:`TrainingState` is the checkpoint component of a run: it knows the model (weights and
the mode of every reversible block) and a set of named stateful parts (optimizer, scheduler,
gradient scaler, training loader, :class:`Progress`), each with ``state_dict()`` and
``load_state_dict()``. :meth:`TrainingState.capture` assembles the checkpoint dict;
:meth:`TrainingState.restore` checks that a checkpoint fits and loads it back into the parts.
Another kind of training (stage-parallel, several optimizers) passes other parts; the
assembly stays the same.

:class:`Progress` holds the trainer's counters: steps, the epoch's running sums, the history
of evaluated epochs, and the measured time and memory of the run over all its processes.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Protocol

from torch import nn

from revtrain.core import get_modes, set_modes
from revtrain.data import DatasetInfo
from revtrain.train.checkpoint import (
    IncompatibleCheckpointError,
    capture_rng_state,
    check_model_state,
    restore_rng_state,
)
from revtrain.train.checkpoint_folder import load_folder_tensors
from revtrain.train.config import TrainConfig
from revtrain.train.metrics import EpochStats

__all__ = ["REQUIRED_PARTS", "Progress", "Stateful", "TrainingState"]

REQUIRED_PARTS = ("optimizer", "scheduler", "train_loader", "progress")
"""Parts a checkpoint must hold to resume a run exactly (a gradient scaler may be absent: None)."""


class Stateful(Protocol):
    """Anything a checkpoint can hold: ``state_dict()`` and ``load_state_dict(state)``."""

    def state_dict(self) -> Any: ...

    def load_state_dict(self, state: Any, /) -> Any: ...


class Progress:
    """The trainer's counters, saved in every checkpoint.

    Totals (``step``, ``train_time_s``, ``samples_seen``, ``wall_time_s``, the peak memory) are
    over every process that trained this run: a resumed run continues them. A process's wall
    time runs from the start of ``fit()`` to the end of training (the final checkpoint), and
    counts up to its last checkpoint when the process was killed (the time after it is lost).
    """

    def __init__(self) -> None:
        self.step = 0
        """Optimizer steps taken so far (over all epochs)."""
        self.pending_eval: int | None = None
        """An epoch whose training is done but whose evaluation is not (yet) recorded."""
        self.epoch = EpochStats()
        """Running sums of the epoch being trained."""
        self.history: list[dict[str, Any]] = []
        """One record per evaluated epoch (the ``"epoch"`` lines of metrics.jsonl)."""
        self.train_time_s = 0.0
        """Seconds spent in training steps (data, forward, backward, update), all processes."""
        self.samples_seen = 0
        """Training samples processed, all processes."""
        self.peak_memory: tuple[int, str] = (0, "")
        """Highest live memory reading of a training step in any process: (bytes, what it measures)."""
        self.processes = 0
        """Processes that have trained this run (this one included once it started)."""
        self.reference_loss: float | None = None
        """The run's first training loss: the divergence bound is a multiple of it."""
        self._wall_before = 0.0
        self._process_start: float | None = None
        self._process_end: float | None = None

    def start_process(self) -> None:
        """Count this process and start its wall clock (called when training starts)."""
        self.processes += 1
        self._process_start, self._process_end = time.perf_counter(), None

    def stop_process(self) -> None:
        """Stop this process's wall clock (training is over; the final report is not training)."""
        self._process_end = time.perf_counter()

    @property
    def process_wall_time_s(self) -> float:
        """Wall time of this process between :meth:`start_process` and :meth:`stop_process` (or now)."""
        if self._process_start is None:
            return 0.0
        return (self._process_end or time.perf_counter()) - self._process_start

    @property
    def wall_time_s(self) -> float:
        """Wall time of every process of this run, this one up to now."""
        return self._wall_before + self.process_wall_time_s

    def note_memory(self, reading: tuple[int | None, str]) -> None:
        """Keep the highest memory reading."""
        if reading[0] is not None and reading[0] > self.peak_memory[0]:
            self.peak_memory = (reading[0], reading[1])

    def state_dict(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "pending_eval": self.pending_eval,
            "epoch_stats": self.epoch.to_dict(),
            "history": self.history,
            "train_time_s": self.train_time_s,
            "samples_seen": self.samples_seen,
            "wall_time_s": self.wall_time_s,
            "peak_memory_bytes": self.peak_memory[0],
            "peak_memory_kind": self.peak_memory[1],
            "processes": self.processes,
            "reference_loss": self.reference_loss,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.step = int(state["step"])
        self.pending_eval = state["pending_eval"]
        self.epoch = EpochStats(**state["epoch_stats"])
        self.history = list(state["history"])
        self.train_time_s = float(state["train_time_s"])
        self.samples_seen = int(state["samples_seen"])
        self._wall_before = float(state["wall_time_s"])
        self._process_start = self._process_end = None
        self.peak_memory = (int(state["peak_memory_bytes"]), str(state["peak_memory_kind"]))
        self.processes = int(state["processes"])
        self.reference_loss = state["reference_loss"]


class TrainingState:
    """The checkpoint component: assemble a checkpoint from a run's parts, and restore it into them.

    Args:
        model: The model; its weights and block modes are saved.
        model_name: Its registry name (a checkpoint of another model is refused by name).
        parts: Named stateful parts (``"optimizer"``, ``"scheduler"``, ``"train_loader"``,
            ``"progress"``, ...). A part that is None (no gradient scaler) is saved as None and
            skipped on restore; so is a part whose saved state is None.
        data_info: The dataset's description (a checkpoint of another dataset is refused).
        task_name: The task trained (saved for the record).
    """

    def __init__(self, *, model: nn.Module, model_name: str, parts: Mapping[str, Stateful | None],
                 data_info: DatasetInfo, task_name: str) -> None:
        self.model, self.model_name, self.parts = model, model_name, dict(parts)
        self.data_info, self.task_name = data_info, task_name
        self.tensors_restored = False
        """Whether :meth:`restore_tensors` loaded a checkpoint folder's tensors already."""

    def capture(self, config: TrainConfig) -> dict[str, Any]:
        """Everything an exact resume needs (the checkpoint's content)."""
        return {
            "model_name": self.model_name,
            "model": self.model.state_dict(),
            "modes": get_modes(self.model),
            **{name: part.state_dict() if part is not None else None for name, part in self.parts.items()},
            "rng": capture_rng_state(),
            "config": config.to_dict(),
            "data": self.data_info.to_dict(),
            "task": self.task_name,
        }

    def restore(self, state: Mapping[str, Any], path: str | Path) -> None:
        """Load a checkpoint read by :func:`~revtrain.train.checkpoint.load_checkpoint` into the parts.

        Raises:
            IncompatibleCheckpointError: another model, other shapes, another dataset, or a part
                that refuses its state (the loader's batch size, say); nothing names a fix better
                than the message.
        """
        check_model_state(path, state, self.model_name, self.model)
        in_folder = set(state.get("folder_parts", ()))  # loaded later by restore_tensors
        missing = [name for name, part in self.parts.items()
                   if part is not None and name not in in_folder
                   and (state.get(name) is None if name in REQUIRED_PARTS else name not in state)]
        if missing:
            raise IncompatibleCheckpointError(
                f"checkpoint {path} holds no {' or '.join(missing)} state, so it cannot continue the run "
                "exactly (a fresh optimizer or data position would change it silently). Resume from a "
                "checkpoint.pt written by `revtrain train`, or start a new run without --resume "
                "(revtrain.load reads the weights of a run folder)"
            )
        saved_data = state.get("data", {})
        if saved_data.get("name") not in (None, self.data_info.name):
            raise IncompatibleCheckpointError(
                f"checkpoint {path} was trained on {saved_data['name']!r}, this run loads "
                f"{self.data_info.name!r}; pass --dataset {saved_data['name']} to resume it"
            )
        try:
            if state.get("model") is not None:
                self.model.load_state_dict(state["model"])
            set_modes(self.model, state["modes"])
            for name, part in self.parts.items():
                if part is not None and state.get(name) is not None:
                    part.load_state_dict(state[name])
        except (ValueError, KeyError, RuntimeError) as err:
            raise IncompatibleCheckpointError(
                f"checkpoint {path} does not fit this run: {err}. Resume with the options of the "
                "run that wrote it (its config.json), or start a fresh run without --resume"
            ) from None
        restore_rng_state(state["rng"])

    def restore_tensors(self, state: Mapping[str, Any], path: str | Path | None) -> None:
        """Load a checkpoint folder's model and optimizer (read by
        :func:`~revtrain.train.checkpoint_folder.load_folder_tensors`) into the model and the
        ``"optimizer"`` part, once they are wrapped or sharded; a no-op for a checkpoint file,
        which :meth:`restore` loaded whole, and once loaded (an engine that cuts the model, as
        PETRA's, loads them before). Every process of the run calls it."""
        if self.tensors_restored or state.get("model") is not None or "model_shapes" not in state:
            return
        assert path is not None
        load_folder_tensors(path, state, self.model, self.parts.get("optimizer"))  # type: ignore[arg-type]
        self.tensors_restored = True
