"""Load a trained model back, and export it to safetensors.

``revtrain.load(run_dir)`` rebuilds the model of a run from its latest checkpoint
(``checkpoint.pt``, or a data-parallel run's newest checkpoint folder, read whole in one process;
the model name, the classes and channels its data gave it) with the trained weights and the M/C mode of
every reversible block, in eval mode. ``revtrain.export(run_dir, out_dir)`` (``revtrain export``)
writes the weights as ``model.safetensors`` and how to rebuild them as ``model.json``; ``load``
reads such a folder too, without revtrain's checkpoint or torch pickles::

    model = revtrain.load("runs/revnet38-digits-20261127-101500")
    revtrain.export("runs/revnet38-digits-20261127-101500", "exported/")
    model = revtrain.load("exported/")

A model built from a ``module:factory`` path is rebuilt from the same path; a model object given
to the Trainer cannot be rebuilt from a name: pass a fresh one, ``load(run_dir, model=net)``,
and its weights and modes are loaded into it.

``model.json`` holds ``format`` (``"revtrain.model"``), ``version``, ``model`` (the registered
name or ``module:factory``), ``kwargs`` (what it was built with), ``input`` (kind, sample shape,
classes), ``modes``, ``check_every``, ``task``, ``data`` (normalisation and class names) and
``revtrain_version``. Exporting needs the ``safetensors`` package (``pip install
'revtrain[export]'``).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch
from torch import nn

from revtrain._version import __version__
from revtrain.core import set_modes, set_rebuild_checks
from revtrain.models.inputs import InputSpec
from revtrain.tasks import get_task
from revtrain.train.build import build_model, is_registered, build_kwargs
from revtrain.train.checkpoint import IncompatibleCheckpointError
from revtrain.train.checkpoint_folder import checkpoint_of, read_checkpoint
from revtrain.train.files import atomic_write, atomic_write_text

__all__ = ["EXPORT_FORMAT", "ModelRecipe", "export", "load", "model_recipe"]

EXPORT_FORMAT = "revtrain.model"
EXPORT_VERSION = 1
WEIGHTS_NAME = "model.safetensors"
RECIPE_NAME = "model.json"


ModelRecipe = dict[str, Any]
"""The content of ``model.json``: everything but the weights."""


def model_recipe(state: dict[str, Any]) -> ModelRecipe:
    """How to rebuild the model of a checkpoint (read by :func:`~revtrain.train.load_checkpoint`)."""
    config, data = state.get("config") or {}, state.get("data") or {}
    task = state.get("task") or config.get("task") or "classification"
    kind = get_task(task).input_kind
    spec = InputSpec(kind=kind, shape=tuple(data["input_shape"]), num_classes=int(data["num_classes"]),
                     dtype=torch.float32 if kind == "image" else torch.long)
    return {
        "format": EXPORT_FORMAT, "version": EXPORT_VERSION, "model": state["model_name"],
        "kwargs": build_kwargs(state["model_name"], spec),
        "input": {"kind": kind, "shape": list(spec.shape), "num_classes": spec.num_classes},
        "modes": dict(state.get("modes") or {}), "check_every": config.get("check_every"), "task": task,
        "data": {k: data.get(k) for k in ("name", "mean", "std", "class_names")},
        "revtrain_version": __version__,
    }


def load(source: str | os.PathLike[str], *, model: nn.Module | None = None,
         device: torch.device | str = "cpu") -> nn.Module:
    """The trained model of a run folder, a ``checkpoint.pt`` or an exported folder, in eval mode.

    Args:
        source: A run folder (its latest checkpoint is read), a checkpoint file or checkpoint
            folder, or a folder written by :func:`export` (``model.json`` + ``model.safetensors``)
            or one of its two files.
        model: A freshly built model to load into, for runs of a model object given to the
            Trainer (default: rebuilt from the recorded name or ``module:factory``).
        device: Where the model goes.

    Raises:
        CheckpointError: the checkpoint is missing, damaged, or does not fit ``model``.
        ConfigError: the recorded model cannot be rebuilt (pass ``model=``).
    """
    path = Path(source)
    if path.name in (WEIGHTS_NAME, RECIPE_NAME) and (path.parent / RECIPE_NAME).is_file():
        path = path.parent  # a file of an exported folder: the folder
    if (path / RECIPE_NAME).is_file():
        return _load_export(path, model, device)
    ckpt = checkpoint_of(path)
    state = read_checkpoint(ckpt)
    recipe = model_recipe(state)
    net = model if model is not None else _rebuild(recipe, ckpt)
    _load_weights(net, state["model"], ckpt)
    return _finish(net, recipe, device)


def export(source: str | os.PathLike[str], out_dir: str | os.PathLike[str], *, overwrite: bool = False) -> Path:
    """Write ``model.safetensors`` and ``model.json`` of a run (folder or checkpoint) into ``out_dir``.

    Raises:
        FileExistsError: ``out_dir`` holds an export already and ``overwrite`` is false.
        ImportError: the safetensors package is not installed.
    """
    try:
        from safetensors.torch import save as safetensors_bytes
    except ImportError:
        raise ImportError("exporting to safetensors needs the safetensors package: pip install "
                          "'revtrain[export]' (or pip install safetensors)") from None
    path, out = Path(source), Path(out_dir)
    ckpt = checkpoint_of(path)
    state = read_checkpoint(ckpt)
    existing = [out / n for n in (WEIGHTS_NAME, RECIPE_NAME) if (out / n).exists()]
    if existing and not overwrite:
        raise FileExistsError(f"{existing[0]} exists already; pass --overwrite (overwrite=True in Python) to "
                              f"replace the export in {out}, or choose another --out")
    weights = _unshared(state["model"])
    atomic_write(out / WEIGHTS_NAME, lambda f: f.write(safetensors_bytes(weights, metadata={"format": "pt"})),
                 what="exported weights")
    atomic_write_text(out / RECIPE_NAME, json.dumps(model_recipe(state), indent=2) + "\n", what="model recipe")
    return out


def _unshared(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Contiguous copies that share no memory (safetensors refuses shared storages; tied weights
    are stored once per name and tied again by ``load_state_dict``)."""
    return {name: t.detach().to("cpu").contiguous().clone() for name, t in weights.items()}


