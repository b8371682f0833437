"""The model registry: ``@register_model``, ``create_model``, ``list_models``, ``model_info``.

Each zoo model is a short variant function decorated with :func:`register_model`, in the
style of timm's ``_registry.py``: the function's name is the model's name, and the decorator
records what the paper says about it (parameter count, dataset, input size, reference). The
CLI's ``--model`` choices, the tests and ``docs/models.md`` all read this one registry.

Example::

    from revtrain.models import create_model, list_models

    list_models("revnet*")                      # ['revnet104', 'revnet110', ...]
    model = create_model("revnet38", num_classes=10, in_channels=1)
"""

from __future__ import annotations

import difflib
import fnmatch
import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar, overload

import torch
from torch import Tensor, nn

from revtrain.models.inputs import InputKind, InputSpec, image_input

__all__ = [
    "MODEL_OVERRIDES",
    "ModelInfo",
    "create_model_for",
    "example_batch",
    "input_spec",
    "overrides_for",
    "register_model",
    "create_model",
    "list_models",
    "model_info",
    "count_params",
]

ModelFn = TypeVar("ModelFn", bound=Callable[..., nn.Module])


@dataclass(frozen=True, kw_only=True)
class ModelInfo:
    """What the registry knows about a model, beyond how to build it."""

    name: str
    """Registered name, the variant function's name (``"revnet38"``)."""
    builder: Callable[..., nn.Module]
    """The variant function; ``builder(**overrides)`` returns the model."""
    reversible: bool
    """Whether the model contains reversible blocks (RevNets) or none (ResNets)."""
    dataset: str
    """The dataset the paper's configuration targets (``"CIFAR-10"``, ``"ImageNet"``)."""
    inputs: InputSpec
    """What the model eats in the paper's configuration (shape, dtype, classes or vocabulary);
    :func:`example_batch` builds batches from it. Other sizes work too."""
    paper: str
    """Where the architecture comes from, e.g. ``"Gomez et al. 2017, Table 2"``."""
    paper_params: int | None = None
    """Parameter count printed in the paper (exact to its rounding), or None if it gives none."""
    description: str = ""
    """One line on what the variant is (first line of the variant function's docstring)."""

    @property
    def num_classes(self) -> int:
        """Default number of classes (or vocabulary size), the one the paper's count is for."""
        return self.inputs.num_classes

    @property
    def input_size(self) -> tuple[int, ...]:
        """The shape of one sample in the paper's configuration: ``(C, H, W)`` or ``(T,)``."""
        return self.inputs.shape


_REGISTRY: dict[str, ModelInfo] = {}


@overload
def register_model(fn: ModelFn, /) -> ModelFn: ...
@overload
def register_model(
    *,
    reversible: bool,
    dataset: str,
    num_classes: int | None = None,
    input_size: tuple[int, int, int] | None = None,
    inputs: InputSpec | None = None,
    paper: str,
    paper_params: float | None = None,
) -> Callable[[ModelFn], ModelFn]: ...


def register_model(fn=None, /, **info):  # type: ignore[no-untyped-def]
    """Register a variant function under its own name.

    Use bare (``@register_model``) for a model without paper metadata, or with keyword
    arguments, the fields of :class:`ModelInfo` other than ``name``, ``builder`` and
    ``description``. The input is either ``inputs=`` (an :class:`InputSpec`, e.g. token ids)
    or, for image classifiers, ``input_size=(C, H, W)`` and ``num_classes=``.
    ``paper_params`` may be given in any unit that reads well (``0.46e6``); it is stored as an
    int. Registering a name twice raises ``ValueError``.
    """

    def decorate(builder: ModelFn) -> ModelFn:
        name = builder.__name__
        if name in _REGISTRY:
            raise ValueError(f"model {name!r} is registered twice; rename one variant function")
        fields = dict(info)
        if fields.get("paper_params") is not None:
            fields["paper_params"] = round(fields["paper_params"])
        fields.setdefault("reversible", False)
        fields.setdefault("dataset", "unspecified")
        num_classes = fields.pop("num_classes", None)
        input_size = fields.pop("input_size", None)
        if fields.get("inputs") is None:
            c, h, w = input_size or (3, 32, 32)
            fields["inputs"] = image_input(c, h, w, num_classes or 10)
        elif input_size is not None or num_classes is not None:
            raise ValueError(f"model {name!r}: give either inputs= or input_size=/num_classes=, not both")
        fields.setdefault("paper", "")
        doc = (builder.__doc__ or "").strip().splitlines()
        _REGISTRY[name] = ModelInfo(
            name=name, builder=builder, description=doc[0] if doc else "", **fields
        )
        return builder

    if fn is not None:
        return decorate(fn)
    return decorate


