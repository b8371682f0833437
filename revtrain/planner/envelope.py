"""One JSON envelope for everything the planner writes: ``{"kind", "version", "payload"}``.

A profile, a plan and a sweep are written as::

    {"kind": "revtrain.plan", "version": 2, "payload": {...the dataclass's fields...}}

``kind`` says what the file holds, ``version`` how the envelope is laid out, ``payload`` the
data. Files of version 1 (before the envelope: ``{"format": "revtrain.plan", "version": 1,
...fields}``) are still read; anything else is refused with a message that says what was found.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Any, TypeVar

__all__ = ["ENVELOPE_VERSION", "dump_envelope", "load_envelope", "read_dataclass"]

ENVELOPE_VERSION = 2
"""The layout written now; version 1 (fields at the top level next to ``"format"``) is read too."""

_T = TypeVar("_T")


def dump_envelope(kind: str, payload: dict[str, Any], path: str | os.PathLike[str] | None = None) -> str:
    """``payload`` as JSON text in the envelope of ``kind`` (``"plan"``, ``"profile"``, ``"sweep"``);
    also written to ``path`` when given. Non-finite floats are refused (JSON has none)."""
    data = {"kind": f"revtrain.{kind}", "version": ENVELOPE_VERSION, "payload": payload}
    text = json.dumps(data, indent=2, allow_nan=False) + "\n"
    if path is not None:
        Path(path).write_text(text)
    return text


def load_envelope(kind: str, source: str | os.PathLike[str]) -> tuple[dict[str, Any], str]:
    """The payload of a ``kind`` envelope read from a file path or JSON text (a ``str`` starting
    with ``{``), and a description of where it came from for error messages.

    Raises:
        ValueError: invalid JSON, another kind, or an unknown version.
    """
    if isinstance(source, str) and source.lstrip().startswith("{"):
        where, text = "JSON text", source
    else:
        where = f"file {os.fspath(source)!r}"
        if Path(source).is_dir():
            raise ValueError(f"{where} is a folder; pass the revtrain {kind} JSON file inside it")
        try:
            text = Path(source).read_text(encoding="utf-8")
        except UnicodeDecodeError as e:
            raise ValueError(f"cannot read a revtrain {kind} from {where}: it is not UTF-8 JSON text (byte "
                             f"{e.start}); pass a {kind} written by revtrain, or make it again") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"cannot read a revtrain {kind} from {where}: invalid JSON ({e})") from None
    expected = f"revtrain.{kind}"
    if not isinstance(data, dict):
        raise ValueError(f"{where} is not a revtrain {kind} (a JSON {type(data).__name__}, expected an object)")
    found = data.get("kind", data.get("format"))
    if found != expected:
        raise ValueError(f"{where} is not a revtrain {kind} (kind {found!r}, expected {expected!r})")
    version = data.get("version")
    if version == ENVELOPE_VERSION and "kind" in data:
        payload = data.get("payload")
        if not isinstance(payload, dict):
            raise ValueError(f"{where} has no {kind} payload object")
        return dict(payload), where
    if version == 1 and "format" in data:  # written before the envelope: fields at the top level
        return {k: v for k, v in data.items() if k not in ("format", "version")}, where
    raise ValueError(
        f"{where} has {kind} format version {version!r}; this revtrain reads versions 1 and "
        f"{ENVELOPE_VERSION} (upgrade revtrain, or re-run the planner)"
    )


def read_dataclass(cls: type[_T], kind: str, source: str | os.PathLike[str]) -> _T:
    """An instance of the dataclass ``cls`` from a ``kind`` envelope; unknown or missing fields
    are refused by name."""
    data, where = load_envelope(kind, source)
    fields = dataclasses.fields(cls)  # type: ignore[arg-type]
    unknown = sorted(set(data) - {f.name for f in fields})
    if unknown:
        raise ValueError(f"{where} has unknown {kind} field(s) {unknown}")
    missing = sorted(f.name for f in fields if f.name not in data and _required(f))
    if missing:
        raise ValueError(f"{where} lacks required {kind} field(s) {missing}")
    return cls(**data)


def _required(f: dataclasses.Field[Any]) -> bool:
    return f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
