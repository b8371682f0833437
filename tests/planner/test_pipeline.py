"""The key claim: a plan's real training step keeps within the budget, and uses the headroom.

Budgets are placed strictly between the measured peaks of baseline-M and baseline-C, where a
plan has something to choose. Peaks are measured by the same tracker that profiles, on a real
step (forward, loss, backward, optimizer.step) of a RevNet-shaped model with non-reversible
layers between its reversible stages.
"""

from __future__ import annotations

import pytest

from revtrain.core import get_modes, reversible_blocks
from revtrain.planner import BudgetTooSmallError, Plan, make_plan, measure_steps, plan_for_model, prepare

from .helpers import assert_same, snapshot, tiny_model

FRACTIONS = (0.2, 0.5, 0.85)


@pytest.fixture(scope="module")
def setting(tiny_profiled):
    model, batch, profile = tiny_profiled
    peak_m = peak_of(model, batch, "M")
    peak_c = peak_of(model, batch, "C")
    assert peak_m < peak_c
    assert all(b.t_e_s > 0 for b in profile.blocks)  # M-mode is never free: every block may pay
    return model, batch, peak_m, peak_c, profile


@pytest.mark.parametrize("refine", [0, 3], ids=["as-solved", "refined"])
@pytest.mark.parametrize("fraction", FRACTIONS)
def test_plan_keeps_a_real_training_step_within_the_budget(setting, fraction, refine):
    model, batch, peak_m, peak_c, profile = setting
    budget = peak_m + int(fraction * (peak_c - peak_m))
    assert peak_m < budget < peak_c
    plan = plan_for_model(model, batch, budget, profile=profile, verify=False, refine=refine, repeats=1, warmup=1)
    assert plan.predicted_peak_bytes <= budget
    peak = peak_of(model, batch, plan.setting())
    assert peak <= budget, f"plan {''.join(plan.modes.values())} peaked at {peak} > budget {budget}"
    if fraction == max(FRACTIONS):
        assert "C" in plan.modes.values(), "the plan leaves the headroom unused"
    if refine and plan.modes != make_plan(profile, budget).modes:
        assert plan.predicted_peak_bytes == peak  # a refined plan's peak is a measured one


def peak_of(model, batch, modes) -> int:
    """Peak bytes of one real training step with ``modes`` (after one step of warm-up)."""
    with prepare(model, batch, repeats=0, warmup=1) as setup:
        return measure_steps(setup, {"step": modes})["step"].peak_bytes


def test_refining_finds_a_faster_plan_that_still_fits(setting):
    # At 85% of the way to baseline-C the paper's additive model leaves most of the headroom
    # unused here (baseline-M peaks late in backward, after most blocks have freed what they
    # keep); one doubling of the capacity already admits a plan with strictly more value.
    model, batch, peak_m, peak_c, profile = setting
    budget = peak_m + int(0.85 * (peak_c - peak_m))
    solved = plan_for_model(model, batch, budget, profile=profile, verify=False, refine=0)
    refined = plan_for_model(model, batch, budget, profile=profile, verify=False, refine=3, warmup=1)
    assert refined.predicted_step_time_s < solved.predicted_step_time_s
    assert peak_of(model, batch, refined.setting()) == refined.predicted_peak_bytes <= budget


def test_plan_for_model_end_to_end_as_the_trainer_calls_it(setting):
    _, batch, peak_m, peak_c, _ = setting
    model = tiny_model()  # a model of its own: this test applies the plan
    before = snapshot(model)
    budget = peak_m + (peak_c - peak_m) // 2
    plan = plan_for_model(model, batch, budget, device="cpu", repeats=1, warmup=1, refine=1, measure=True)
    assert_same(before, snapshot(model))  # planning changed nothing; applying is the caller's move
    assert list(plan.modes) == [name for name, _ in reversible_blocks(model)]
    assert plan.budget_bytes == budget and "as given" in plan.budget_source
    assert plan.measured_peak_bytes is not None and plan.measured_peak_bytes <= budget
    assert plan.measured_step_time_s is not None
    assert Plan.from_json(plan.to_json()) == plan
    plan.apply(model)
    assert get_modes(model) == plan.modes


def test_a_budget_below_baseline_m_says_what_fits(setting):
    """Jiang et al.'s M/C choice alone cannot go below baseline-M; every option together can go
    down to what recomputing every plain layer frees, and no further."""
    model, batch, peak_m, _, profile = setting
    with pytest.raises(BudgetTooSmallError) as info:
        plan_for_model(model, batch, peak_m - 1, profile=profile, verify=False, choices="mc")
    err = info.value
    assert err.required_bytes == peak_m and err.batch_size == 8
    assert 0 <= err.max_batch_size < 8
    assert "largest batch size" in str(err)
    assert profile.layers and profile.floor_bytes < peak_m
    with pytest.raises(BudgetTooSmallError, match="even the smallest plan") as info:
        plan_for_model(model, batch, profile.floor_bytes - 1, profile=profile, verify=False)
    assert info.value.required_bytes == profile.floor_bytes


