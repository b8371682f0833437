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
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar, overload

import torch
from torch import nn

__all__ = [
    "ModelInfo",
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
    num_classes: int
    """Default number of classes, the one the paper's parameter count is for."""
    input_size: tuple[int, int, int]
    """The input size ``(C, H, W)`` of the paper's configuration; others work too."""
    paper: str
    """Where the architecture comes from, e.g. ``"Gomez et al. 2017, Table 2"``."""
    paper_params: int | None = None
    """Parameter count printed in the paper (exact to its rounding), or None if it gives none."""
    description: str = ""
    """One line on what the variant is (first line of the variant function's docstring)."""


_REGISTRY: dict[str, ModelInfo] = {}


@overload
def register_model(fn: ModelFn, /) -> ModelFn: ...
@overload
def register_model(
    *,
    reversible: bool,
    dataset: str,
    num_classes: int,
    input_size: tuple[int, int, int],
    paper: str,
    paper_params: float | None = None,
) -> Callable[[ModelFn], ModelFn]: ...


def register_model(fn=None, /, **info):  # type: ignore[no-untyped-def]
    """Register a variant function under its own name.

    Use bare (``@register_model``) for a model without paper metadata, or with keyword
    arguments, the fields of :class:`ModelInfo` other than ``name``, ``builder`` and
    ``description``. ``paper_params`` may be given in any unit that reads well (``0.46e6``);
    it is stored as an int. Registering a name twice raises ``ValueError``.
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
        fields.setdefault("num_classes", 10)
        fields.setdefault("input_size", (3, 32, 32))
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
    """The :class:`ModelInfo` of a registered model; unknown names raise ``ValueError``."""
    try:
        return _REGISTRY[name]
    except KeyError:
        raise ValueError(_unknown_message(name)) from None


def create_model(name: str, **overrides: object) -> nn.Module:
    """Build a registered model, with keyword overrides of its defaults.

    Args:
        name: A name from :func:`list_models`.
        **overrides: Passed to the variant function; every zoo model accepts
            ``num_classes`` and ``in_channels``.

    Raises:
        ValueError: ``name`` is not registered; the message lists close matches.
    """
    return model_info(name).builder(**overrides)


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
