"""Profile / Plan data, make_plan's choices and errors, JSON round trips, Plan.apply."""

from __future__ import annotations

import json
import sys

import pytest
from hypothesis import assume, example, given, settings
from hypothesis import strategies as st

from revtrain.planner import (
    BlockProfile,
    BudgetTooSmallError,
    Plan,
    PlanMismatchError,
    Profile,
    make_plan,
)

GiB = 2**30
MiB = 2**20


def toy_profile(**overrides) -> Profile:
    blocks = [
        BlockProfile(name=f"stages.{s}.{i}", t_e_s=0.004 * (i + 1) + 0.001 * s, m_bytes=(3 + i + 2 * s) * MiB)
        for s in range(2)
        for i in range(3)
    ]
    fields = dict(
        model="revnet-toy",
        batch_size=64,
        input_shape=(3, 32, 32),
        dtype="float32",
        device="cpu",
        blocks=blocks,
        m_o_bytes=1400 * MiB,
        fixed_bytes=200 * MiB,
        step_time_M_s=0.25,
        step_time_C_s=0.19,
        peak_M_bytes=1400 * MiB,
        peak_C_bytes=1400 * MiB + sum(b.m_bytes for b in blocks),
    )
    fields.update(overrides)
    return Profile(**fields)


def test_plan_is_the_best_feasible_mode_assignment(brute_force):
    profile = toy_profile()
    t_e = [b.t_e_s for b in profile.blocks]
    m = [b.m_bytes for b in profile.blocks]
    for extra in [0, 3 * MiB, 10 * MiB, 17 * MiB + 5, 30 * MiB, 10 * GiB]:
        budget = profile.m_o_bytes + extra
        plan = make_plan(profile, budget)
        c_idx = [i for i, b in enumerate(profile.blocks) if plan.modes[b.name] == "C"]
        assert list(plan.modes) == [b.name for b in profile.blocks]
        assert plan.predicted_peak_bytes == profile.m_o_bytes + sum(m[i] for i in c_idx)
        assert plan.predicted_peak_bytes <= budget
        saved = sum(t_e[i] for i in c_idx)
        assert plan.predicted_step_time_s == pytest.approx(profile.step_time_M_s - saved, rel=1e-12)
        assert saved == pytest.approx(brute_force(t_e, m, extra), rel=1e-12)
        assert plan.model == "revnet-toy" and plan.batch_size == 64 and plan.budget_bytes == budget


def test_baselines_at_the_extremes():
    profile = toy_profile()
    all_m = make_plan(profile, profile.m_o_bytes)
    assert set(all_m.modes.values()) == {"M"}
    assert all_m.predicted_peak_bytes == profile.m_o_bytes
    assert all_m.predicted_step_time_s == profile.step_time_M_s
    all_c = make_plan(profile, profile.peak_C_bytes)
    assert set(all_c.modes.values()) == {"C"} and all_c.c_mode_blocks == list(all_c.modes)


def test_block_that_m_mode_does_not_slow_stays_in_m_mode():
    blocks = [BlockProfile(name="a", t_e_s=-1e-5, m_bytes=MiB), BlockProfile(name="b", t_e_s=0.01, m_bytes=0)]
    profile = toy_profile(blocks=blocks)
    plan = make_plan(profile, 10 * GiB)
    assert plan.modes == {"a": "M", "b": "C"}


