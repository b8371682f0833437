"""make_plan(use_measured_baseline_c=True): a measured baseline-C that fits beats the additive model."""

from __future__ import annotations

from revtrain.planner import BlockProfile, Profile, make_plan

MiB = 2**20


def profile(peak_c: int | None) -> Profile:
    blocks = [
        BlockProfile(name="a", t_e_s=0.01, m_bytes=40 * MiB),
        BlockProfile(name="b", t_e_s=0.02, m_bytes=40 * MiB),
        BlockProfile(name="c", t_e_s=-0.001, m_bytes=40 * MiB),  # C-mode does not pay: stays M
    ]
    return Profile(
        model="toy", batch_size=8, input_shape=(3, 8, 8), dtype="float32", device="cpu",
        blocks=blocks, m_o_bytes=100 * MiB, step_time_M_s=0.5, peak_C_bytes=peak_c,
    )


def test_measured_baseline_c_within_budget_switches_every_block_that_pays():
    # Additive model: 100 + 120 MiB; measured baseline-C: 150 MiB; budget 160 MiB.
    plan = make_plan(profile(150 * MiB), 160 * MiB, use_measured_baseline_c=True)
    assert plan.modes == {"a": "C", "b": "C", "c": "M"}
    assert plan.predicted_peak_bytes == 150 * MiB  # min(100 + 80, 150)
    assert plan.predicted_step_time_s == 0.5 - 0.03


def test_without_the_flag_or_a_fitting_measurement_the_additive_model_decides():
    for plan in (
        make_plan(profile(150 * MiB), 160 * MiB),  # flag off: the paper's model
        make_plan(profile(170 * MiB), 160 * MiB, use_measured_baseline_c=True),  # does not fit
        make_plan(profile(None), 160 * MiB, use_measured_baseline_c=True),  # not measured
    ):
        assert plan.modes == {"a": "M", "b": "C", "c": "M"}
        assert plan.predicted_peak_bytes == 140 * MiB
