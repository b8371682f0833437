"""Fit a registered model and its task to a dataset: the model's input spec, overrides, the task.

The registry says what a model eats in its paper's configuration (its
:class:`~revtrain.models.inputs.InputSpec`); a dataset may differ (1x8x8 digits for a CIFAR
RevNet, another vocabulary). :func:`fit_model_to_data` replaces the spec's sample shape and
classes by the dataset's, derives the :func:`~revtrain.models.create_model` overrides from it,
and picks the task that trains on it. Nothing here looks at channels or argmax: the spec's kind
decides, through one table.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch import Tensor, nn

from revtrain.data import DatasetInfo
from revtrain.models import create_model, input_spec, model_info
from revtrain.models.inputs import InputSpec
from revtrain.models.registry import MODEL_OVERRIDES, overrides_for  # MODEL_OVERRIDES: re-exported here, where it was first defined
from revtrain.tasks import Task, get_task, task_for
from revtrain.train.config import ConfigError
from revtrain.train.user_model import build_from_path, is_import_path

__all__ = ["ModelFit", "build_model", "fit_model_to_data", "is_registered", "build_kwargs", "text_window", "MODEL_OVERRIDES"]


@dataclass(frozen=True)
class ModelFit:
    """How to build a model for a dataset, and what it learns there."""

    spec: InputSpec
    """The model's input as this dataset gives it."""
    overrides: dict[str, Any]
    """Keyword arguments of ``create_model``."""
    task: Task
    """The loss and metrics it trains with."""


def fit_model_to_data(model: str, task: str | None, info: DatasetInfo, sample_input: Tensor) -> ModelFit:
    """The spec, ``create_model`` overrides and task of ``model`` trained on a dataset.

    Args:
        model: Registered model name; any other name (a ``module:factory`` path, the label of a
            model object) takes the dataset's inputs as they are.
        task: Registered task name, or None for the task that fits the model's inputs.
        info: The dataset's description (sample shape, classes or vocabulary).
        sample_input: One batch of the dataset's inputs: its dtype tells images (float) from
            token ids (integers), as :class:`InputSpec` defines them.

    Raises:
        ConfigError: the dataset gives another kind of input than the model takes, or the task
            trains on another kind.
    """
    data_kind = "image" if sample_input.dtype.is_floating_point else "tokens"
    if not is_registered(model):  # your own model: it eats what the dataset gives
        spec = InputSpec(kind=data_kind, shape=tuple(info.input_shape), num_classes=info.num_classes,
                         dtype=sample_input.dtype)
    else:
        spec = input_spec(model)
    if data_kind != spec.kind:
        raise ConfigError(
            f"model {model} takes {spec.kind} inputs but dataset {info.name} gives {data_kind} "
            f"({sample_input.dtype}); pick a model and a dataset of the same kind (`revtrain models`)"
        )
    spec = spec.with_changes(shape=tuple(info.input_shape), num_classes=info.num_classes)
    try:
        chosen = get_task(task) if task is not None else task_for(spec)
    except ValueError as err:
        raise ConfigError(f"--task {task}: {err}") from None
    if chosen.input_kind != spec.kind:
        raise ConfigError(f"--task {chosen.name} trains on {chosen.input_kind} inputs and model {model} takes "
                          f"{spec.kind} inputs; drop --task to use the model's own task")
    return ModelFit(spec=spec, overrides=build_kwargs(model, spec), task=chosen)


def build_kwargs(model: str, spec: InputSpec) -> dict[str, Any]:
    """The ``create_model`` / factory keyword arguments that build ``model`` for inputs of
    ``spec``: the registry's (a ViT also gets its image size), or the kind's for a factory."""
    return overrides_for(model, spec) if is_registered(model) else MODEL_OVERRIDES[spec.kind](spec)


def is_registered(model: str) -> bool:
    """Whether ``model`` is a registered name (not a ``module:factory`` path or a label of a model
    object given to the Trainer)."""
    try:
        model_info(model)
    except ValueError:
        return False
    return True


def build_model(model: str, overrides: dict[str, Any]) -> nn.Module:
    """The model named by ``--model``: a registered one, or a ``module:factory`` import path, built
    with the overrides that fit it to the data (:func:`fit_model_to_data`).

    Raises:
        ConfigError: an unknown name, or an import path that does not give a model.
    """
    if is_import_path(model):
        return build_from_path(model, overrides)
    try:
        return create_model(model, **overrides)
    except ValueError as err:
        if is_registered(model):
            raise
        raise ConfigError(f"{err}; or give your own model as module:factory (docs/guide.md)") from None


def text_window(config: Any) -> dict[str, int]:
    """The ``build_dataloaders`` window option of a token model: ``--context``, or the model's own
    context (a language model cannot read windows longer than its positions). Empty for images.
    A model that is not registered gets ``--context`` as given."""
    if not is_registered(config.model):
        return {"context": config.context} if config.context is not None else {}
    spec = input_spec(config.model)
    if spec.kind != "tokens":
        if config.context is not None:
            raise ConfigError(f"--context applies to token models and {config.model} takes {spec.kind} inputs; "
                              "drop --context")
        return {}
    if config.context is None and not _takes_context(config.dataset):
        return {}  # an image dataset: fit_model_to_data names the mismatch of kinds
    context = config.context if config.context is not None else spec.shape[0]
    if context > spec.shape[0]:
        raise ConfigError(f"--context {context} is longer than {config.model}'s context of {spec.shape[0]} "
                          f"tokens; use --context {spec.shape[0]} or less")
    return {"context": context}


def _takes_context(dataset: str) -> bool:
    """Whether the registered dataset ``dataset`` reads windows (takes ``context``); True for a
    name the registry does not know (its builder decides)."""
    from revtrain.data.registry import dataset_entry

    try:
        return "context" in dataset_entry(dataset).options
    except ValueError:
        return True
