"""A choice for every layer: recompute/offload wrappers, the multiple-choice knapsack, and plans
that recompute plain layers to fit budgets below all-M-mode."""

from __future__ import annotations

import itertools
import json
import random
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from revtrain.core import set_modes
from revtrain.models import create_model, example_batch
from revtrain.planner import Plan, make_plan, solve_multiple_choice
from revtrain.planner.data import LayerProfile
from revtrain.planner.recompute import get_layer_options, plain_layers, set_layer_options

from .helpers import tiny_batch, tiny_model


def _brute_force(groups, capacity):
    best = None
    for choice in itertools.product(*(range(len(g)) for g in groups)):
        weight = sum(groups[k][j][1] for k, j in enumerate(choice))
        if weight <= capacity:
            value = sum(groups[k][j][0] for k, j in enumerate(choice))
            best = value if best is None else max(best, value)
    return best


@pytest.mark.parametrize("seed", range(40))
def test_multiple_choice_equals_brute_force(seed):
    rng = random.Random(seed)
    groups = [
        [(rng.uniform(-2, 5), rng.randint(-30, 60)) for _ in range(rng.randint(1, 4))]
        for _ in range(rng.randint(1, 6))
    ]
    lightest = sum(min(w for _, w in g) for g in groups)
    capacity = lightest + rng.randint(0, 120)
    sol = solve_multiple_choice(groups, capacity)
    assert sol.exact and sol.granularity == 1
    weight = sum(groups[k][j][1] for k, j in enumerate(sol.choice))
    assert weight == sol.total_weight <= capacity
    assert sol.total_value == pytest.approx(sum(groups[k][j][0] for k, j in enumerate(sol.choice)))
    assert sol.total_value == pytest.approx(_brute_force(groups, capacity), abs=1e-9)


def test_multiple_choice_coarse_table_stays_feasible_in_exact_bytes():
    rng = random.Random(7)
    groups = [[(rng.uniform(0, 3), rng.randint(0, 10_007)) for _ in range(3)] for _ in range(6)]
    capacity = 20_011
    sol = solve_multiple_choice(groups, capacity, granularity=997)
    assert not sol.exact
    assert sum(groups[k][j][1] for k, j in enumerate(sol.choice)) <= capacity


def test_multiple_choice_refuses_what_cannot_fit():
    with pytest.raises(ValueError, match="below 15, the weight of the lightest option"):
        solve_multiple_choice([[(1.0, 10), (2.0, 20)], [(0.0, 5)]], 14)
    with pytest.raises(ValueError, match="group 1 has no option"):
        solve_multiple_choice([[(1.0, 1)], []], 10)


def test_plain_layers_are_the_largest_non_reversible_parts():
    assert [n for n, _ in plain_layers(tiny_model())] == ["stem", "down", "head"]
    assert [n for n, _ in plain_layers(create_model("revnet38"))] == [
        "stem", "stages.1.transition", "stages.2.transition", "head",
    ]
    assert [n for n, _ in plain_layers(create_model("revformer_tiny"))] == ["embed", "head"]


def test_layer_options_are_set_from_outside_and_refuse_bad_names():
    model = tiny_model()
    before = type(model.stem).forward
    assert set_layer_options(model, {"stem": "recompute"}) == {"stem": "recompute", "down": "keep", "head": "keep"}
    assert "forward" in model.stem.__dict__ and type(model.stem).forward is before
    set_layer_options(model, "keep")
    assert "forward" not in model.stem.__dict__ and get_layer_options(model)["stem"] == "keep"
    with pytest.raises(ValueError, match=r"1 layer name\(s\) not in this model: nope\. The model's plain "
                       r"\(non-reversible\) layers are named like: stem, down, head\. Was the plan made for another"):
        set_layer_options(model, {"nope": "recompute", "stem": "recompute"})
    assert get_layer_options(model)["stem"] == "keep"  # nothing changed
    with pytest.raises(ValueError, match="layer options must be one of"):
        set_layer_options(model, {"stem": "drop"})


