"""Smoke test of the stack benchmark: a tiny configuration, complete rows, sane memory order.

No timing assertions: timing belongs to the benchmark's output, not to pass/fail.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import math

import pytest

from revtrain.bench import (
    EXTRA_METHODS,
    OURS,
    GradientMismatchError,
    StackBenchConfig,
    run_stack_benchmark,
)

# Activations (32 KiB per half per block) dominate the per-block RNG states that M-mode keeps,
# so the memory order is that of the real configuration, only smaller.
TINY = StackBenchConfig(
    batch=4, channels=16, size=16, depths=(2, 8), repeats=2, warmup=0, device="cpu", threads=1
)


@pytest.fixture(scope="module")
def rows():
    return run_stack_benchmark(TINY)


def test_every_depth_and_method_has_a_complete_row(rows):
    assert [(r.depth, r.method) for r in rows] == [(d, m) for d in TINY.depths for m in OURS]
    for r in rows:
        assert len(r.times_s) == TINY.repeats
        assert all(t > 0 and math.isfinite(t) for t in r.times_s)
        assert r.time_min_s <= r.time_median_s and r.time_iqr_s >= 0
        assert r.time_ratio > 0 and r.time_ratio_paired > 0
        assert r.cpu_time_median_s is not None and r.cpu_time_ratio is not None  # CPU run
        assert r.peak_bytes is not None and r.peak_bytes > 0 and r.peak_ratio is not None
        if r.method == "plain":
            assert r.time_ratio == r.cpu_time_ratio == r.peak_ratio == 1.0
            assert r.grad_rel_err is None
        else:
            # float32: far below the benchmark's own refusal bound (grad_tolerance, 1e-2)
            assert r.grad_rel_err is not None and r.grad_rel_err < 1e-5


def test_memory_order_is_sane(rows):
    peak = {(r.depth, r.method): r.peak_bytes for r in rows}
    assert peak[8, "M"] < peak[8, "plain"]
    assert peak[8, "checkpoint"] < peak[8, "plain"]
    assert peak[8, "plain"] > 2 * peak[2, "plain"]  # plain keeps every block's activations
    assert peak[8, "M"] < 1.2 * peak[2, "M"]  # M-mode keeps one output, whatever the depth


def test_every_extra_method_runs_and_computes_plains_gradients():
    config = dataclasses.replace(TINY, depths=(2,), methods=("plain", *EXTRA_METHODS))
    rows = run_stack_benchmark(config)
    assert [r.method for r in rows] == list(config.methods)
    # M-exact rounds the state to fixed point (core/fixed_point.py): plain's function only up to
    # that rounding, so it gets the benchmark's own bound; every other variant is plain's function.
    for r in rows[1:]:
        assert r.grad_rel_err is not None
        assert r.grad_rel_err < (config.grad_tolerance if r.method == "M-exact" else 1e-5), r.method


def test_a_broken_path_is_refused(monkeypatch):
    """An M-mode backward that doubles dL/dh (a plausible core bug) must stop the benchmark."""
    from revtrain.core.coupling import AdditiveCoupling

    monkeypatch.setattr(AdditiveCoupling, "vjp", lambda self, x, h, dy: (dy, 2 * dy))
    config = StackBenchConfig(
        batch=2, channels=4, size=4, depths=(2,), methods=("plain", "M"), repeats=1, warmup=0,
        device="cpu", measure_memory=False,
    )
    with pytest.raises(GradientMismatchError, match="method 'M'"):
        run_stack_benchmark(config)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"methods": ("M", "C")}, "must include 'plain'"),
        ({"methods": ("plain", "X")}, "unknown method"),
        ({"channels": 7}, "even"),
        ({"depths": (0,)}, "depths"),
        ({"dtype": "int32"}, "floating-point"),
    ],
)
def test_bad_configs_are_refused_with_the_fix(kwargs, match):
    with pytest.raises(ValueError, match=match):
        StackBenchConfig(device="cpu", **kwargs)


def test_unknown_or_missing_peer_is_refused_before_building(monkeypatch):
    from revtrain.bench import peers

    monkeypatch.setattr(peers.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ValueError, match="revlib is not installed.*--no-deps"):
        StackBenchConfig(methods=("plain", "revlib"))


@pytest.mark.parametrize("peer", ["revlib", "memcnn", "reformer", "revtorch"])
def test_each_installed_peer_computes_our_function(peer):
    """A peer column is only meaningful if the peer trains the same function: its gradients
    are checked against plain autograd inside the benchmark (GradientMismatchError otherwise)."""
    from revtrain.bench import peers

    if importlib.util.find_spec(peers._MODULES[peer]) is None:  # not part of the dev install
        pytest.skip(f"{peer} is not installed (pip install --no-deps, see benchmarks/README.md)")
    assert peers.peer_status(peer) is None  # installed: it must import and build
    config = StackBenchConfig(batch=2, channels=8, size=4, depths=(2,), methods=("plain", peer),
                              repeats=1, warmup=0, device="cpu", measure_memory=False)
    rows = run_stack_benchmark(config)
    assert rows[1].method == peer and rows[1].grad_rel_err < 1e-5


def test_each_timed_step_follows_a_step_of_its_own_method_and_the_order_rotates(monkeypatch):
    # Timing order, counted: each timed step right after an untimed one of the same method (the
    # steady state of training with it), the first method of a round one later each round.
    import torch

    import revtrain.bench.stack as stack

    steps: list[str] = []
    models = {name: torch.nn.Identity() for name in ("plain", "M", "C")}
    names = {id(m): name for name, m in models.items()}

    def counted(model, x, params, device):
        steps.append(names[id(model)])
        return 1.0, 1.0

    monkeypatch.setattr(stack, "_timed_step", counted)
    config = StackBenchConfig(batch=2, channels=4, size=4, depths=(1,), repeats=2, warmup=0, device="cpu")
    wall, _ = stack._time_round_robin(models, torch.zeros(1), [], config, torch.device("cpu"))
    assert steps == ["plain", "plain", "M", "M", "C", "C", "M", "M", "C", "C", "plain", "plain"]
    assert all(len(times) == 2 for times in wall.values())
