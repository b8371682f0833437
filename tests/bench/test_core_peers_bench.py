"""benchmarks/core_peers.py runs, pivots its rows and reads verdicts from paired ratios (a smoke
test: no timing is asserted)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from revtrain.timing import median_interval

from .scripts import load_benchmark


def test_a_tiny_run_writes_both_tables(tmp_path: Path) -> None:
    script = load_benchmark("core_peers")
    out = tmp_path / "peers"
    methods = ["plain", "M", "C"] + (["revlib"] if importlib.util.find_spec("revlib") else [])
    argv = ["--device", "cpu", "--shapes", "4x8x4x2", "--repeats", "6", "--warmup", "1",
            "--methods", *methods, "--out", str(out)]
    assert script.main(argv) == 0
    data = json.loads(out.with_suffix(".json").read_text())
    (shape,) = data["shapes"]
    times = {r["method"]: r["times_s"] for r in shape["rows"]}
    expected = {"M/plain", "C/plain"} | ({"M/revlib"} if "revlib" in methods else set())
    assert set(shape["paired"]) == expected
    for name, got in shape["paired"].items():
        a, b = name.split("/")
        # The same numbers the rows hold, paired round by round.
        again = median_interval([ta / tb for ta, tb in zip(times[a], times[b])])
        assert got == pytest.approx(again._asdict())
        assert got["low"] <= got["median"] <= got["high"]
    text = out.with_suffix(".md").read_text()
    assert "## Head to head" in text and "| 4 × 8 × 4², 2 |" in text
    assert "with probability 96.9%" in text  # six rounds: min to max


def test_the_head_to_head_table_names_a_verdict_only_against_peers() -> None:
    script = load_benchmark("core_peers")

    class Row:
        def __init__(self, method: str, times: list[float]) -> None:
            self.method, self.times_s = method, tuple(times)

    plain = [1.0] * 7
    rows = [Row("plain", plain), Row("M", [1.3] * 7), Row("C", [1.0] * 7),
            Row("revlib", [1.2, 1.21, 1.19, 1.2, 1.22, 1.18, 1.2])]
    table = script.head_to_head([((8, 16, 8, 16), rows)], ["plain", "M", "C", "revlib"])
    header, _, line = table.splitlines()
    assert header == "| batch × ch × size, depth | M / plain | C / plain | M / revlib |"
    cells = [c.strip() for c in line.split("|")[2:-1]]
    assert cells[0] == "1.300 [1.300, 1.300]" and cells[1] == "1.000 [1.000, 1.000]"
    assert cells[2].endswith("slower")  # every round: M above revlib
