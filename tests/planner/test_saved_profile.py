"""A profile saved by an earlier revtrain still reads, and still solves to the same plans.

The files in ``data/`` were written before the JSON envelope and the paired ``t_e`` timing
(format version 1): a RevNet-110 profile at batch 32 on the CPU, and the plan
``plan_for_model(..., refine=0)`` solved from it at five budgets, from all-M to all-C. Stage 3 is a
pure function of the profile and the budget, so the same profile must give the same plans.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from revtrain.planner import Plan, Profile, make_plan

DATA = Path(__file__).parent / "data"
EXPECTED = json.loads((DATA / "revnet110_b32_plans_refine0_v1.json").read_text())


@pytest.fixture(scope="module")
def profile() -> Profile:
    return Profile.from_json(DATA / "revnet110_b32_profile_v1.json")


@pytest.mark.parametrize("budget", sorted(EXPECTED, key=lambda b: int(b.removesuffix("MiB"))))
def test_the_same_profile_solves_to_the_same_plan(profile, budget):
    plan = make_plan(profile, budget, use_measured_baseline_c=True)
    expected = Plan.from_json(json.dumps(EXPECTED[budget]))
    plan.budget_source = expected.budget_source  # set by plan_for_model from the budget's text
    # Plans now record the profiled sample shape too; the saved ones predate it (None when read).
    assert expected.input_shape is None and plan.input_shape == profile.input_shape == (3, 32, 32)
    expected.input_shape = profile.input_shape
    assert plan == expected
    # ... and plain layers' options (a profile without plain layers: none).
    assert plan.layers == expected.layers == {} and plan.recompute_cost_s == expected.recompute_cost_s == 0.0
    assert json.loads(plan.to_json())["payload"] == {
        **{k: v for k, v in EXPECTED[budget].items() if k not in ("format", "version")}, "input_shape": [3, 32, 32],
        "layers": {}, "recompute_cost_s": 0.0, "measured_step_time_interval_s": None,
    }


def test_the_saved_plans_span_all_m_to_all_c(profile):
    c_blocks = [sum(m == "C" for m in EXPECTED[b]["modes"].values()) for b in ("70MiB", "131MiB", "300MiB")]
    assert c_blocks[0] < c_blocks[1] < c_blocks[2] == len(profile.blocks)
