"""benchmarks/zoo_modes.py runs and writes complete rows (a smoke test: no timing is asserted)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from .scripts import load_benchmark


def test_a_tiny_run_writes_complete_rows(tmp_path: Path) -> None:
    script = load_benchmark("zoo_modes")
    out = tmp_path / "zoo"
    assert script.main(["--cases", "revnet38:8:4", "--repeats", "1", "--warmup", "1", "--out", str(out)]) == 0
    data = json.loads(out.with_suffix(".json").read_text())
    (row,) = data["rows"]
    assert row["model"] == "revnet38" and row["twin"] == "resnet32" and row["batch"] == 4
    for key in ("M_s", "C_s", "plain_s", "M_over_C", "M_over_C_paired", "M_nocheck_s", "M_nocheck_over_C_paired"):
        assert row[key] > 0
    # The phase split: forward, backward and the forward's time in the blocks per setting.
    phases = row["phases"]
    assert set(phases) == {"C", "M", "M, no check", "C, no graph"}
    for name, part in phases.items():
        assert 0 < part["blocks_s"] < part["forward_s"], name  # the stem, head and loss run outside
        assert (part["backward_s"] > 0) == (name != "C, no graph"), name
    # A floor adds the reversible blocks' forward to C-mode's forward and backward, which hold
    # it: above 1, below 2, and exactly the formula.
    c = phases["C"]["forward_s"] + phases["C"]["backward_s"]
    assert row["floor"] == row["phase_ratios"]["floor"] == 1 + phases["C, no graph"]["blocks_s"] / c
    assert row["floor_graph"] == 1 + phases["C"]["blocks_s"] / c
    assert 1 < row["floor"] < 2 and 1 < row["floor_graph"] < 2
    # M-mode keeps less than C-mode: the reversible blocks' activations are rebuilt, not stored.
    assert 0 < row["M_peak"] < row["C_peak"]
    text = out.with_suffix(".md").read_text()
    assert "command: `python benchmarks/zoo_modes.py" in text and text.count("| revnet38 | 8×8 | 4 |") == 2


def test_a_malformed_case_is_refused_with_its_form(capsys) -> None:
    script = load_benchmark("zoo_modes")
    with pytest.raises(SystemExit) as exit:
        script.main(["--cases", "revnet38:8"])
    assert exit.value.code == 2
    assert "model:side:batch" in capsys.readouterr().err