@settings(max_examples=150, deadline=None)
@given(
    blocks=st.lists(
        st.tuples(st.floats(-1e-3, 0.5, allow_nan=False), st.integers(0, 2**38)), min_size=0, max_size=40
    ),
    m_o=st.integers(0, 2**36),
    extra=st.one_of(st.integers(0, 4096), st.integers(0, 2**40)),
    granularity=st.one_of(st.none(), st.integers(1, 2**34)),
)
def test_plans_never_exceed_the_budget(blocks, m_o, extra, granularity):
    assume(granularity is None or extra // granularity <= 2**22)  # finer tables are refused
    profile = toy_profile(
        blocks=[BlockProfile(name=f"b{i}", t_e_s=t, m_bytes=m) for i, (t, m) in enumerate(blocks)],
        m_o_bytes=m_o,
        fixed_bytes=None,
    )
    plan = make_plan(profile, m_o + extra, granularity=granularity)
    kept = sum(b.m_bytes for b in profile.blocks if plan.modes[b.name] == "C")
    assert plan.predicted_peak_bytes == m_o + kept <= plan.budget_bytes == m_o + extra
    assert plan.predicted_step_time_s <= profile.step_time_M_s


def test_budget_too_small_says_what_fits():
    profile = toy_profile()  # baseline-M peak 1400 MiB = 200 MiB fixed + 18.75 MiB per sample
    with pytest.raises(BudgetTooSmallError) as info:
        make_plan(profile, GiB)
    err = info.value
    assert isinstance(err, ValueError)
    msg = str(err)
    expected = [
        "budget 1.00 GiB",
        "all-M-mode",
        "batch size 64",
        "reduce the batch size",
        f"at least 1.37 GiB ({1400 * MiB} bytes)",
        "about 43",
        "200.00 MiB fixed",
        "18.75 MiB per sample",
    ]
    for part in expected:
        assert part in msg, (part, msg)
    # (1024 - 200) / 18.75 = 43.9: batch size 43 fits, 44 does not.
    assert err.max_batch_size == 43
    assert profile.m_o_at(43) <= GiB < profile.m_o_at(44)
    assert (err.budget_bytes, err.required_bytes, err.batch_size) == (GiB, 1400 * MiB, 64)


def test_budget_too_small_without_fixed_part_gives_an_upper_bound():
    with pytest.raises(BudgetTooSmallError, match=r"at most 46 \(assuming all of the baseline-M peak"):
        make_plan(toy_profile(fixed_bytes=None), GiB)  # 1024 / 1400 * 64 = 46.8


def test_budget_below_the_fixed_part_fits_no_batch_size():
    with pytest.raises(BudgetTooSmallError, match="not even batch size 1 fits") as info:
        make_plan(toy_profile(), 100 * MiB)
    assert info.value.max_batch_size == 0


def test_profile_round_trips_through_json_exactly(tmp_path):
    profile = toy_profile(
        step_time_M_s=0.1 + 0.2,  # not representable in few digits: must survive bit-exact
        blocks=[
            BlockProfile(
                name="layer.0",
                t_e_s=1e-300,
                m_bytes=2**53 + 1,
                t_forward_s=1 / 3,
                t_backward_M_s=2 / 3,
                t_backward_C_s=0.5,
            ),
            BlockProfile(name="layer.1", t_e_s=-0.0, m_bytes=0),
        ],
        peak_C_bytes=None,
        step_time_C_s=None,
    )
    text = profile.to_json(tmp_path / "profile.json")
    assert {k: v for k, v in json.loads(text).items() if k != "payload"} == {"kind": "revtrain.profile", "version": 2}
    assert Profile.from_json(tmp_path / "profile.json") == profile
    assert Profile.from_json(str(tmp_path / "profile.json")) == profile
    assert Profile.from_json(text) == profile
    assert Profile.from_json(text).input_shape == (3, 32, 32)


def test_plan_round_trips_through_json_exactly(tmp_path):
    plan = make_plan(toy_profile(), 1400 * MiB + 10 * MiB)
    plan.measured_step_time_s = 0.2345678901234567
    plan.measured_peak_bytes = 1405 * MiB + 1
    path = tmp_path / "plan.json"
    plan.to_json(path)
    loaded = Plan.from_json(path)
    assert loaded == plan
    assert list(loaded.modes.items()) == list(plan.modes.items())  # module order kept


def test_json_errors_are_clear(tmp_path):
    plan_text = make_plan(toy_profile(), 2 * GiB).to_json()
    with pytest.raises(ValueError, match="is not a revtrain profile"):
        Profile.from_json(plan_text)
    data = json.loads(plan_text)
    with pytest.raises(ValueError, match=r"unknown plan field\(s\) \['colour'\]"):
        Plan.from_json(json.dumps({**data, "payload": {**data["payload"], "colour": "red"}}))
    with pytest.raises(ValueError, match="format version 99"):
        Plan.from_json(json.dumps({**data, "version": 99}))
    del data["payload"]["budget_bytes"]
    with pytest.raises(ValueError, match=r"lacks required plan field\(s\) \['budget_bytes'\]"):
        Plan.from_json(json.dumps(data))
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(ValueError, match="invalid JSON"):
        Plan.from_json(tmp_path / "bad.json")


def tiny_plan(**overrides) -> Plan:
    fields = dict(modes={}, budget_bytes=1, granularity=1, predicted_step_time_s=0.0, predicted_peak_bytes=0)
    return Plan(**{**fields, **overrides})


@pytest.mark.parametrize(
    ("make", "match"),
    [
        (lambda: BlockProfile(name="", t_e_s=0.1, m_bytes=1), "non-empty module name"),
        (lambda: BlockProfile(name="a", t_e_s=float("nan"), m_bytes=1), "t_e_s must be finite"),
        (lambda: BlockProfile(name="a", t_e_s=0.1, m_bytes=-1), "m_bytes must be >= 0"),
        (lambda: BlockProfile(name="a", t_e_s=0.1, m_bytes=1, t_forward_s=-1.0), "t_forward_s must be >= 0"),
        (lambda: toy_profile(blocks=[BlockProfile(name="a", t_e_s=0, m_bytes=0)] * 2), "duplicate block"),
        (lambda: toy_profile(fixed_bytes=2 * GiB), "cannot exceed m_o_bytes"),
        (lambda: toy_profile(batch_size=0), "batch_size must be >= 1"),
        (lambda: tiny_plan(modes={"a": "X"}), "'M' or 'C'"),
        (lambda: tiny_plan(granularity=0), "granularity must be >= 1"),
        (lambda: tiny_plan(batch_size=0), "batch_size must be >= 1"),
    ],
)
def test_invalid_data_is_rejected(make, match):
    with pytest.raises(ValueError, match=match):
        make()


def test_make_plan_rejects_a_negative_budget():
    with pytest.raises(ValueError, match="budget_bytes must be >= 0"):
        make_plan(toy_profile(), -1)


def test_files_written_before_the_envelope_are_read(tmp_path):
    # Version 1 (before the envelope): the fields at the top level next to "format".
    plan = make_plan(toy_profile(), 2 * GiB)
    old = {"format": "revtrain.plan", "version": 1, **json.loads(plan.to_json())["payload"]}
    assert Plan.from_json(json.dumps(old)) == plan
    with pytest.raises(ValueError, match="is not a revtrain plan .kind 'revtrain.sweep'"):
        Plan.from_json(json.dumps({"kind": "revtrain.sweep", "version": 2, "payload": {}}))


# --- apply ---------------------------------------------------------------------------------


def _model_named_like_the_toy_profile(names: list[str]):
    """A model whose reversible blocks are called ``stages.<s>.<i>``, as ``toy_profile``'s."""
    import torch

    from revtrain.core import ReversibleBlock

    groups: dict[str, list[str]] = {}
    for name in names:
        _, s, i = name.split(".")
        groups.setdefault(s, []).append(i)
    model = torch.nn.Module()
    model.stages = torch.nn.ModuleDict({
        s: torch.nn.ModuleDict({i: ReversibleBlock(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)) for i in ids})
        for s, ids in groups.items()
    })
    return model


