"""Smoke test of benchmarks/inplace_abn.py: a tiny run, complete rows, the memory order.

No timing assertions: timing belongs to the benchmark's output, not to pass/fail.
"""

from __future__ import annotations

import math

from .scripts import load_benchmark


def test_a_tiny_run_writes_complete_rows(tmp_path):
    bench = load_benchmark("inplace_abn")
    out = tmp_path / "iabn"
    rows = bench.main(["--batch-sizes", "4", "--size", "8", "--repeats", "1", "--warmup", "0",
                       "--out", str(out)])
    assert [r["method"] for r in rows] == list(bench.METHODS)
    for r in rows:
        assert len(r["times_s"]) == 1 and all(t > 0 and math.isfinite(t) for t in r["times_s"])
        assert r["grad_rel_error"] <= 1e-2 and r["peak_bytes"] > 0
    peak = {r["method"]: r["peak_bytes"] for r in rows}
    # M-mode keeps only outputs; the in-place activation keeps the input; plain keeps both.
    assert peak["iabn M"] < peak["plain, in-place"] < peak["plain"] == peak["iabn C"]
    text = out.with_suffix(".md").read_text()
    assert "Command: `python benchmarks/inplace_abn.py --batch-sizes 4" in text
    assert out.with_suffix(".json").exists()
