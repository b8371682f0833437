"""Stage 2 on a real (tiny) model: what the profile counts, and that profiling changes nothing."""

from __future__ import annotations

import pytest
import torch

from revtrain.core import reversible_blocks
from revtrain.planner import (
    Profile,
    measure_step,
    measure_step_stats,
    measure_steps,
    profile_model,
    saved_bytes_in_context,
)

from .helpers import assert_same, snapshot, tiny_batch, tiny_model


def test_profile_covers_every_block_in_module_order(tiny_profiled):
    model, _, profile = tiny_profiled
    assert [b.name for b in profile.blocks] == [n for n, _ in reversible_blocks(model)]
    assert profile.batch_size == 8 and profile.input_shape == (3, 12, 12) and profile.dtype == "float32"
    assert profile.memory_method == "cpu-dispatch" and profile.optimizer == "SGD"
    for b in profile.blocks:
        assert b.m_bytes > 0
        timings = (b.t_forward_s, b.t_forward_C_s, b.t_backward_M_s, b.t_backward_C_s)
        assert all(t is not None and t > 0 for t in timings)


def test_profiling_leaves_the_model_as_it_was():
    model, batch = tiny_model(), tiny_batch()
    model.stage2[1].mode = "C"
    model.head.eval()
    model.stem[0].weight.grad = torch.ones_like(model.stem[0].weight)
    before = snapshot(model)
    profile_model(model, batch, repeats=1, warmup=1)
    assert_same(before, snapshot(model))


def test_saved_tensor_hooks_agree_with_the_tracker(tiny_profiled):
    # The two counts differ only by what M-mode keeps outside saved tensors (two float64 input
    # norms per block on the autograd context), which the tracker sees and the hooks do not:
    # tens of bytes per block. 1 KiB bounds that with room; a block's m is tens of KiB here.
    _, _, profile = tiny_profiled
    for b in profile.blocks:
        assert b.m_hooks_bytes is not None and b.m_tracker_bytes is not None
        assert abs(b.m_hooks_bytes - b.m_tracker_bytes) <= 1024, b
        assert b.m_bytes == max(b.m_hooks_bytes, b.m_tracker_bytes)


def test_m_grows_linearly_with_the_batch():
    # Activations are per sample; BN's saved per-channel statistics are the only batch-independent
    # saved tensors, a few hundred bytes per block.
    model = tiny_model()
    small, _ = saved_bytes_in_context(model, tiny_batch(4))
    large, _ = saved_bytes_in_context(model, tiny_batch(8))
    for name in small:
        assert large[name] - 2 * small[name] == pytest.approx(0, abs=1024), name


def test_m_o_is_the_measured_baseline_m_peak_and_bounds_with_m_the_baseline_c_peak(tiny_profiled):
    model, batch, profile = tiny_profiled
    peak_m = measure_step_stats(model, batch, modes="M", repeats=0, warmup=1).peak_bytes
    peak_c = measure_step_stats(model, batch, modes="C", repeats=0, warmup=1).peak_bytes
    assert profile.m_o_bytes == profile.peak_M_bytes == peak_m  # the CPU tracker is deterministic
    assert profile.peak_C_bytes == peak_c
    assert peak_m < peak_c <= profile.m_o_bytes + sum(b.m_bytes for b in profile.blocks)


def test_fixed_bytes_are_parameters_buffers_gradients_and_momentum(tiny_profiled):
    model, _, profile = tiny_profiled
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    buffers = sum(b.numel() * b.element_size() for b in model.buffers())
    assert profile.fixed_bytes == 3 * params + buffers  # weights, gradients, SGD momentum


def test_resident_bytes_include_the_batch():
    model, batch = tiny_model(), tiny_batch()
    m = measure_step_stats(model, batch, modes="M", repeats=0, warmup=1)
    x, y = batch
    batch_bytes = x.numel() * x.element_size() + y.numel() * y.element_size()
    grads = sum(p.numel() * p.element_size() for p in model.parameters())
    assert m.resident_bytes == m.fixed_bytes - grads + batch_bytes  # no gradient is live at entry
    assert m.peak_bytes > m.resident_bytes


def test_profile_round_trips_through_json(tiny_profiled, tmp_path):
    _, _, profile = tiny_profiled
    path = tmp_path / "profile.json"
    profile.to_json(path)
    again = Profile.from_json(path)
    assert again == profile
    assert Profile.from_json(profile.to_json()) == profile


def test_a_model_without_reversible_blocks_is_refused():
    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(3 * 12 * 12, 10))
    with pytest.raises(ValueError, match="no ReversibleBlock"):
        profile_model(model, tiny_batch(), repeats=1)


def test_a_model_elsewhere_than_the_device_is_refused():
    with pytest.raises(ValueError, match="move the model first"):
        measure_step(tiny_model().double(), tiny_batch(), device="meta", repeats=1)


def test_alternating_measurement_gives_each_setting_its_own_peak(tiny_profiled):
    model, batch, profile = tiny_profiled
    both = measure_steps(model, batch, {"M": "M", "C": "C"}, repeats=2, warmup=1)
    assert both["M"].peak_bytes == profile.m_o_bytes
    assert both["C"].peak_bytes == profile.peak_C_bytes
    assert len(both["M"].times_s) == len(both["C"].times_s) == 2


def test_t_e_lost_in_noise_falls_back_to_the_forward_time(monkeypatch):
    # A clock under which both modes take the same time: the measured difference is 0, which
    # cannot be (M-mode does C-mode's work plus a rebuild), so t_e is the paper's t_f1.
    import revtrain.planner.profile as profile_mod

    monkeypatch.setattr(profile_mod, "timer", lambda device: lambda: lambda: 0.25)
    timing = profile_mod.time_blocks(tiny_model(), tiny_batch()[0], repeats=1, warmup=1)
    assert len(timing) == 5
    for t in timing.values():
        assert (t.forward_M_s, t.backward_M_s, t.forward_C_s, t.backward_C_s) == (0.25,) * 4
        assert t.t_e_s == t.forward_M_s == 0.25
