"""benchmarks/paired_rounds.py runs and pairs rounds correctly (a smoke test: no timing is asserted)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from revtrain.timing import median_interval

from .scripts import load_benchmark


def test_a_tiny_run_pairs_every_method_with_the_references(tmp_path: Path) -> None:
    script = load_benchmark("paired_rounds")
    out = tmp_path / "paired"
    assert script.main(["--shape", "4x8x4x2", "--methods", "M", "C", "--references", "plain", "C",
                        "--rounds", "6", "--warmup", "1", "--out", str(out)]) == 0
    data = json.loads(out.with_suffix(".json").read_text())
    times = data["times_s"]
    assert set(times) == {"plain", "M", "C"} and all(len(t) == 6 for t in times.values())
    rows = {row["method"]: row for row in data["rows"]}
    assert set(rows["M"]["paired"]) == {"plain", "C"} and set(rows["plain"]["paired"]) == {"C"}
    again = median_interval([a / b for a, b in zip(times["M"], times["C"])])
    assert rows["M"]["paired"]["C"] == pytest.approx(again._asdict())
    text = out.with_suffix(".md").read_text()
    assert "| M |" in text and "96.9%" in text  # six rounds: min to max


def test_a_bad_shape_is_named() -> None:
    script = load_benchmark("paired_rounds")
    with pytest.raises(SystemExit, match="BATCHxCHANNELSxSIZExDEPTH"):
        script.main(["--shape", "8x16x8"])


def test_the_device_is_named_in_the_header(tmp_path: Path) -> None:
    script = load_benchmark("paired_rounds")
    out = tmp_path / "paired"
    assert script.main(["--shape", "2x4x4x1", "--methods", "M", "--rounds", "2", "--warmup", "0",
                        "--device", "cpu", "--out", str(out)]) == 0
    assert "- device: cpu (" in out.with_suffix(".md").read_text()
    assert json.loads(out.with_suffix(".json").read_text())["machine"]["device"] == "cpu"


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="CUDA present")
def test_cuda_without_cuda_is_a_clear_error() -> None:
    script = load_benchmark("paired_rounds")
    with pytest.raises(SystemExit, match="--device: .*CUDA is not available"):
        script.main(["--shape", "2x4x4x1", "--device", "cuda"])


def test_m_check4_is_paired_over_blocks_of_four_rounds(tmp_path: Path) -> None:
    from revtrain.timing import block_ratios

    script = load_benchmark("paired_rounds")
    out = tmp_path / "paired"
    assert script.main(["--shape", "2x4x4x2", "--methods", "M", "M-check4", "--references", "M",
                        "--rounds", "8", "--warmup", "1", "--out", str(out)]) == 0
    data = json.loads(out.with_suffix(".json").read_text())
    assert data["block"] == 4
    times = data["times_s"]
    rows = {row["method"]: row for row in data["rows"]}
    again = median_interval(block_ratios(times["M-check4"], times["M"], 4))
    assert rows["M-check4"]["paired"]["M"] == pytest.approx(again._asdict())
    assert "blocks of 4 rounds" in out.with_suffix(".md").read_text()
