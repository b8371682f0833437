"""Checkpoints: written atomically, read with errors that say what is wrong and what to do.

A checkpoint is one ``torch.save`` file (a dict) holding everything an exact resume needs:
model and optimizer state, the scheduler's position, the random generators (torch CPU and
CUDA, Python's ``random``, NumPy's global generator), the training loader's position, the
trainer's counters and the config. Only plain containers, numbers, strings and tensors go in,
so it loads with ``torch.load(weights_only=True)``: opening a checkpoint never runs code.

Writing goes to a temporary file in the same folder, is flushed and fsync'ed, and then
``os.replace``'d over the old file, so a crash or a full disk mid-write leaves the previous
checkpoint as it was.
"""

from __future__ import annotations

import os
import random
import tempfile
import warnings
from collections.abc import Mapping
from contextlib import suppress
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from revtrain._version import __version__
from revtrain.errors import RevtrainError

__all__ = [
    "CHECKPOINT_FORMAT",
    "CHECKPOINT_NAME",
    "CHECKPOINT_VERSION",
    "CheckpointError",
    "CorruptCheckpointError",
    "IncompatibleCheckpointError",
    "capture_rng_state",
    "check_model_state",
    "find_latest_checkpoint",
    "load_checkpoint",
    "restore_rng_state",
    "save_checkpoint",
]

CHECKPOINT_FORMAT = "revtrain.checkpoint"
CHECKPOINT_VERSION = 1
"""Bumped whenever the layout of the checkpoint dict changes incompatibly."""
CHECKPOINT_NAME = "checkpoint.pt"
"""File name of the checkpoint inside a run folder."""


class CheckpointError(RevtrainError, ValueError):
    """A checkpoint cannot be used; the message names the file, the problem and the fix."""


class CorruptCheckpointError(CheckpointError):
    """The file is missing, truncated, or not a ``torch.save`` file at all."""


class IncompatibleCheckpointError(CheckpointError):
    """A readable checkpoint that does not fit this run (format version, model, shapes, data)."""


def save_checkpoint(state: Mapping[str, Any], path: str | os.PathLike[str]) -> Path:
    """Write ``state`` to ``path`` atomically; returns the path.

    The format marker and version are added to the saved dict. On any failure (including
    ``KeyboardInterrupt``) the temporary file is removed and the previous file at ``path``, if
    any, is untouched.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    payload = {
        "format": CHECKPOINT_FORMAT,
        "version": CHECKPOINT_VERSION,
        "revtrain_version": __version__,
        **state,
    }
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(payload, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    _fsync_dir(path.parent)
    return path


def load_checkpoint(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Read a checkpoint onto the CPU and check its format marker and version.

    Raises:
        CorruptCheckpointError: missing, truncated or unreadable file.
        IncompatibleCheckpointError: not a revtrain training checkpoint, or another format version.
    """
    path = Path(path)
    if not path.is_file():
        what = "is a folder, not a file" if path.is_dir() else "does not exist"
        raise CorruptCheckpointError(
            f"checkpoint {path} {what}; pass the checkpoint.pt inside a run folder, or "
            "--resume auto to pick the newest run of this model and dataset"
        )
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # torch raises RuntimeError, EOFError, KeyError, UnpicklingError...
        reason = str(err).strip().splitlines()[0][:160] if str(err).strip() else type(err).__name__
        raise CorruptCheckpointError(
            f"cannot read checkpoint {path} ({path.stat().st_size} bytes): it is truncated, "
            f"corrupt or not a torch.save file ({type(err).__name__}: {reason}). Checkpoints are "
            "written atomically, so this file was damaged or replaced afterwards; resume from "
            "another checkpoint or start a fresh run without --resume"
        ) from None
    if not isinstance(state, dict) or state.get("format") != CHECKPOINT_FORMAT:
        found = state.get("format") if isinstance(state, dict) else type(state).__name__
        raise IncompatibleCheckpointError(
            f"{path} is not a revtrain training checkpoint (format {found!r}, expected "
            f"{CHECKPOINT_FORMAT!r}); pass a checkpoint.pt written by `revtrain train`"
        )
    if state.get("version") != CHECKPOINT_VERSION:
        raise IncompatibleCheckpointError(
            f"checkpoint {path} has format version {state.get('version')!r} (written by revtrain "
            f"{state.get('revtrain_version', '?')}); this revtrain {__version__} reads version "
            f"{CHECKPOINT_VERSION}. Resume it with the revtrain version that wrote it, or start a "
            "fresh run without --resume"
        )
    return state


def check_model_state(path: str | os.PathLike[str], state: Mapping[str, Any], model_name: str,
                      model: nn.Module) -> None:
    """Raise :class:`IncompatibleCheckpointError` unless the checkpoint fits ``model``.

    Compares the model name the checkpoint was written for, then every parameter and buffer
    name and shape, listing the first differences.
    """
    saved_name = state.get("model_name")
    if saved_name != model_name:
        raise IncompatibleCheckpointError(
            f"checkpoint {path} is for model {saved_name!r} but this run builds {model_name!r}; "
            f"pass --model {saved_name} to resume it, or drop --resume to start a new run"
        )
    saved: Mapping[str, torch.Tensor] = state["model"]
    mine = model.state_dict()
    problems = [f"{k} missing from the checkpoint" for k in mine if k not in saved]
    problems += [f"{k} not in the model" for k in saved if k not in mine]
    problems += [
        f"{k} is {tuple(saved[k].shape)} in the checkpoint but {tuple(v.shape)} in the model"
        for k, v in mine.items()
        if k in saved and saved[k].shape != v.shape
    ]
    if problems:
        shown = "; ".join(problems[:4]) + (f"; and {len(problems) - 4} more" if len(problems) > 4 else "")
        raise IncompatibleCheckpointError(
            f"checkpoint {path} does not fit {model_name}: {shown}. It was saved with other "
            "model settings (dataset classes, input channels); resume with the dataset and "
            "options of the run that wrote it"
        )


def capture_rng_state() -> dict[str, Any]:
    """The state of every random generator a training step may draw from."""
    np_state = np.random.get_state()
    state: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "python": random.getstate(),
        "numpy": {
            "keys": torch.from_numpy(np_state[1].astype(np.int64)),
            "pos": int(np_state[2]),
            "has_gauss": int(np_state[3]),
            "cached_gaussian": float(np_state[4]),
        },
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng_state(state: Mapping[str, Any]) -> None:
    """Inverse of :func:`capture_rng_state`. CUDA states are restored where CUDA is in use."""
    torch.set_rng_state(state["torch"])
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    np_state = state["numpy"]
    np.random.set_state((
        "MT19937",
        np_state["keys"].numpy().astype(np.uint32),
        np_state["pos"],
        np_state["has_gauss"],
        np_state["cached_gaussian"],
    ))
    cuda = state.get("cuda")
    if cuda and torch.cuda.is_available():
        count = min(len(cuda), torch.cuda.device_count())
        for index in range(count):
            torch.cuda.set_rng_state(cuda[index], index)


def find_latest_checkpoint(runs_root: str | os.PathLike[str], model: str, dataset: str) -> Path | None:
    """The newest ``<runs_root>/<model>-<dataset>-*/checkpoint.pt`` (by modification time), or None."""
    candidates = list(Path(runs_root).glob(f"{model}-{dataset}-*/{CHECKPOINT_NAME}"))
    return max(candidates, key=lambda p: p.stat().st_mtime) if candidates else None


def _fsync_dir(folder: Path) -> None:
    """Make the rename durable (POSIX); a no-op where folders cannot be opened (Windows)."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
