"""Batch-size sweep (§3.4) on a tiny range, its JSON, and the two figures (Fig. 4, Fig. 5)."""

from __future__ import annotations

import pytest

from revtrain.planner import SweepPoint, SweepResult, parse_batch_sizes, resize_batch, sweep_batch_sizes
from revtrain.planner.plots import plot_decision_heatmap, plot_step_times, write_sweep_plots
from revtrain.planner.sweep import _line

from .helpers import PNG_SIGNATURE, tiny_batch, tiny_model


@pytest.fixture(scope="module")
def swept():
    model, batch = tiny_model(), tiny_batch(4)
    # A budget a little above baseline-M at batch 8 (the largest): every size has a plan, and
    # baseline-C does not fit at 8.
    result = sweep_batch_sizes(model, batch, [4, 8], "500KiB", confirm=2, repeats=1, warmup=1)
    return model, result


def test_sweep_profiles_predicts_and_confirms(swept):
    _, result = swept
    assert [p.batch_size for p in result.points] == [4, 8]
    assert result.profiled_batch_sizes == [4, 8]
    assert len(result.block_names) == 5
    for p in result.points:
        assert p.profiled
        # Two profiled sizes: the fitted baseline-M peak passes through the measured ones.
        assert p.baseline_M_peak_bytes == pytest.approx(p.measured_baseline_M_peak_bytes, abs=1)
        if p.feasible:
            assert set(p.modes) == set(result.block_names)
            assert p.predicted_peak_bytes <= result.budget_bytes
            assert p.predicted_time_per_sample_s == pytest.approx(p.predicted_step_time_s / p.batch_size)
        if p.confirmed:
            assert p.measured_peak_bytes <= result.budget_bytes
    small, large = result.points
    assert small.baseline_C_fits and not large.baseline_C_fits  # the budget sits between them
    assert result.best_batch_size in (4, 8)
    assert result.best_basis in ("measured", "predicted")


def test_sweep_result_round_trips_through_json(swept, tmp_path):
    _, result = swept
    assert SweepResult.from_json(result.to_json()) == result
    result.to_json(tmp_path / "sweep.json")
    assert SweepResult.from_json(tmp_path / "sweep.json") == result


def test_sweep_plots_write_png_files(swept, tmp_path):
    _, result = swept
    paths = write_sweep_plots(result, tmp_path / "plots")
    assert [p.name for p in paths] == ["plan_heatmap.png", "plan_step_times.png"]
    for path in paths:
        assert path.read_bytes()[:8] == PNG_SIGNATURE and path.stat().st_size > 1000


def _point(b: int, feasible: bool, c_fits: bool, modes: str | None) -> SweepPoint:
    return SweepPoint(
        batch_size=b, feasible=feasible,
        modes=None if modes is None else {f"b{i}": m for i, m in enumerate(modes)},
        predicted_step_time_s=0.01 * b if feasible else None,
        predicted_peak_bytes=1000 * b if feasible else None,
        baseline_M_step_time_s=0.012 * b, baseline_M_peak_bytes=900 * b,
        baseline_C_step_time_s=0.009 * b, baseline_C_peak_bytes=1500 * b, baseline_C_fits=c_fits,
    )


def test_plots_draw_infeasible_sizes_and_over_budget_baselines(tmp_path):
    result = SweepResult(
        model="toy", device="cpu", dtype="float32", budget_bytes=20_000, budget_source="as given",
        block_names=["b0", "b1", "b2"], profiled_batch_sizes=[8], fits={},
        points=[_point(8, True, True, "CCC"), _point(16, True, False, "MCM"), _point(32, False, False, None)],
        best_batch_size=8, best_basis="predicted",
    )
    result.points[1].measured_step_time_s, result.points[1].measured_peak_bytes = 0.15, 30_000  # over budget
    for draw, name in ((plot_decision_heatmap, "heat.png"), (plot_step_times, "times.png")):
        path = draw(result, tmp_path / name)
        assert path.read_bytes()[:8] == PNG_SIGNATURE


def test_fitted_memory_lines_never_fall_below_the_measurements():
    xs, ys = [16, 32, 64], [1000.0, 2300.0, 4100.0]  # not on one line
    a, k = _line(xs, ys, upper=True)
    assert all(a + k * x >= y - 1e-9 for x, y in zip(xs, ys))
    assert max(a + k * x - y for x, y in zip(xs, ys)) > 0  # raised, not just fitted
    a1, k1 = _line([32], [2300.0], upper=True, through=300.0)  # one point: through (0, fixed)
    assert (a1, a1 + 32 * k1) == pytest.approx((300.0, 2300.0))


def test_batch_sizes_parse_and_resize():
    assert parse_batch_sizes("64,32, 128") == [32, 64, 128]
    assert parse_batch_sizes("32:128:32") == [32, 64, 96, 128]
    for bad in ("", "a,b", "0,4", "8:4", "4:8:0"):
        with pytest.raises(ValueError):
            parse_batch_sizes(bad)
    x, y = resize_batch(tiny_batch(4), 10)
    assert x.shape[0] == 10 and y.shape[0] == 10
    x2, _ = resize_batch(tiny_batch(4), 3)
    assert x2.shape[0] == 3