def _load_export(folder: Path, model: nn.Module | None, device: torch.device | str) -> nn.Module:
    from safetensors.torch import load_file

    recipe = json.loads((folder / RECIPE_NAME).read_text(encoding="utf-8"))
    if recipe.get("format") != EXPORT_FORMAT or recipe.get("version") != EXPORT_VERSION:
        raise IncompatibleCheckpointError(
            f"{folder / RECIPE_NAME} is not a revtrain model export of version {EXPORT_VERSION} (format "
            f"{recipe.get('format')!r}, version {recipe.get('version')!r}); export the run again with this revtrain"
        )
    weights_path = folder / WEIGHTS_NAME
    net = model if model is not None else _rebuild(recipe, weights_path)
    _load_weights(net, load_file(str(weights_path)), weights_path)
    return _finish(net, recipe, device)


def _rebuild(recipe: ModelRecipe, where: Path) -> nn.Module:
    name = recipe["model"]
    if not is_registered(name) and ":" not in name:
        raise IncompatibleCheckpointError(
            f"{where} holds the weights of {name!r}, a model object given to the Trainer, which no name can "
            "rebuild; build the same architecture and pass it: revtrain.load(..., model=net)"
        )
    return build_model(name, dict(recipe["kwargs"]))


def _load_weights(model: nn.Module, weights: dict[str, torch.Tensor], where: Path) -> None:
    mine = model.state_dict()
    problems = [f"{k} missing" for k in mine if k not in weights]
    problems += [f"{k} not in the model" for k in weights if k not in mine]
    problems += [f"{k} is {tuple(weights[k].shape)} there but {tuple(v.shape)} in the model"
                 for k, v in mine.items() if k in weights and weights[k].shape != v.shape]
    if problems:
        raise IncompatibleCheckpointError(f"the weights in {where} do not fit the model: {'; '.join(problems[:4])}"
                                          f"{f'; and {len(problems) - 4} more' if len(problems) > 4 else ''}")
    model.load_state_dict(weights)


def _finish(model: nn.Module, recipe: ModelRecipe, device: torch.device | str) -> nn.Module:
    set_modes(model, recipe.get("modes") or {})
    if recipe.get("check_every") is not None:
        set_rebuild_checks(model, recipe["check_every"])
    return model.to(device).eval()