def list_models(pattern: str = "*") -> list[str]:
    """Registered model names matching a shell-style ``pattern`` (``"revnet*"``), sorted."""
    return sorted(name for name in _REGISTRY if fnmatch.fnmatchcase(name, pattern))


def model_info(name: str) -> ModelInfo:
    """The :class:`ModelInfo` of a registered model; unknown names raise ``ValueError``.

    Dashes read as underscores (``"revformer-small"`` is ``revformer_small``): names are
    Python function names, and command lines read better with dashes.
    """
    info = _REGISTRY.get(name) or _REGISTRY.get(name.replace("-", "_"))
    if info is None:
        raise ValueError(_unknown_message(name))
    return info


def create_model(name: str, **overrides: object) -> nn.Module:
    """Build a registered model, with keyword overrides of its defaults.

    Args:
        name: A name from :func:`list_models`.
        **overrides: Passed to the variant function: every image model accepts
            ``num_classes`` and ``in_channels``, every language model ``vocab_size`` and
            ``context`` (:data:`MODEL_OVERRIDES` says which a kind of input gets).

    Raises:
        ValueError: ``name`` is not registered; the message lists close matches.
    """
    return model_info(name).builder(**overrides)


MODEL_OVERRIDES: dict[InputKind, Callable[[InputSpec], dict[str, Any]]] = {
    "image": lambda spec: {"num_classes": spec.num_classes, "in_channels": spec.shape[0]},
    "tokens": lambda spec: {"vocab_size": spec.vocab_size, "context": spec.shape[0]},
}
"""The ``create_model`` keyword arguments that fit a model of each input kind to an input spec:
classes and channels for images (convolutions take any height and width), vocabulary and context
for token models (the context is the sequence length the spec's batches have)."""


def create_model_for(name: str, spec: InputSpec, **overrides: object) -> nn.Module:
    """Build the registered model ``name`` for inputs of ``spec`` (:data:`MODEL_OVERRIDES`), e.g. a
    language model whose context is the spec's sequence length; ``overrides`` come on top.

    An image model whose builder takes ``image_size`` (a ViT: its patch grid and position table
    are fixed when it is built) also gets the spec's side, for square images.
    """
    return create_model(name, **{**overrides_for(name, spec), **overrides})


def overrides_for(name: str, spec: InputSpec) -> dict[str, Any]:
    """The ``create_model`` keyword arguments that build the registered model ``name`` for inputs
    of ``spec`` (what :func:`create_model_for` passes)."""
    fit = MODEL_OVERRIDES[spec.kind](spec)
    if (spec.kind == "image" and len(spec.shape) == 3 and spec.shape[1] == spec.shape[2]
            and "image_size" in inspect.signature(model_info(name).builder).parameters):
        fit["image_size"] = spec.shape[1]
    return fit


def input_spec(
    name: str, *, input_size: tuple[int, ...] | None = None, num_classes: int | None = None
) -> InputSpec:
    """The input specification of a registered model, with the sample shape or classes replaced.

    Use the same replacements you pass to :func:`create_model` (e.g. ``input_size=(1, 8, 8),
    num_classes=10`` for a CIFAR model built with ``in_channels=1`` for digits).
    """
    return model_info(name).inputs.with_changes(shape=input_size, num_classes=num_classes)


def example_batch(
    name: str,
    batch_size: int,
    device: torch.device | str = "cpu",
    *,
    seed: int = 0,
    input_size: tuple[int, ...] | None = None,
    num_classes: int | None = None,
) -> tuple[Tensor, Tensor]:
    """A random ``(inputs, targets)`` batch that the registered model ``name`` accepts.

    Built from the model's :class:`~revtrain.models.inputs.InputSpec` (see
    :meth:`InputSpec.example`): the same for the same ``seed``, on ``device``.
    ``input_size`` and ``num_classes`` replace the spec's, as in :func:`input_spec`.
    """
    spec = input_spec(name, input_size=input_size, num_classes=num_classes)
    return spec.example(batch_size, device, seed=seed)


def count_params(name: str, **overrides: object) -> int:
    """Parameters of a registered model, built on the ``meta`` device (no memory, no init)."""
    with torch.device("meta"):
        model = create_model(name, **overrides)
    return sum(p.numel() for p in model.parameters())


def _unknown_message(name: str) -> str:
    close = difflib.get_close_matches(name, list(_REGISTRY), n=5, cutoff=0.5)
    if not close:  # fall back to a shared prefix, e.g. "revnet" for "revnet-38"
        stem = name.rstrip("0123456789-_").lower()
        close = [n for n in list_models() if stem and n.startswith(stem)][:5]
    hint = f"did you mean: {', '.join(close)}; " if close else ""
    return f"unknown model {name!r}; {hint}see `revtrain models` for the full list"
