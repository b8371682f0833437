"""benchmarks/check_cost.py runs each check setting every round and pairs it with checking every
step (a smoke test: no timing is asserted)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from revtrain.timing import median_interval

from .scripts import load_benchmark


def test_a_tiny_run_pairs_each_setting_with_checking_every_step_over_blocks(tmp_path: Path) -> None:
    script = load_benchmark("check_cost")
    out = tmp_path / "check_cost"
    assert script.main(["--batch", "4", "--every", "3", "0", "1", "--rounds", "6", "--warmup", "1",
                        "--out", str(out)]) == 0
    data = json.loads(out.with_suffix(".json").read_text())
    times = data["times_s"]
    assert data["block"] == 3  # the intervals' least common multiple: every block holds one checked step of 3
    assert set(times) == {"1", "3", "0"} and all(len(t) == 6 for t in times.values())
    rows = {row["every"]: row for row in data["rows"]}
    assert rows[1]["ratio"] is None
    blocks = [sum(times["0"][i : i + 3]) / sum(times["1"][i : i + 3]) for i in (0, 3)]
    assert rows[0]["ratio"] == pytest.approx(median_interval(blocks)._asdict())
    text = out.with_suffix(".md").read_text()
    assert "| never (0) |" in text and "| one step in 3 |" in text and "| every step (1) |" in text


@pytest.mark.parametrize(
    ("argv", "words"),
    [
        (["--every", "-2"], "integers >= 0"),
        (["--model", "resnet32"], "no reversible layers"),
        (["--model", "revformer_tiny"], "takes tokens"),
        (["--model", "no_such_model"], "--model"),
        (["--batch", "0"], "at least 1"),
        (["--every", "4", "3", "--rounds", "20"], "at least 24"),
    ],
)
def test_bad_requests_are_refused(argv: list[str], words: str) -> None:
    script = load_benchmark("check_cost")
    with pytest.raises(SystemExit, match=words):
        script.main(argv)
