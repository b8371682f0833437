"""Checkpoint folders: the distributed runs' checkpoints, written by ``torch.distributed.checkpoint``.

A data-parallel run (DDP or FSDP2) saves each checkpoint as a folder
``<run>/checkpoints/step-<step>/``::

    .metadata, __0_0.distcp, __1_0.distcp ...   model and optimizer tensors (DCP: every rank
                                                writes its own shards, rank 0 what every rank
                                                holds whole; no rank gathers the model)
    state.pt                                    everything else an exact resume needs (progress,
                                                loader position, schedule, RNG, config, block
                                                modes), a single-process checkpoint without the
                                                model and optimizer (:func:`save_checkpoint`)
    manifest.json                               size and SHA-256 of every file above, written last

A folder is written under a temporary name (``.step-<step>.tmp``) and renamed into place once
the manifest is written, so a crash mid-save leaves the previous checkpoint folder as it was; a
folder without a manifest, or whose files do not match it, is refused with a message that names
it. DCP reshards on load: a folder written by N processes loads into M processes (sharded or
not), or into one process without any process group (:func:`read_checkpoint`, what
``revtrain.load`` and ``revtrain export`` use).

:func:`latest_checkpoint` finds what a run resumes from: ``checkpoint.pt`` (a single-process
run) when present, else the newest complete checkpoint folder.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import warnings
from collections.abc import Mapping
from contextlib import suppress
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from revtrain.train.checkpoint import (
    CHECKPOINT_NAME,
    CheckpointError,
    CorruptCheckpointError,
    NonFiniteCheckpointError,
    load_checkpoint,
    non_finite_entries,
    save_checkpoint,
)
from revtrain.train.files import atomic_write_text

__all__ = [
    "CHECKPOINTS_FOLDER",
    "FOLDER_FORMAT",
    "FOLDER_PARTS",
    "MANIFEST_NAME",
    "STATE_NAME",
    "checkpoint_folders",
    "checkpoint_of",
    "folder_tensors",
    "is_checkpoint_folder",
    "latest_checkpoint",
    "load_folder_tensors",
    "read_checkpoint",
    "run_dir_of",
    "save_folder",
    "step_folder",
]

FOLDER_FORMAT = "revtrain.checkpoint-folder"
FOLDER_VERSION = 1
CHECKPOINTS_FOLDER = "checkpoints"
"""The folder of a run that holds its checkpoint folders (and the kept single-file checkpoints)."""
MANIFEST_NAME = "manifest.json"
STATE_NAME = "state.pt"
FOLDER_PARTS = ("model", "optimizer")
"""The parts of a checkpoint folder held in its DCP files rather than in ``state.pt``."""

_STEP = re.compile(r"^(?:\.)?step-(\d+)(\.old)?$")


def step_folder(run_dir: str | os.PathLike[str], step: int) -> Path:
    """``<run_dir>/checkpoints/step-<step, 8 digits>``."""
    return Path(run_dir) / CHECKPOINTS_FOLDER / f"step-{step:08d}"


def run_dir_of(checkpoint: str | os.PathLike[str]) -> Path:
    """The run folder a checkpoint belongs to: ``checkpoint.pt``'s folder; the grandparent of
    what lives in ``<run>/checkpoints/`` (a checkpoint folder, or a kept ``step-*.pt`` or
    ``best.pt``)."""
    path = Path(checkpoint)
    return path.parent.parent if path.is_dir() or path.parent.name == CHECKPOINTS_FOLDER else path.parent


def is_checkpoint_folder(path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` is a checkpoint folder, complete or not (it has a manifest or DCP metadata)."""
    path = Path(path)
    return path.is_dir() and ((path / MANIFEST_NAME).is_file() or (path / ".metadata").is_file())


def checkpoint_folders(run_dir: str | os.PathLike[str]) -> list[tuple[int, Path]]:
    """The complete checkpoint folders of a run, ``(step, folder)`` by step.

    A folder counts once its manifest is written. A ``.step-<n>.old`` folder (a save replacing
    the folder of the same step was killed between its two renames) stands in for a missing
    ``step-<n>``.
    """
    root = Path(run_dir) / CHECKPOINTS_FOLDER
    found: dict[int, Path] = {}
    if not root.is_dir():
        return []
    for path in sorted(root.iterdir()):
        match = _STEP.match(path.name)
        if not match or not (path / MANIFEST_NAME).is_file():
            continue
        if path.name.startswith(".") != bool(match.group(2)):  # ".step-n" or "step-n.old": not ours
            continue
        step = int(match.group(1))
        if match.group(2) is None or step not in found:
            found[step] = path
    return sorted(found.items())


def latest_checkpoint(run_dir: str | os.PathLike[str]) -> Path | None:
    """What resuming the run in ``run_dir`` continues: ``checkpoint.pt`` if there is one (a
    data-parallel save removes it), else the newest checkpoint folder; None if neither."""
    file = Path(run_dir) / CHECKPOINT_NAME
    if file.is_file():
        return file
    folders = checkpoint_folders(run_dir)
    return folders[-1][1] if folders else None


