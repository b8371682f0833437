"""The dataset registry: ``@register_dataset`` on a builder, ``list_datasets()``, ``--dataset NAME``.

A builder returns the train and test splits (:class:`~revtrain.data.loader.DatasetSplits`) and
takes, as keyword arguments, the options of :func:`revtrain.data.build_datasets` it understands:
``data_dir``, ``augment``, ``image_size``, ``seed``, ``context``, and synthetic's
``input_shape``, ``num_classes``, ``train_size``, ``test_size``. Its signature is the contract:
an option a user gives that the builder does not take is refused by name, and options left
unset are not passed, so the builder's defaults apply::

    @register_dataset("shapes", description="my 16x16 shapes, 3 classes")
    def shapes(*, data_dir=None, augment=None, image_size=None) -> DatasetSplits:
        ...

    revtrain train --dataset shapes        # once the module that registers it is imported

Names are matched without case, ``-`` or ``_`` (``cifar-10`` is ``cifar10``).
"""

from __future__ import annotations

import difflib
import fnmatch
import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from revtrain.data.loader import DatasetSplits

__all__ = ["DatasetEntry", "build_registered", "dataset_entry", "list_datasets", "register_dataset"]

DatasetBuilder = Callable[..., DatasetSplits]


@dataclass(frozen=True)
class DatasetEntry:
    """A registered dataset: its name, its builder and what the builder accepts."""

    name: str
    builder: DatasetBuilder
    description: str
    options: frozenset[str]
    """Keyword arguments the builder takes."""


_REGISTRY: dict[str, DatasetEntry] = {}


def _key(name: str) -> str:
    return name.lower().replace("-", "").replace("_", "")


def register_dataset(name: str, *, description: str = "") -> Callable[[DatasetBuilder], DatasetBuilder]:
    """Register ``builder`` under ``name`` (a decorator); the builder is returned unchanged.

    Raises:
        ValueError: the name is taken by another builder.
    """

    def decorate(builder: DatasetBuilder) -> DatasetBuilder:
        key = _key(name)
        existing = _REGISTRY.get(key)
        if existing is not None and existing.builder is not builder:
            raise ValueError(f"dataset {name!r} is registered already (by {existing.builder.__module__}."
                             f"{existing.builder.__qualname__}); choose another name")
        params = inspect.signature(builder).parameters.values()
        options = frozenset(p.name for p in params if p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD))
        doc = description or (inspect.getdoc(builder) or "").split("\n")[0]
        _REGISTRY[key] = DatasetEntry(name=name, builder=builder, description=doc, options=options)
        return builder

    return decorate


def list_datasets(pattern: str = "*") -> list[str]:
    """Registered dataset names matching a shell-style pattern, in registration order."""
    return [e.name for e in _REGISTRY.values() if fnmatch.fnmatch(e.name, pattern)]


def dataset_entry(name: str) -> DatasetEntry:
    """The registered dataset ``name``.

    Raises:
        ValueError: no dataset has that name (the message lists the registered ones).
    """
    entry = _REGISTRY.get(_key(name))
    if entry is None:
        close = difflib.get_close_matches(name, list_datasets(), n=3)
        hint = f" (did you mean {', '.join(close)}?)" if close else ""
        raise ValueError(f"unknown dataset {name!r}; choose one of {', '.join(list_datasets())}{hint}")
    return entry


def build_registered(name: str, given: dict[str, Any], seed: int) -> DatasetSplits:
    """Call the builder of ``name`` with the options ``given`` (None values dropped) and ``seed``
    when it takes one; an option it does not take is refused by name."""
    entry = dataset_entry(name)
    given = {k: v for k, v in given.items() if v is not None}
    refused = [k for k in given if k not in entry.options]
    if refused:
        takers = [e.name for e in _REGISTRY.values() if all(k in e.options for k in refused)]
        what = ", ".join(refused)
        if len(takers) == 1:
            verb = "applies" if len(refused) == 1 else "apply"
            raise ValueError(f"{what} only {verb} to the {takers[0]!r} dataset, not {name!r}")
        raise ValueError(f"{what} does not apply to the {name!r} dataset; it takes "
                         f"{', '.join(sorted(entry.options - {'seed'})) or 'no options'}")
    if "seed" in entry.options:
        given["seed"] = seed
    return entry.builder(**given)
