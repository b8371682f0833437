"""Honest timing: the whole-step correction of t_e is never 0 or negative, and what the timings
cannot support is said, with the figures."""

from __future__ import annotations

import dataclasses
import io

import pytest

from revtrain.planner import make_plan
from revtrain.planner.block_timing import BlockTiming
from revtrain.planner.pipeline import PlanningResult
from revtrain.planner.profile import whole_step_scale
from revtrain.planner.report import report_plan

from .test_plan import toy_profile


def _timing(t_e: float, low: float, high: float) -> BlockTiming:
    return BlockTiming(0.01, 0.02, 0.01, 0.01, t_e, high - low, 9, low, high)


STEADY = [_timing(0.010, 0.009, 0.011), _timing(0.020, 0.019, 0.021)]
TIMES_M = [1.00, 1.02, 0.99, 1.01, 1.00, 1.03, 0.98, 1.00]


def test_baseline_c_timed_slower_than_baseline_m_gives_a_sane_prediction_and_a_warning():
    times_c = [t + 0.05 for t in TIMES_M]  # a busy machine: C-mode's steps came out slower
    scale, warnings = whole_step_scale(TIMES_M, times_c, STEADY)
    assert scale is None  # not 0: that predicted every plan at baseline-M's time
    assert len(warnings) == 1 and "do not show C-mode faster than M-mode" in warnings[0]
    assert "-50.00 ms" in warnings[0] and "8 rounds" in warnings[0]
    profile = toy_profile(t_e_scale=scale, warnings=warnings, step_time_C_s=1.05, step_time_M_s=1.0)
    all_c = make_plan(profile, profile.m_o_bytes + sum(b.m_bytes for b in profile.blocks))
    assert set(all_c.modes.values()) == {"C"}
    sum_t_e = sum(b.t_e_s for b in profile.blocks)
    assert all_c.predicted_step_time_s == pytest.approx(1.0 - sum_t_e)
    assert 0 < all_c.predicted_step_time_s < profile.step_time_M_s
    out = io.StringIO()
    report_plan(PlanningResult(plan=all_c, profile=profile), out)
    assert "warning: whole steps do not show C-mode faster" in out.getvalue()


def test_a_difference_within_the_noise_is_not_trusted_either():
    noisy_c = [0.90, 1.10, 0.95, 1.08, 0.97, 1.06, 0.92, 1.04]
    scale, warnings = whole_step_scale(TIMES_M, noisy_c, STEADY)
    assert scale is None and "95% interval" in warnings[0]


def test_a_clear_difference_scales_t_e_to_what_whole_steps_save():
    times_c = [t - 0.015 for t in TIMES_M]
    scale, warnings = whole_step_scale(TIMES_M, times_c, STEADY)
    assert warnings == [] and scale == pytest.approx(0.015 / 0.030)


def test_wide_per_block_intervals_are_reported_with_their_size():
    wide = [_timing(0.010, -0.020, 0.040), dataclasses.replace(STEADY[1])]
    _, warnings = whole_step_scale(TIMES_M, [t - 0.015 for t in TIMES_M], wide)
    assert len(warnings) == 1
    assert "+/-31.00 ms against a total of 30.00 ms (103%)" in warnings[0] and "1 of 2 intervals include zero" in warnings[0]
