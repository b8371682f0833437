"""Smoke test of the planner benchmark: a tiny configuration, complete rows, budgets kept, files written.

No timing assertions: timing belongs to the benchmark's output, not to pass/fail. Byte counts on
CPU are deterministic, so the budget is asserted on.
"""

from __future__ import annotations

import json
import math
import re

import pytest

from revtrain.bench.batch_sweep import (
    SETTINGS,
    PlannerBenchConfig,
    PlannerBenchResult,
    run_planner_benchmark,
    to_sweep_result,
)


PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
TINY = PlannerBenchConfig(
    model="revnet38", batch_sizes=(2, 8, 32), input_shape=(3, 16, 16), repeats=1, warmup=1,
    profile_repeats=1, refine=2, threads=1, device="cpu", t_e_max_pairs=5,
)


@pytest.fixture(scope="module")
def result():
    return run_planner_benchmark(TINY)


def test_every_batch_size_and_setting_has_a_complete_row(result):
    assert [r.batch_size for r in result.rows] == list(TINY.batch_sizes)
    for r in result.rows:
        assert list(r.settings) == list(SETTINGS)
        assert r.n_blocks == len(result.block_names) == len(r.modes) == len(r.modes_refine0)
        for s in r.settings.values():
            assert len(s.times_s) == TINY.repeats
            assert s.step_time_s > 0 and math.isfinite(s.step_time_s)
            assert s.peak_bytes > 0 and s.additive_peak_bytes > 0 and s.predicted_peak_bytes > 0
            assert math.isfinite(s.step_time_error) and math.isfinite(s.peak_error)
        assert r.settings["baseline-M"].c_blocks == 0
        assert r.settings["baseline-C"].c_blocks == r.n_blocks
        assert r.settings["plan"].c_blocks == sum(m == "C" for m in r.modes.values())
        assert r.settings["plan (refine=0)"].c_blocks == sum(m == "C" for m in r.modes_refine0.values())
        assert r.speedup > 0 and r.speedup_paired[0] > 0


def test_the_automatic_budget_lies_between_the_baselines(result):
    small, large = result.rows[0], result.rows[-1]
    assert small.settings["baseline-C"].fits  # the margin is above baseline-C's peak at the small end
    assert result.budget_bytes >= large.settings["baseline-M"].peak_bytes
    assert not large.settings["baseline-C"].fits  # ... and the plan matters at the large end
    assert result.budget_bytes % 2**20 == 0 and "automatic" in result.budget_source


def test_plans_keep_within_the_budget_and_use_c_mode_where_it_fits(result):
    for r in result.rows:
        assert r.settings["plan"].peak_bytes <= result.budget_bytes
        assert r.settings["plan (refine=0)"].peak_bytes <= result.budget_bytes
        if r.settings["baseline-C"].fits:
            # Every block saves time in C-mode (t_e > 0 by construction), so the plan is baseline-C.
            assert set(r.modes.values()) == {"C"}
        # Refinement keeps a plan only if it is predicted faster.
        assert r.settings["plan"].predicted_step_time_s <= r.settings["plan (refine=0)"].predicted_step_time_s


def test_sweep_result_and_round_trip(result, tmp_path):
    sweep = to_sweep_result(result)
    assert [p.batch_size for p in sweep.points] == list(TINY.batch_sizes)
    assert all(p.confirmed and p.profiled for p in sweep.points)
    assert sweep.best_batch_size in TINY.batch_sizes and sweep.best_basis == "measured"
    assert type(sweep).from_json(sweep.to_json()).points[0].modes == result.rows[0].modes
    data = json.loads(json.dumps(result.to_dict(), allow_nan=False))
    again = json.loads(json.dumps(PlannerBenchResult.from_dict(data).to_dict()))
    assert again == data  # a results file reads back to the same rows


def test_bad_budgets_are_refused():
    with pytest.raises(ValueError, match="unknown unit"):
        PlannerBenchConfig(budget="5 parsecs")


@pytest.mark.parametrize(
    ("config", "kinds", "input_kind"),
    [
        (PlannerBenchConfig(model="revformer_tiny", model_options=("ff_chunks=2",), input_shape=(8,), batch_sizes=(1, 4),
                            budget="64MiB", repeats=1, warmup=1, profile_repeats=1, refine=1, device="cpu",
                            t_e_max_pairs=2), {"ReversibleBlock": 2}, "tokens"),
        (PlannerBenchConfig(model="resnext29_iabn", input_shape=(3, 8, 8), batch_sizes=(1, 2), budget="64MiB",
                            repeats=1, warmup=1, profile_repeats=1, refine=0, device="cpu", t_e_max_pairs=2),
         {"InPlaceABN": 28}, "image"),
    ],
    ids=["transformer", "in-place-abn"],
)
def test_any_kind_of_reversible_layer_is_benchmarked(config, kinds, input_kind):
    result = run_planner_benchmark(config)
    assert result.layer_kinds == kinds and result.input_kind == input_kind
    assert result.input_shape == config.input_shape
    assert [r.batch_size for r in result.rows] == list(config.batch_sizes)
    for r in result.rows:
        assert list(r.settings) == list(SETTINGS) and r.n_blocks == sum(kinds.values())
        assert tuple(r.profile["input_shape"]) == config.input_shape
        assert r.settings["plan"].peak_bytes <= result.budget_bytes
    data = json.loads(json.dumps(result.to_dict(), allow_nan=False))
    assert json.loads(json.dumps(PlannerBenchResult.from_dict(data).to_dict())) == data


def test_bad_model_options_and_input_shapes_are_refused():
    with pytest.raises(ValueError, match="key=value"):
        PlannerBenchConfig(model="revformer_tiny", model_options=("depth",))
    with pytest.raises(ValueError, match="must be 1 positive number"):
        PlannerBenchConfig(model="revformer_tiny", input_shape=(3, 8, 8))
    assert PlannerBenchConfig(model="revformer_tiny", model_options=("depth=3", "dropout=0.1", "positions=rotary",
                                                                     "tie_embeddings=true")).model_overrides() == {
        "depth": 3, "dropout": 0.1, "positions": "rotary", "tie_embeddings": True}
