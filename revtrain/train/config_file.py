"""``revtrain train --config FILE``: a run's recipe in a TOML or JSON file; the command line overrides it.

Keys are the options of ``revtrain train`` (``batch_size`` or ``batch-size``), at the top level,
with their types (``milestones = [0.5, 0.75]``, ``budget = "12MiB"``). A run's own
``config.json`` is such a file, so ``--config runs/<run>/config.json --run-dir runs/again`` repeats
a run. What belongs to one invocation rather than to the recipe is not read from a file:
``resume`` and ``overwrite`` (pass ``--resume`` and ``--overwrite``) are skipped with a note, and
``run_dir`` is honoured (a run's own folder is then refused as holding a run: pass another
``--run-dir``). The run folder's ``config.json`` records the options the run resolved to, file
and command line together::

    # digits_adamw.toml
    model = "revnet38"
    optimizer = "adamw"
    lr = 3e-3
    epochs = 5
    stages = 2          # the options of several processes (--stages, --data-parallel, ...) too

TOML is read with the standard library's ``tomllib`` (Python 3.11+; on 3.10 install ``tomli``).
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import types
import typing
from pathlib import Path
from typing import Any

from revtrain.train.config import ConfigError

__all__ = ["INVOCATION_ONLY", "merge_with_file", "read_config_file"]

INVOCATION_ONLY = ("resume", "overwrite")
"""Options a file does not set: they say what this command does with a folder, not the recipe."""


def read_config_file(path: str | Path) -> dict[str, Any]:
    """The options in a ``.toml`` or ``.json`` file, keys with ``_`` (not yet checked against any config).

    Raises:
        ConfigError: the file is missing, unreadable, of another format, or not a table of options.
    """
    path = Path(path)
    if not path.is_file():
        what = "is a folder" if path.is_dir() else "does not exist"
        raise ConfigError(f"--config {path} {what}; give a .toml or .json file of training options")
    suffix = path.suffix.lower()
    if suffix not in (".toml", ".json"):
        raise ConfigError(f"--config {path}: unknown format {suffix or '(no extension)'!r}; use a .toml or "
                          ".json file")
    try:
        text = path.read_text(encoding="utf-8")
        data = _toml_loads(text) if suffix == ".toml" else json.loads(text)
    except ConfigError:
        raise
    except UnicodeDecodeError as err:
        raise ConfigError(f"--config {path} is not UTF-8 text (byte {err.start}); save it as UTF-8") from None
    except json.JSONDecodeError as err:
        raise ConfigError(f"--config {path}: invalid JSON at line {err.lineno}, column {err.colno}: "
                          f"{err.msg}") from None
    except ValueError as err:  # tomllib.TOMLDecodeError
        raise ConfigError(f"--config {path}: invalid TOML: {err}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"--config {path} holds a JSON {type(data).__name__}; it must be an object of "
                          "options such as {\"epochs\": 5}")
    nested = [k for k, v in data.items() if isinstance(v, dict)]
    if nested:
        hint = (f"; a run's options are in its config.json ({Path(path).with_name('config.json')})"
                if Path(path).name == "summary.json" else "")
        raise ConfigError(f"--config {path}: options go at the top level; found the table(s) "
                          f"{', '.join(nested)}{hint}")
    return {str(k).replace("-", "_"): v for k, v in data.items()}


def merge_with_file(path: str | Path | None, cls: type, given: dict[str, Any],
                    log: typing.Callable[[str], None] = print) -> dict[str, Any]:
    """The options of the config class ``cls``: the file's, then the command line's on top.

    Args:
        path: The ``--config`` file, or None (the command line's options are returned as they are).
        cls: The config dataclass; every key of the file must be one of its fields.
        given: The options given on the command line.
        log: Where notes go (options of the file that were skipped).

    Raises:
        ConfigError: an unknown key (with close matches) or a value of the wrong type, naming the file.
    """
    if path is None:
        return dict(given)
    data = read_config_file(path)
    skipped = [k for k in INVOCATION_ONLY if data.pop(k, None) not in (None, False)]
    if skipped:
        log(f"--config {path}: {', '.join(skipped)} not read from a file; pass "
            f"{' '.join('--' + k for k in skipped)} on the command line to use them")
    fields = {f.name for f in dataclasses.fields(cls)}
    unknown = [k for k in data if k not in fields]
    if unknown:
        hints = [f"{k} (did you mean {', '.join(close)}?)" if (close := difflib.get_close_matches(k, fields, n=2))
                 else k for k in unknown]
        raise ConfigError(f"--config {path}: unknown option(s) {', '.join(hints)}; the keys are the options of "
                          "`revtrain train --help` (batch_size or batch-size)")
    hints = typing.get_type_hints(cls)
    return {**{k: _checked(path, k, v, hints[k]) for k, v in data.items()}, **given}


def _checked(path: str | Path, key: str, value: Any, kind: Any) -> Any:
    """``value`` as the field's type wants it (lists become tuples), or a ConfigError naming the file."""
    if _fits(value, kind):
        return tuple(value) if isinstance(value, list) else value
    wants_text = _fits("", kind) and isinstance(value, (int, float)) and not isinstance(value, bool)
    hint = f'; quote it: {key} = "{value}"' if wants_text else ""  # a size such as budget = "9MiB"
    raise ConfigError(f"--config {path}: {key} = {value!r} is not {_describe(kind)}{hint}")


def _fits(value: Any, kind: Any) -> bool:
    origin, args = typing.get_origin(kind), typing.get_args(kind)
    if kind is type(None):
        return value is None
    if origin is typing.Union or origin is types.UnionType:
        return any(_fits(value, a) for a in args)
    if origin is typing.Literal:
        return value in args
    if origin is tuple:
        return isinstance(value, (list, tuple)) and all(_fits(v, args[0]) for v in value)
    if kind is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if kind is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if kind is Any:
        return True
    return isinstance(value, kind)


def _describe(kind: Any) -> str:
    origin, args = typing.get_origin(kind), typing.get_args(kind)
    if origin is typing.Literal:
        return "one of " + ", ".join(map(repr, args))
    if origin is tuple:
        return f"a list of {_describe(args[0])}"
    if args:
        return " or ".join(_describe(a) for a in args)
    return {type(None): "null (unset)", float: "a number", int: "an integer", bool: "true or false",
            str: "a string"}.get(kind, str(kind))


def _toml_loads(text: str) -> dict[str, Any]:
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        try:
            import tomli as tomllib  # type: ignore[no-redef]
        except ModuleNotFoundError:
            raise ConfigError("reading TOML on Python 3.10 needs the tomli package (pip install tomli); or "
                              "give the options as a .json file") from None
    return tomllib.loads(text)