def test_apply_sets_the_planned_modes():
    from revtrain.core import get_modes

    plan = make_plan(toy_profile(), 1400 * MiB + 10 * MiB)
    assert set(plan.modes.values()) == {"M", "C"}
    model = _model_named_like_the_toy_profile(list(plan.modes))
    assert plan.apply(model) is model
    assert get_modes(model) == plan.modes


def test_apply_to_another_model_names_the_difference():
    from revtrain.core import get_modes

    plan = make_plan(toy_profile(), 2 * GiB)
    model = _model_named_like_the_toy_profile([n for n in plan.modes if n != "stages.1.2"] + ["stages.9.0"])
    before = get_modes(model)
    with pytest.raises(PlanMismatchError) as info:
        plan.apply(model)
    msg = str(info.value)
    assert "1 block(s) in the plan are not in the model: ['stages.1.2']" in msg
    assert "1 reversible block(s) of the model are not in the plan: ['stages.9.0']" in msg
    assert "made for another model (it was made for 'revnet-toy' at batch size 64); profile and plan this model again, or train the model it was made for (--model revnet-toy)." in msg
    assert get_modes(model) == before  # nothing changed


def test_apply_with_the_real_core():
    import torch

    import revtrain.core as core

    blocks = [core.ReversibleBlock(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)) for _ in range(3)]
    model = torch.nn.Sequential(core.ReversibleSequence(*blocks))
    names = [n for n, _ in core.reversible_blocks(model)]
    plan = tiny_plan(modes={n: m for n, m in zip(names, "CMC")})
    plan.apply(model)
    assert core.get_modes(model) == plan.modes
    with pytest.raises(PlanMismatchError, match=r"not in the model: \['nope'\]"):
        tiny_plan(modes={"nope": "C"}).apply(model)