def _step(model, batch, loss_fn=F.cross_entropy):
    x, y = batch
    x = x.clone().requires_grad_(x.is_floating_point())
    model.zero_grad(set_to_none=True)
    loss = loss_fn(model(x), y)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return loss.detach(), grads, x.grad, {k: v.clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("option", ["recompute", "offload"])
@pytest.mark.parametrize("name", ["revnet38", "revformer_tiny"])
def test_recomputed_and_offloaded_layers_give_plain_autograds_gradients_in_float64(name, option):
    """Loss, every parameter gradient, the input gradient (images) and every buffer (batch-norm
    statistics are updated once, not again by the recomputation) equal plain autograd's; the
    Transformer's embedding has dropout 0.1, which replays exactly."""
    size = {"input_size": (3, 8, 8)} if name == "revnet38" else {}
    torch.manual_seed(0)
    model = create_model(name).double()
    batch = example_batch(name, 4, seed=1, **size)
    if batch[0].is_floating_point():
        batch = (batch[0].double(), batch[1])
    loss_fn = F.cross_entropy if name == "revnet38" else (lambda out, y: F.cross_entropy(out.flatten(0, 1), y.flatten()))
    state = {k: v.clone() for k, v in model.state_dict().items()}
    set_modes(model, "C")
    torch.manual_seed(5)
    plain = _step(model, batch, loss_fn)
    model.load_state_dict(state)
    set_modes(model, "M")
    set_layer_options(model, option)
    assert set(get_layer_options(model).values()) == {option}
    torch.manual_seed(5)
    wrapped = _step(model, batch, loss_fn)
    torch.testing.assert_close(wrapped[0], plain[0], rtol=1e-10, atol=1e-12)
    assert wrapped[1].keys() == plain[1].keys() and len(plain[1]) == len(list(model.parameters()))
    for k in plain[1]:
        torch.testing.assert_close(wrapped[1][k], plain[1][k], rtol=1e-10, atol=1e-12, msg=k)
    if plain[2] is not None:
        torch.testing.assert_close(wrapped[2], plain[2], rtol=1e-10, atol=1e-12)
    for k in plain[3]:
        torch.testing.assert_close(wrapped[3][k], plain[3][k], rtol=1e-10, atol=1e-12, msg=k)


def _toy_profile(**layers):
    from .test_plan import toy_profile

    base = toy_profile()
    base.layers = [LayerProfile(name=n, recompute_s=t, recompute_saves_bytes=b) for n, (t, b) in layers.items()]
    return base


def test_a_budget_below_all_m_recomputes_the_cheapest_plain_layers():
    profile = _toy_profile(stem=(0.010, 400), down=(0.002, 300), head=(0.001, 50))
    plan = make_plan(profile, profile.m_o_bytes - 300)
    assert plan.layers == {"stem": "keep", "down": "recompute", "head": "keep"}
    assert plan.predicted_peak_bytes == profile.m_o_bytes - 300
    assert plan.recompute_cost_s == pytest.approx(0.002)
    assert plan.predicted_step_time_s == pytest.approx(profile.step_time_M_s + 0.002)
    assert "recompute" in plan.summary() and "down" in plan.summary()
    # Jiang's M/C choice alone cannot go below all-M.
    from revtrain.planner import BudgetTooSmallError

    with pytest.raises(BudgetTooSmallError, match="even all-M-mode"):
        make_plan(profile, profile.m_o_bytes - 300, choices="mc")
    with pytest.raises(BudgetTooSmallError, match="even the smallest plan"):
        make_plan(profile, profile.m_o_bytes - 751)


def test_recompute_buys_c_mode_blocks_when_that_is_faster():
    profile = _toy_profile(stem=(0.0001, 10_000))
    fastest = max(profile.blocks, key=lambda b: b.t_e_s)
    budget = profile.m_o_bytes + fastest.m_bytes - 10_000
    assert make_plan(profile, budget, choices="mc").modes[fastest.name] == "M"
    plan = make_plan(profile, budget)
    assert plan.modes[fastest.name] == "C" and plan.layers["stem"] == "recompute"


def test_plans_with_layer_options_round_trip_and_old_plans_still_load(tmp_path):
    plan = make_plan(_toy_profile(stem=(0.01, 500)), 10**12)
    plan = Plan(**{**plan.__dict__, "layers": {"stem": "recompute"}, "recompute_cost_s": 0.01})
    assert Plan.from_json(plan.to_json()) == plan
    saved = json.loads((Path(__file__).parent / "data" / "revnet110_b32_plans_refine0_v1.json").read_text())
    old = Plan.from_json(json.dumps(next(iter(saved.values()))))
    assert old.layers == {} and old.recompute_cost_s == 0.0 and old.recomputed_layers == []
    with pytest.raises(ValueError, match="Plan.layers must map"):
        Plan(**{**plan.__dict__, "layers": {"stem": "drop"}})
