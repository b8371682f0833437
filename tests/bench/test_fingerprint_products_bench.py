"""benchmarks/fingerprint_products.py: its three products give the library's row projections,
and a tiny run of both parts gives complete rows (a smoke test: no timing is asserted)."""

from __future__ import annotations


import torch

from revtrain.core import fingerprint as fp

from .scripts import load_benchmark


def test_the_three_products_equal_the_library_and_tiny_runs_complete():
    script = load_benchmark("fingerprint_products")
    torch.manual_seed(0)
    half = torch.randn(4, 16, 6, 6).chunk(2, dim=1)[1]  # a strided half, as a block sees it
    plan = fp._Plan.of(half, fp.layout_of([half])[0])
    slab = fp._slab(half, plan)
    for name, method in script.METHODS.items():
        torch.testing.assert_close(method(slab, plan), fp._row_projections(slab, plan), rtol=1e-4, atol=1e-4, msg=name)
    row = script.per_product(2, 8, 4, rounds=1, calls=2)
    assert set(row["extra_us"]) == set(script.METHODS) and row["values"] == 2 * 4 * 4 * 4
    steps = script.whole_steps(2, 8, 4, 2, rounds=1, reps=1)
    assert set(steps["paired_vs_transposed"]) == set(script.METHODS)
    assert steps["paired_vs_transposed"]["transposed"] == 1.0
    assert fp._row_projections is script.fp._row_projections  # the library's function is put back
