"""Command-line options derived from typed config dataclasses: one ``--option`` per field.

The CLI (``revtrain train``, ``plan``, ``bench``) and the benchmark scripts build their
parsers this way, so a field's type, default and docstring are its option's type, default and
help, and the dataclass's ``__post_init__`` validates what was given::

    add_config_options(parser, PlanConfig)
    config = PlanConfig(**given_options(parser.parse_args(), PlanConfig))
"""

from __future__ import annotations

import argparse
import dataclasses
import typing
from typing import Any

__all__ = ["add_config_options", "given_options"]


def add_config_options(
    parser: argparse.ArgumentParser,
    cls: type,
    *,
    defaults: dict[str, Any] | None = None,
    const: dict[str, Any] | None = None,
    help_suffix: dict[str, str] | None = None,
    exclude: tuple[str, ...] = (),
) -> None:
    """One ``--option`` per field of a dataclass, typed from its annotation, helped by its docstring.

    Options default to ``argparse.SUPPRESS``: only the options given appear in the namespace,
    so the dataclass's own defaults (or a resumed run's settings) apply to the rest. A field
    without a default is a required option.

    Args:
        parser: Where to add the options.
        cls: The config dataclass.
        defaults: Defaults to show in the help instead of the dataclass's (the caller applies them).
        const: Fields whose option may be given without a value, and the value it then takes.
        help_suffix: Text appended to a field's help.
        exclude: Fields that get no option.
    """
    from revtrain.train.config import field_docs  # the docstring reader lives with the first config

    hints, docs = typing.get_type_hints(cls), field_docs(cls)
    defaults, const, help_suffix = defaults or {}, const or {}, help_suffix or {}
    for f in dataclasses.fields(cls):
        if f.name in exclude:
            continue
        kind = _unwrap_optional(hints[f.name])
        required = f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        default = defaults.get(f.name, None if required else f.default)
        # No "(default: )" for an empty default: the field's own text says what empty means.
        shown = "" if default is None or default == "" else f" (default: {_show(default)})"
        text = docs.get(f.name, "") + help_suffix.get(f.name, "") + shown
        kwargs: dict[str, Any] = dict(dest=f.name, help=text.replace("%", "%%"))
        if required:
            kwargs["required"] = True
        else:
            kwargs["default"] = argparse.SUPPRESS
        if kind is bool:
            kwargs["action"] = argparse.BooleanOptionalAction
        elif typing.get_origin(kind) is typing.Literal:
            kwargs["choices"] = typing.get_args(kind)
        elif typing.get_origin(kind) is tuple:
            kwargs.update(nargs="+", type=typing.get_args(kind)[0], metavar=f.name.removesuffix("s").upper())
        else:
            kwargs.update(type=kind, metavar=f.name.upper())
        if f.name in const:
            kwargs.update(nargs="?", const=const[f.name])
        parser.add_argument("--" + f.name.replace("_", "-"), **kwargs)


def given_options(args: argparse.Namespace, cls: type) -> dict[str, Any]:
    """The fields of ``cls`` that were given on the command line (the others are absent)."""
    return {f.name: getattr(args, f.name) for f in dataclasses.fields(cls) if hasattr(args, f.name)}


def _unwrap_optional(kind: Any) -> Any:
    """``X | None`` -> ``X`` (an option that is not given stays None)."""
    rest = [a for a in typing.get_args(kind) if a is not type(None)]
    if len(rest) == 1 and len(typing.get_args(kind)) == 2:
        return rest[0]
    return kind


def _show(value: Any) -> str:
    if isinstance(value, tuple):
        return " ".join(map(str, value))
    return str(value)
