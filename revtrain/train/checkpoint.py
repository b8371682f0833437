"""Checkpoints: written atomically, checksummed, read with errors that say what is wrong and what to do.

A checkpoint is one ``torch.save`` file (a dict) holding everything an exact resume needs (see
:class:`revtrain.train.state.TrainingState`). Only plain containers, numbers, strings and
tensors go in, so it loads with ``torch.load(weights_only=True)``: opening a checkpoint never
runs code.

Writing goes through :func:`revtrain.train.files.atomic_write`, so a crash or a full disk
mid-write leaves the previous checkpoint as it was.

Each checkpoint carries ``"sha256"``: a SHA-256 digest of its whole content (every tensor's
dtype, shape and bytes, every key, number and string, in stored order), computed before
writing and checked after reading. ``torch.save`` files have no checksum of their own, so a
flipped byte inside a tensor would otherwise load silently and change the run. A checkpoint
whose model or optimizer state holds NaN or infinity (a diverged run) is refused as well: resuming
it could only produce NaN.
"""

from __future__ import annotations

import hashlib
import os
import random
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from revtrain._version import __version__
from revtrain.errors import RevtrainError
from revtrain.train.files import atomic_write

__all__ = [
    "CHECKPOINT_FORMAT",
    "CHECKPOINT_NAME",
    "CHECKPOINT_VERSION",
    "CheckpointError",
    "CorruptCheckpointError",
    "IncompatibleCheckpointError",
    "NonFiniteCheckpointError",
    "capture_rng_state",
    "check_model_state",
    "content_digest",
    "load_checkpoint",
    "non_finite_entries",
    "restore_rng_state",
    "save_checkpoint",
]

CHECKPOINT_FORMAT = "revtrain.checkpoint"
CHECKPOINT_VERSION = 2
"""Bumped whenever the layout of the checkpoint dict changes incompatibly (2: checksum, "progress")."""
CHECKPOINT_NAME = "checkpoint.pt"
"""File name of the checkpoint inside a run folder."""


class CheckpointError(RevtrainError, ValueError):
    """A checkpoint cannot be used; the message names the file, the problem and the fix."""


class CorruptCheckpointError(CheckpointError):
    """The file is missing, truncated, not a ``torch.save`` file, or fails its checksum."""


class IncompatibleCheckpointError(CheckpointError):
    """A readable checkpoint that does not fit this run (format version, model, shapes, data)."""


class NonFiniteCheckpointError(CheckpointError):
    """The checkpoint's weights or optimizer state hold NaN or infinity."""


def save_checkpoint(state: Mapping[str, Any], path: str | os.PathLike[str]) -> Path:
    """Write ``state`` to ``path`` atomically, with format marker, version and checksum; returns the path.

    On any failure (including ``KeyboardInterrupt``) the temporary file is removed and the
    previous file at ``path``, if any, is untouched; a full disk raises
    :class:`~revtrain.train.files.DiskFullError` with a one-line message.
    """
    payload: dict[str, Any] = {
        "format": CHECKPOINT_FORMAT,
        "version": CHECKPOINT_VERSION,
        "revtrain_version": __version__,
        **state,
    }
    payload.pop("sha256", None)
    payload["sha256"] = content_digest(payload)
    return atomic_write(path, lambda f: torch.save(payload, f), what="checkpoint")


