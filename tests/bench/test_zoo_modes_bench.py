"""benchmarks/zoo_modes.py runs and writes complete rows (a smoke test: no timing is asserted)."""

from __future__ import annotations

import json
from pathlib import Path

from .scripts import load_benchmark


def test_a_tiny_run_writes_complete_rows(tmp_path: Path) -> None:
    script = load_benchmark("zoo_modes")
    out = tmp_path / "zoo"
    assert script.main(["--cases", "revnet38:8:4", "--repeats", "1", "--warmup", "1", "--out", str(out)]) == 0
    data = json.loads(out.with_suffix(".json").read_text())
    (row,) = data["rows"]
    assert row["model"] == "revnet38" and row["twin"] == "resnet32" and row["batch"] == 4
    for key in ("M_s", "C_s", "plain_s", "M_over_C", "M_over_C_paired", "rebuild_s"):
        assert row[key] > 0
    # The floor adds the reversible blocks' forward to a C step: above 1, and that forward is
    # part of a C step (with a graph), so it stays below 2.
    assert 1 < row["floor"] < 2 and row["floor"] == 1 + row["rebuild_s"] / row["C_s"]
    # M-mode keeps less than C-mode: the reversible blocks' activations are rebuilt, not stored.
    assert 0 < row["M_peak"] < row["C_peak"]
    text = out.with_suffix(".md").read_text()
    assert "command: `python benchmarks/zoo_modes.py" in text and "| revnet38 | 8×8 | 4 |" in text
