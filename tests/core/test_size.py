"""The core stays small enough to read: Algorithm 1 and its hooks in at most 3,000 lines."""

from __future__ import annotations

from pathlib import Path

import revtrain.core


def test_the_core_is_at_most_3000_lines() -> None:
    files = sorted(Path(revtrain.core.__file__).parent.glob("*.py"))
    lines = sum(len(f.read_text().splitlines()) for f in files)
    assert len(files) > 10 and lines <= 3000, f"revtrain/core/ has {lines} lines in {len(files)} files"
