"""Exact bytes: the planner's step memory agrees with torch's ``MemTracker``, and a plan applied
to a model keeps its budget by ``MemTracker``'s count.

Each count runs in a fresh process of its own (``memtracker_check.py``), as a training run does:
a library's caches kept between steps are made by a process's first step, and ``MemTracker``
counts only what it sees made.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from revtrain.models import create_model, example_batch
from revtrain.planner import BudgetTooSmallError, TimingRule, plan_for_model, profile_model

ROOT = Path(__file__).resolve().parents[2]


def _check(*args: object) -> dict:
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    out = subprocess.run(
        [sys.executable, "-m", "tests.planner.memtracker_check", *map(str, args)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize(
    "name, batch, size",
    [("revnet38", 8, (3, 32, 32)), ("revnet110", 4, (3, 16, 16)), ("resnext29_iabn", 4, (3, 16, 16)),
     ("revformer_small", 2, (64,))],
)
def test_step_memory_agrees_with_memtracker_within_1_percent(name, batch, size):
    tracked = _check("memtracker", name, batch, *size)["peak"]
    planned = _check("planner", name, batch, *size)["peak"]
    assert planned == pytest.approx(tracked, rel=0.01), (planned, tracked)


FAST = TimingRule(warmup_pairs=0, min_pairs=1, max_pairs=2)


def test_a_budget_below_all_m_is_feasible_on_revnet38_and_kept_by_memtracker(tmp_path):
    model = create_model("revnet38")
    batch = example_batch("revnet38", 8, input_size=(3, 16, 16))
    profile = profile_model(model, batch, repeats=1, warmup=1, max_repeats=1, timing=FAST, model_name="revnet38")
    assert "stem" in {x.name for x in profile.layers}
    # Below all-M-mode, where Jiang's M/C choice has no plan; above the smallest plan's peak.
    budget = (profile.m_o_bytes + profile.floor_bytes) // 2
    with pytest.raises(BudgetTooSmallError, match="even all-M-mode"):
        plan_for_model(model, batch, budget, profile=profile, verify=False, refine=0, choices="mc")
    plan = plan_for_model(model, batch, budget, profile=profile, verify=False, refine=0, measure=True, repeats=1)
    assert plan.recomputed_layers and plan.recompute_cost_s > 0
    assert plan.measured_peak_bytes <= budget and plan.predicted_peak_bytes <= budget
    plan.to_json(tmp_path / "plan.json")
    got = _check("plan", "revnet38", 8, tmp_path / "plan.json", 3, 16, 16)
    assert got["memtracker"] <= budget, (got, budget)
