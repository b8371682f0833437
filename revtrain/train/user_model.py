"""Your own model: a ``module:factory`` import path (``--model my_nets.py:small_revnet``) or an object
given to :class:`~revtrain.train.Trainer` (``Trainer(config, model=net)``).

A model that is not in the registry says nothing about its inputs, so they come from the dataset:
images for float data, tokens for integer data, with the dataset's sample shape and classes. A
factory is called with the keyword arguments a registered model of that kind gets
(``in_channels`` and ``num_classes`` for images, ``vocab_size`` and ``context`` for tokens), each
only if its signature takes it (or takes ``**kwargs``)::

    def small_revnet(in_channels: int = 3, num_classes: int = 10) -> nn.Module: ...

The module part is a dotted module name (imported as ``import`` would, the working directory
included) or a path to a ``.py`` file.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from torch import nn

from revtrain.train.config import ConfigError

__all__ = ["build_from_path", "is_import_path", "load_factory", "with_absolute_file"]


def is_import_path(name: str) -> bool:
    """Whether ``--model`` names a ``module:factory`` rather than a registered model."""
    return ":" in name


def _is_file_module(module_name: str) -> bool:
    return module_name.endswith(".py") or os.sep in module_name or "/" in module_name


def with_absolute_file(name: str) -> str:
    """``file.py:factory`` with the file's absolute path, so that a run resumed or loaded from
    another folder finds it; a registered name or ``module:factory`` as given."""
    module_name, _, attr = name.rpartition(":")
    if not is_import_path(name) or not module_name or not _is_file_module(module_name):
        return name
    return f"{Path(module_name).expanduser().resolve()}:{attr}"


def load_factory(path: str) -> Callable[..., nn.Module]:
    """The callable named by ``module:factory`` or ``file.py:factory``.

    Raises:
        ConfigError: the module or the factory cannot be found, or the factory is not callable.
    """
    module_name, _, attr = path.rpartition(":")
    if not module_name or not attr:
        raise ConfigError(f"--model {path}: give a module and a factory as module:factory (my_nets:small or "
                          "my_nets.py:small), or a registered name (`revtrain models`)")
    try:
        if _is_file_module(module_name):
            file = Path(module_name).expanduser()
            if not file.is_file():
                raise ConfigError(f"--model {path}: file {file} does not exist")
            spec = importlib.util.spec_from_file_location(f"revtrain_user_model_{file.stem}", file)
            assert spec is not None and spec.loader is not None
            module = importlib.util.module_from_spec(spec)
            sys.modules[spec.name] = module
            spec.loader.exec_module(module)
        else:
            if "" not in sys.path and os.getcwd() not in sys.path:  # `python -m` would find it here too
                sys.path.insert(0, os.getcwd())
            module = importlib.import_module(module_name)
    except ModuleNotFoundError as err:
        raise ConfigError(f"--model {path}: cannot import module {module_name} ({err}); run from the folder "
                          "that holds it, add it to PYTHONPATH, or give the path of its .py file") from None
    factory = module
    for part in attr.split("."):
        if not hasattr(factory, part):
            names = sorted(n for n, v in vars(module).items() if callable(v) and not n.startswith("_"))
            raise ConfigError(f"--model {path}: {module_name} has no {attr}; its callables: "
                              f"{', '.join(names[:12]) or 'none'}")
        factory = getattr(factory, part)
    if not callable(factory):
        raise ConfigError(f"--model {path}: {attr} is not callable; name a function or class that returns "
                          "an nn.Module")
    return factory  # type: ignore[return-value]


def build_from_path(path: str, kwargs: dict[str, Any]) -> nn.Module:
    """Call the factory of ``path`` with those of ``kwargs`` its signature takes; check it gives a module."""
    factory = load_factory(path)
    try:
        params = inspect.signature(factory).parameters
    except (TypeError, ValueError):
        params = {}  # type: ignore[assignment]
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    model = factory(**{k: v for k, v in kwargs.items() if takes_any or k in params})
    if not isinstance(model, nn.Module):
        raise ConfigError(f"--model {path} returned {type(model).__name__}, not a torch.nn.Module")
    return model