def checkpoint_of(source: str | os.PathLike[str]) -> Path:
    """The checkpoint ``source`` names: itself (a file or checkpoint folder), or a run folder's
    latest (:func:`latest_checkpoint`; ``checkpoint.pt`` when it has none, for the error)."""
    path = Path(source)
    if not path.is_dir() or is_checkpoint_folder(path):
        return path
    return latest_checkpoint(path) or path / CHECKPOINT_NAME


# -- saving ------------------------------------------------------------------------------------


def folder_tensors(model: nn.Module, optimizer: torch.optim.Optimizer | None) -> dict[str, Any]:
    """What a checkpoint folder's DCP files hold: ``{"model": ..., "optimizer": ...}`` keyed by
    parameter names (``get_state_dict``; sharded tensors stay sharded). An optimizer without
    state yet (before the first step, or plain SGD) is left out: asking for its state would
    make torch initialise it with a step of zero gradients."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    out: dict[str, Any] = {"model": get_model_state_dict(model)}
    if optimizer is not None and optimizer.state:
        out["optimizer"] = get_optimizer_state_dict(model, optimizer)
    return out


def local_non_finite(tensors: Mapping[str, Any]) -> list[str]:
    """Names of NaN or infinite tensors among ``tensors``, agreed by every process (each checks
    its own shards; the names of all are gathered)."""
    bad = non_finite_entries(_local(tensors))
    if dist.is_initialized() and dist.get_world_size() > 1:
        every: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(every, bad)
        bad = sorted({name for names in every for name in names})
    return bad


def save_folder(path: str | os.PathLike[str], tensors: Mapping[str, Any], state: Mapping[str, Any], *,
                writer: bool) -> Path:
    """Write a checkpoint folder at ``path`` (every process of the run calls it; ``writer`` is
    the one that writes ``state.pt`` and the manifest); returns ``path``.

    ``state`` is the checkpoint without ``model`` and ``optimizer``; ``tensors`` is
    :func:`folder_tensors`. A folder of the same name is replaced only once the new one is
    complete.
    """
    import torch.distributed.checkpoint as dcp

    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp")
    grouped = dist.is_initialized()
    if writer:
        shutil.rmtree(tmp, ignore_errors=True)  # left by a killed save
        tmp.mkdir(parents=True)
    if grouped:
        dist.barrier()
    # A tensor every process holds (DDP's weights, every buffer) is written once, from rank 0's
    # copy (the data-parallel engine keeps the buffers equal on every process).
    planner = dcp.DefaultSavePlanner(dedup_save_to_lowest_rank=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "assuming the intent is to save in a single process"
        dcp.save(dict(tensors), checkpoint_id=str(tmp), no_dist=not grouped, planner=planner)
    if writer:
        shapes = {k: list(v.shape) for k, v in tensors["model"].items() if isinstance(v, torch.Tensor)}
        record = {**state, "model": None, "optimizer": None, "model_shapes": shapes,
                  "folder_parts": [name for name in FOLDER_PARTS if name in tensors]}
        save_checkpoint(record, tmp / STATE_NAME)
        files = sorted(p.name for p in tmp.iterdir() if p.is_file())
        manifest = {"format": FOLDER_FORMAT, "version": FOLDER_VERSION, "step": state.get("progress", {}).get("step"),
                    "processes": dist.get_world_size() if grouped else 1,
                    "files": {name: {"bytes": (tmp / name).stat().st_size, "sha256": _file_digest(tmp / name)}
                              for name in files}}
        atomic_write_text(tmp / MANIFEST_NAME, json.dumps(manifest, indent=1) + "\n", what="checkpoint manifest")
        _install(tmp, path)
    if grouped:
        dist.barrier()
    return path


def _install(tmp: Path, path: Path) -> None:
    """Rename the finished ``tmp`` to ``path``; an older ``path`` steps aside as ``.<name>.old``
    until then (:func:`checkpoint_folders` falls back on it if a crash comes between)."""
    old = path.with_name(f".{path.name}.old")
    shutil.rmtree(old, ignore_errors=True)
    if path.exists():
        os.replace(path, old)
    os.replace(tmp, path)
    shutil.rmtree(old, ignore_errors=True)
    _fsync_dir(path.parent)


def _file_digest(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _fsync_dir(folder: Path) -> None:
    with suppress(OSError):
        fd = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


# -- reading -----------------------------------------------------------------------------------


def read_checkpoint(path: str | os.PathLike[str], *, weights: bool = True) -> dict[str, Any]:
    """Read a checkpoint file or folder onto the CPU, checked (:func:`load_checkpoint` for a file).

    For a folder, every file is checked against the manifest first. With ``weights`` the whole
    model's tensors are read into ``state["model"]`` (one process, no process group needed);
    without, ``state["model"]`` is None and the model and optimizer are loaded later, into the
    live (possibly sharded) objects, by :func:`load_folder_tensors`.

    Raises:
        CorruptCheckpointError: a missing, partial or damaged file or folder.
        IncompatibleCheckpointError: not a revtrain checkpoint, or another format version.
        NonFiniteCheckpointError: NaN or infinity in the weights.
    """
    path = Path(path)
    if not path.is_dir():
        return load_checkpoint(path)
    _verify(path)
    try:
        state = load_checkpoint(path / STATE_NAME)
    except CheckpointError as err:
        raise type(err)(f"checkpoint folder {path}: {err}") from None
    if weights:
        state["model"] = _read_model(path)
        bad = non_finite_entries(state["model"], "model")
        if bad:
            raise NonFiniteCheckpointError(
                f"checkpoint folder {path} holds NaN or infinite weights ({', '.join(bad[:3])}): it was saved "
                "from a run that diverged. Use an earlier checkpoint, or start a fresh run without --resume"
            )
    return state


def _verify(path: Path) -> dict[str, Any]:
    """The folder's manifest, once every file it lists is there with its size and SHA-256."""
    fix = ("resume from the run folder (it picks the newest complete checkpoint), from another "
           "checkpoint folder of the run, or start a fresh run without --resume")
    manifest_path = path / MANIFEST_NAME
    if not manifest_path.is_file():
        raise CorruptCheckpointError(
            f"checkpoint folder {path} has no {MANIFEST_NAME}: its save did not finish (the process was "
            f"killed while writing it) or it is not a revtrain checkpoint folder; {fix}"
        )
    try:
        manifest = json.loads(manifest_path.read_text(encoding="utf-8"))
        files = dict(manifest["files"])
    except (ValueError, KeyError, TypeError) as err:
        raise CorruptCheckpointError(f"checkpoint folder {path}: {MANIFEST_NAME} is unreadable ({err}); {fix}") from None
    if manifest.get("format") != FOLDER_FORMAT or manifest.get("version") != FOLDER_VERSION:
        raise CorruptCheckpointError(
            f"checkpoint folder {path} is not a revtrain checkpoint folder of version {FOLDER_VERSION} (format "
            f"{manifest.get('format')!r}, version {manifest.get('version')!r}); {fix}"
        )
    for name, want in files.items():
        file = path / name
        if not file.is_file():
            raise CorruptCheckpointError(f"checkpoint folder {path} lacks {name}, listed in its manifest: the "
                                         f"folder was changed after it was written; {fix}")
        size = file.stat().st_size
        if size != want["bytes"] or _file_digest(file) != want["sha256"]:
            raise CorruptCheckpointError(
                f"checkpoint folder {path}: {name} fails its checksum ({size} bytes, the manifest says "
                f"{want['bytes']}): its bytes changed after it was written (disk or copy damage); {fix}"
            )
    return manifest