def load_checkpoint(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Read a checkpoint onto the CPU; check its format, version, checksum and finiteness.

    Raises:
        CorruptCheckpointError: missing, truncated or unreadable file, or a checksum mismatch.
        IncompatibleCheckpointError: not a revtrain training checkpoint, or another format version.
        NonFiniteCheckpointError: NaN or infinity in the model or optimizer state.
    """
    path = Path(path)
    if not path.is_file():
        what = "is a folder, not a file" if path.is_dir() else "does not exist"
        raise CorruptCheckpointError(
            f"checkpoint {path} {what}; pass a run folder or the checkpoint.pt inside one "
            "(revtrain train --resume auto finds the latest run of a model and dataset)"
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
    stored = state.pop("sha256", None)
    actual = content_digest(state)
    if stored != actual:
        raise CorruptCheckpointError(
            f"checkpoint {path} fails its checksum (stored sha256 {str(stored)[:16]}..., content "
            f"{actual[:16]}...): its bytes changed after it was written (disk or copy damage). "
            "Resume from another checkpoint (a copy of this run) or start a fresh run without --resume"
        )
    bad = non_finite_entries({"model": state.get("model"), "optimizer": state.get("optimizer")})
    if bad:
        shown = ", ".join(bad[:3]) + (f" and {len(bad) - 3} more" if len(bad) > 3 else "")
        raise NonFiniteCheckpointError(
            f"checkpoint {path} holds NaN or infinite values ({shown}): it was saved from a run "
            "that diverged, and resuming it can only produce NaN. Resume from an earlier checkpoint, "
            "or start a fresh run without --resume (with a lower --lr or a longer --warmup-epochs)"
        )
    return state


def content_digest(obj: Any) -> str:
    """SHA-256 of a checkpoint's content: keys, numbers, strings and tensor bytes, in stored order.

    Equal before ``torch.save`` and after ``torch.load`` (tensors are hashed by dtype, shape and
    values, on the CPU), different as soon as one byte of one tensor or one value changes.
    """
    digest = hashlib.sha256()
    _feed(digest, obj)
    return digest.hexdigest()


def non_finite_entries(tree: Any, prefix: str = "") -> list[str]:
    """Dotted names of the floating-point tensors in ``tree`` that hold NaN or infinity."""
    if isinstance(tree, torch.Tensor):
        if tree.is_floating_point() or tree.is_complex():
            return [] if bool(torch.isfinite(tree).all()) else [prefix or "tensor"]
        return []
    items: Any = ()
    if isinstance(tree, Mapping):
        items = tree.items()
    elif isinstance(tree, (list, tuple)):
        items = enumerate(tree)
    found: list[str] = []
    for key, value in items:
        found += non_finite_entries(value, f"{prefix}.{key}" if prefix else str(key))
    return found


def _feed(digest: Any, obj: Any) -> None:
    if isinstance(obj, torch.Tensor):
        t = obj.detach().to("cpu").contiguous()
        digest.update(f"T{t.dtype}{tuple(t.shape)}|".encode())
        if t.numel():
            digest.update(t.reshape(-1).view(torch.uint8).numpy())
    elif isinstance(obj, Mapping):
        digest.update(f"D{len(obj)}|".encode())
        for key, value in obj.items():
            _feed(digest, key)
            _feed(digest, value)
    elif isinstance(obj, (list, tuple)):  # torch.load gives back the same kind; treat them alike
        digest.update(f"L{len(obj)}|".encode())
        for value in obj:
            _feed(digest, value)
    elif isinstance(obj, (str, bytes)):
        data = obj.encode() if isinstance(obj, str) else obj
        digest.update(f"{'S' if isinstance(obj, str) else 'Y'}{len(data)}|".encode())
        digest.update(data)
    else:  # None, bool, int, float: repr is exact and stable (floats round-trip)
        digest.update(f"{type(obj).__name__}:{obj!r}|".encode())


def check_model_state(path: str | os.PathLike[str], state: Mapping[str, Any], model_name: str,
                      model: nn.Module) -> None:
    """Raise :class:`IncompatibleCheckpointError` unless the checkpoint fits ``model``.

    Compares the model name the checkpoint was written for, then every parameter and buffer
    name and shape (``model_shapes`` for a checkpoint folder read without its weights), listing
    the first differences.
    """
    saved_name = state.get("model_name")
    if saved_name != model_name:
        raise IncompatibleCheckpointError(
            f"checkpoint {path} is for model {saved_name!r} but this run builds {model_name!r}; "
            f"pass --model {saved_name} to resume it, or drop --resume to start a new run"
        )
    if state.get("model") is not None:
        saved = {k: tuple(v.shape) for k, v in state["model"].items()}
    else:  # a checkpoint folder read without its weights: state.pt lists their shapes
        saved = {k: tuple(v) for k, v in state["model_shapes"].items()}
    mine = model.state_dict()
    problems = [f"{k} missing from the checkpoint" for k in mine if k not in saved]
    problems += [f"{k} not in the model" for k in saved if k not in mine]
    problems += [
        f"{k} is {saved[k]} in the checkpoint but {tuple(v.shape)} in the model"
        for k, v in mine.items()
        if k in saved and saved[k] != tuple(v.shape)
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