def test_budget_may_be_given_as_a_size_string():
    profile = toy_profile()
    assert make_plan(profile, "2GiB") == make_plan(profile, 2 * GiB)


@settings(max_examples=200, deadline=None)
@given(
    m_o=st.integers(1, 2**40),
    fixed_frac=st.one_of(st.none(), st.floats(0, 1)),
    batch_size=st.integers(1, 4096),
    budget=st.integers(0, 2**41),
)
# Batch sizes past 2**53 (a budget of 2 TiB at 1 byte per 4096 samples): float division rounded
# m_o_at(b + 1) down to the budget itself.
@example(m_o=1, fixed_frac=None, batch_size=4096, budget=2_199_023_255_552)
def test_max_batch_size_is_the_largest_that_fits_the_linear_model(m_o, fixed_frac, batch_size, budget):
    fixed = None if fixed_frac is None else int(m_o * fixed_frac)
    profile = toy_profile(m_o_bytes=m_o, fixed_bytes=fixed, batch_size=batch_size)
    b = profile.max_batch_size(budget)
    if b == sys.maxsize:
        assert fixed == m_o <= budget
        return
    if b >= 1:
        assert profile.m_o_at(b) <= budget
    assert profile.m_o_at(b + 1) > budget
    assert profile.m_o_at(batch_size) == m_o


def test_t_e_scale_turns_isolated_t_e_into_whole_step_savings_without_changing_the_choice():
    plain = toy_profile()
    scaled = toy_profile(t_e_scale=0.6)
    for extra in (3 * MiB, 17 * MiB, 30 * MiB):
        a, b = make_plan(plain, plain.m_o_bytes + extra), make_plan(scaled, scaled.m_o_bytes + extra)
        assert a.modes == b.modes  # the knapsack's values all scale alike
        saved = sum(blk.t_e_s for blk in plain.blocks if a.modes[blk.name] == "C")
        assert b.predicted_step_time_s == pytest.approx(scaled.step_time_M_s - 0.6 * saved, rel=1e-12)
    assert Profile.from_json(scaled.to_json()).t_e_scale == 0.6
    for bad in (-0.1, 0.0):
        with pytest.raises(ValueError, match="t_e_scale must be > 0"):
            toy_profile(t_e_scale=bad)
