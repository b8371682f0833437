"""benchmarks/fingerprint_products_cuda.py: a smoke test where CUDA is present, a clear refusal
where it is not (no timing is asserted)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from .scripts import load_benchmark


@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA present")
def test_without_cuda_it_says_so_and_names_the_cpu_benchmark(tmp_path: Path) -> None:
    script = load_benchmark("fingerprint_products_cuda")
    with pytest.raises(SystemExit, match="not an available CUDA device.*fingerprint_products.py"):
        script.main(["--out", str(tmp_path / "x")])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_both_products_agree_and_are_timed(tmp_path: Path) -> None:
    script = load_benchmark("fingerprint_products_cuda")
    assert script.main(["--out", str(tmp_path / "p")]) == 0
    rows = json.loads((tmp_path / "p.json").read_text())["rows"]
    assert len(rows) == len(script.HALF_SHAPES)
    for row in rows:
        for name in ("batched", "transposed"):
            assert row[name]["device_us"] > 0 and row[name]["rel_error"] < 1e-5


def test_a_malformed_device_is_named() -> None:
    script = load_benchmark("fingerprint_products_cuda")
    with pytest.raises(SystemExit, match="--device"):
        script.main(["--device", "cuda:x"])
