"""benchmarks/check_cost.py runs each check setting every round and pairs it with checking every
step (a smoke test: no timing is asserted)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from revtrain.timing import median_interval

from .scripts import load_benchmark


def test_a_tiny_run_pairs_each_setting_with_checking_every_step(tmp_path: Path) -> None:
    script = load_benchmark("check_cost")
    out = tmp_path / "check_cost"
    assert script.main(["--batch", "4", "--every", "3", "0", "1", "--rounds", "3", "--warmup", "1",
                        "--out", str(out)]) == 0
    data = json.loads(out.with_suffix(".json").read_text())
    times = data["times_s"]
    assert set(times) == {"1", "3", "0"} and all(len(t) == 3 for t in times.values())
    rows = {row["every"]: row for row in data["rows"]}
    assert rows[1]["ratio"] is None
    again = median_interval([a / b for a, b in zip(times["0"], times["1"])])
    assert rows[0]["ratio"] == pytest.approx(again._asdict())
    text = out.with_suffix(".md").read_text()
    assert "| never (0) |" in text and "| one step in 3 |" in text and "| every step (1) |" in text


def test_a_negative_interval_is_refused() -> None:
    script = load_benchmark("check_cost")
    with pytest.raises(SystemExit, match="integers >= 0"):
        script.main(["--every", "-2"])
