"""benchmarks/step_profile.py runs and counts what it says (a smoke test: no timing is asserted)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from .scripts import load_benchmark


def test_a_tiny_cpu_profile_counts_ops_per_step_for_each_method(tmp_path: Path) -> None:
    script = load_benchmark("step_profile")
    out = tmp_path / "profile"
    assert script.main(["--shape", "2x4x4x2", "--methods", "M", "--steps", "2", "--warmup", "1",
                        "--top", "3", "--out", str(out)]) == 0
    data = json.loads(out.with_suffix(".json").read_text())
    results = data["results"]
    assert list(results) == ["plain", "M"] and data["steps"] == 2
    for r in results.values():
        assert r["aten_ops_per_step"] > 0 and r["top_self_host"]
        assert r["device_kernels_per_step"] == 0 and r["syncs_per_step"] == {}  # a CPU has neither
    # M-mode rebuilds and checks in backward: more ops per step than plain autograd, counted
    # from the same profiler events.
    assert results["M"]["aten_ops_per_step"] > results["plain"]["aten_ops_per_step"]
    text = out.with_suffix(".md").read_text()
    assert "| M |" in text and "## M: ops with the most self host time per step" in text


def test_a_bad_shape_is_named() -> None:
    script = load_benchmark("step_profile")
    with pytest.raises(SystemExit, match="BATCHxCHANNELSxSIZExDEPTH"):
        script.main(["--shape", "8x16x8"])
