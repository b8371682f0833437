"""Writing a benchmark's result: the same name with ``.md`` (what a reader reads) and ``.json``
(everything measured, for tools), in one call that every script shares."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

__all__ = ["write_result"]


def write_result(out: Path, text: str, data: dict[str, Any]) -> None:
    """``out``.md holding ``text`` and ``out``.json holding ``data``, creating ``out``'s folder;
    says where. Values JSON cannot hold (paths, dtypes, devices) are written as their ``str``,
    so a long measurement never ends in a serialisation error before its results are saved."""
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".md").write_text(text)
    out.with_suffix(".json").write_text(json.dumps(data, indent=2, default=str) + "\n")
    print(f"wrote {out.with_suffix('.md')} and {out.with_suffix('.json')}")
