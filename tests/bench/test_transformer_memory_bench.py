"""Smoke test of benchmarks/transformer_memory.py: complete rows, and the memory claim in kind.

No timing assertions. The memory assertions are about bytes kept for backward, which the
tracker counts exactly: M-mode keeps one output for the whole stack, whatever its depth.
"""

from __future__ import annotations

import importlib.util
import json

import pytest
import torch


from .scripts import load_benchmark


@pytest.fixture(scope="module")
def result(tmp_path_factory):
    script = load_benchmark("transformer_memory")
    out = tmp_path_factory.mktemp("bench") / "quick"
    threads = torch.get_num_threads()
    argv = ["--device", "cpu", "--threads", "1", "--width", "16", "--heads", "2", "--depths", "1", "3",
            "--depth-seq-len", "16", "--seq-lens", "16", "--seq-depth", "2", "--repeats", "1",
            "--warmup", "0", "--out", str(out)]
    try:
        assert script.main(argv) == 0
    finally:
        torch.set_num_threads(threads)
    return script, out


def test_results_files_hold_every_row(result):
    script, out = result
    text = out.with_suffix(".md").read_text()
    assert "command: `--device cpu" in text and "load average" in text and "outside anchor" in text
    data = json.loads(out.with_suffix(".json").read_text())
    assert [(r["depth"], r["method"]) for r in data["depth_rows"]] == [
        (d, m) for d in (1, 3) for m in ("plain", "checkpoint", "C", "M")]
    methods = [r["method"] for r in data["seq_rows"] if r["seq_len"] == 16]
    assert methods[:5] == ["plain", "checkpoint", "C", "M", "M-chunked"]
    installed = importlib.util.find_spec("reformer_pytorch") is not None
    assert ("reformer" in methods) == installed  # the outside anchor runs when it is installed
    assert ("not available" in data["anchor"]) == (not installed)
    for r in data["seq_rows"]:
        assert r["time_median_s"] > 0 and r["peak_bytes"] > 0 and r["kept_bytes"] > 0
        if r["method"] != "plain" and r["method"] != "C":
            assert r["grad_rel_err"] < 1e-5


def test_m_mode_keeps_the_same_bytes_at_every_depth_and_plain_does_not(result):
    _, out = result
    rows = {(r["depth"], r["method"]): r for r in json.loads(out.with_suffix(".json").read_text())["depth_rows"]}
    plain_growth = rows[(3, "plain")]["kept_bytes"] - rows[(1, "plain")]["kept_bytes"]
    assert plain_growth > 0.5 * rows[(1, "plain")]["kept_bytes"]  # two more layers of activations
    # M-mode keeps no tensor per block: the rebuild check keeps its sketches on the host.
    assert rows[(3, "M")]["kept_bytes"] - rows[(1, "M")]["kept_bytes"] == 0
    assert rows[(3, "C")]["kept_bytes"] == rows[(3, "plain")]["kept_bytes"]
    # What two more layers cost: nothing in M-mode, an input each when checkpointed,
    # all activations in plain (at these tiny sizes the absolute totals are too close to compare).
    growth = {m: rows[(3, m)]["kept_bytes"] - rows[(1, m)]["kept_bytes"] for m in ("M", "checkpoint", "plain")}
    assert growth["M"] < growth["checkpoint"] < growth["plain"]