def test_measured_baseline_c_within_budget_gives_all_c(setting):
    model, batch, _, peak_c, profile = setting
    plan = plan_for_model(model, batch, peak_c, profile=profile, verify=False)
    assert set(plan.modes.values()) == {"C"}
    assert plan.predicted_peak_bytes == peak_c


def test_plan_for_model_prepares_once(setting, monkeypatch):
    """One call copies the model's state once and moves the model and the batch once.

    Counted where it happens: ``state_dict()`` of the model (a copy is taken from it) and
    ``copy.deepcopy`` of it; ``Module.to`` on the model; ``Tensor.to`` on the batch's tensors
    and on whatever a move of them returned. The core's ``verify_invertible`` (stage 1) takes a
    copy of its own to put batch-norm statistics back; it is counted apart.
    """
    import copy
    import sys

    import torch

    model, batch = tiny_model(), (setting[1][0].clone(), setting[1][1].clone())
    counts = {"planner copies": 0, "verify copies": 0, "model moves": 0, "batch moves": 0}
    batch_ids = {id(t) for t in batch}
    real_state_dict, real_module_to, real_tensor_to = torch.nn.Module.state_dict, torch.nn.Module.to, torch.Tensor.to
    real_deepcopy = copy.deepcopy

    def state_dict(self, *args, **kwargs):
        if self is model:
            caller = sys._getframe(1).f_code.co_filename.replace("\\", "/")
            counts["verify copies" if caller.endswith("revtrain/core/verify.py") else "planner copies"] += 1
        return real_state_dict(self, *args, **kwargs)

    def deepcopy(obj, *args, **kwargs):
        if obj is model:
            counts["planner copies"] += 1
        return real_deepcopy(obj, *args, **kwargs)

    def module_to(self, *args, **kwargs):
        if self is model:
            counts["model moves"] += 1
        return real_module_to(self, *args, **kwargs)

    def tensor_to(self, *args, **kwargs):
        result = real_tensor_to(self, *args, **kwargs)
        if id(self) in batch_ids:
            counts["batch moves"] += 1
            batch_ids.add(id(result))
        return result

    monkeypatch.setattr(torch.nn.Module, "state_dict", state_dict)
    monkeypatch.setattr(torch.nn.Module, "to", module_to)
    monkeypatch.setattr(torch.Tensor, "to", tensor_to)
    monkeypatch.setattr(copy, "deepcopy", deepcopy)
    peak_m, peak_c = setting[2], setting[3]
    plan = plan_for_model(model, batch, (peak_m + peak_c) // 2, device="cpu", repeats=1, warmup=1, refine=2,
                          measure=True)
    monkeypatch.undo()
    assert plan.measured_peak_bytes is not None  # every stage ran: verify, profile, solve, refine, measure
    assert counts["planner copies"] == 1, counts
    assert counts["model moves"] == 1, counts
    # x and y: each moved once (on the CPU a move returns the same tensor, and is still counted).
    assert counts["batch moves"] == 2, counts
    assert counts["verify copies"] == 1, counts  # the core's own, outside the planner


def test_a_budget_below_the_parameters_and_batch_is_refused_before_profiling(setting, monkeypatch):
    import revtrain.planner.pipeline as pipeline

    def must_not_run(*args, **kwargs):
        raise AssertionError("profiled or verified a budget that cannot fit")

    monkeypatch.setattr(pipeline, "profile_setup", must_not_run)
    monkeypatch.setattr(pipeline, "verify_setup", must_not_run)
    model, batch = tiny_model(), setting[1]
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    with pytest.raises(BudgetTooSmallError, match="refused before profiling") as info:
        plan_for_model(model, batch, params, device="cpu")
    assert info.value.required_bytes > 2 * params and info.value.max_batch_size is None


def test_a_task_loss_serves_as_the_loss(setting):
    from revtrain.tasks import Classification

    model, batch, peak_m, peak_c, profile = setting
    budget = peak_m + (peak_c - peak_m) // 2
    with_task = plan_for_model(model, batch, budget, loss_fn=Classification().loss, profile=profile,
                               verify=False, refine=2)
    assert with_task == plan_for_model(model, batch, budget, profile=profile, verify=False, refine=2)