def _read_model(path: Path) -> dict[str, torch.Tensor]:
    """The whole model's tensors of a checkpoint folder, in one process."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    metadata = dcp.FileSystemReader(str(path)).read_metadata()
    model = {key[len("model."):]: torch.empty(tuple(meta.size), dtype=meta.properties.dtype)
             for key, meta in metadata.state_dict_metadata.items()
             if key.startswith("model.") and isinstance(meta, TensorStorageMetadata)}
    tree = {"model": model}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(tree, checkpoint_id=str(path), no_dist=True)
    return tree["model"]


def load_folder_tensors(path: str | os.PathLike[str], state: Mapping[str, Any], model: nn.Module,
                        optimizer: torch.optim.Optimizer | None) -> None:
    """Load a checkpoint folder's model and optimizer into the live ones (every process of the
    run calls it, after the model is wrapped or sharded): DCP reads each process's part.

    The optimizer's hyper-parameters (learning rate, momentum, weight decay) stay as they are:
    the trainer set them for this run (options given on resume included). A folder saved before
    the optimizer had state leaves the optimizer fresh.

    Raises:
        NonFiniteCheckpointError: NaN or infinity in what was loaded (on every process).
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    grouped = dist.is_initialized()
    tree: dict[str, Any] = {"model": get_model_state_dict(model)}
    with_optimizer = optimizer is not None and "optimizer" in state.get("folder_parts", ())
    if with_optimizer:
        assert optimizer is not None
        settings = [{k: v for k, v in group.items() if k != "params"} for group in optimizer.param_groups]
        tree["optimizer"] = get_optimizer_state_dict(model, optimizer)  # a template: torch initialises the state
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(tree, checkpoint_id=str(path), no_dist=not grouped)
    bad = local_non_finite(tree)
    if bad:
        raise NonFiniteCheckpointError(
            f"checkpoint folder {path} holds NaN or infinite values ({', '.join(bad[:3])}): it was saved from a "
            "run that diverged. Resume from an earlier checkpoint, or start a fresh run without --resume"
        )
    set_model_state_dict(model, tree["model"])
    if with_optimizer:
        assert optimizer is not None
        set_optimizer_state_dict(model, optimizer, tree["optimizer"])
        for group, kept in zip(optimizer.param_groups, settings):
            group.update(kept)


def _local(tree: Any) -> Any:
    """``tree`` with every sharded tensor replaced by this process's shard."""
    if hasattr(tree, "to_local"):
        return tree.to_local()
    if isinstance(tree, Mapping):
        return {k: _local(v) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return [_local(v) for v in tree]
    return tree
