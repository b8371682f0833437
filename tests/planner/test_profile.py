"""Stage 2 on a real (tiny) model: what the profile counts, and that profiling changes nothing."""

from __future__ import annotations

import pytest
import torch

from revtrain.core import reversible_blocks, set_rebuild_checks
from revtrain.core.checks import PROJECTIONS
from revtrain.planner import Profile, TimingRule, measure_steps, prepare, profile_model, saved_bytes_in_context

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
    # The two counts differ at most by the rebuild check's fingerprint of the block's input (two
    # halves x (norm + PROJECTIONS projections) in float32 = 520 bytes), which one of the two
    # counts sees and the other does not; a block's m is tens of KiB here.
    _, _, profile = tiny_profiled
    check_state = 2 * (1 + PROJECTIONS) * 4
    for b in profile.blocks:
        assert b.m_hooks_bytes is not None and b.m_tracker_bytes is not None
        assert abs(b.m_hooks_bytes - b.m_tracker_bytes) <= check_state, b
        assert b.m_bytes == max(b.m_hooks_bytes, b.m_tracker_bytes)


def measure(model, batch, settings, **kwargs):
    with prepare(model, batch, **kwargs) as setup:
        return measure_steps(setup, settings)


def peak(model, batch, modes):
    return measure(model, batch, {"step": modes}, repeats=0, warmup=1)["step"]


def test_m_grows_linearly_with_the_batch():
    # Activations are per sample; BN's saved per-channel statistics are the only batch-independent
    # saved tensors, a few hundred bytes per block.
    model = tiny_model()
    with prepare(model, tiny_batch(4)) as setup:
        small, _ = saved_bytes_in_context(setup)
        large, _ = saved_bytes_in_context(setup.with_batch(tiny_batch(8)))
    for name in small:
        assert large[name] - 2 * small[name] == pytest.approx(0, abs=1024), name


def test_m_o_is_the_measured_baseline_m_peak_and_bounds_with_m_the_baseline_c_peak(tiny_profiled):
    model, batch, profile = tiny_profiled
    peak_m = peak(model, batch, "M").peak_bytes
    peak_c = peak(model, batch, "C").peak_bytes
    assert profile.m_o_bytes == profile.peak_M_bytes == peak_m  # the CPU tracker is deterministic
    assert profile.peak_C_bytes == peak_c
    assert peak_m < peak_c <= profile.m_o_bytes + sum(b.m_bytes for b in profile.blocks)


def test_fixed_bytes_are_parameters_buffers_gradients_and_momentum(tiny_profiled):
    model, _, profile = tiny_profiled
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    buffers = sum(b.numel() * b.element_size() for b in model.buffers())
    assert profile.fixed_bytes == 3 * params + buffers  # weights, gradients, SGD momentum


def test_resident_bytes_include_the_batch_and_the_caches_kept_between_steps():
    model, batch = tiny_model(), tiny_batch()
    x, y = batch
    batch_bytes = x.numel() * x.element_size() + y.numel() * y.element_size()
    grads = sum(p.numel() * p.element_size() for p in model.parameters())
    set_rebuild_checks(model, 0)  # no rebuild check: nothing is cached between steps
    m = peak(model, batch, "M")
    assert m.resident_bytes == m.fixed_bytes - grads + batch_bytes  # no gradient is live at entry
    assert m.peak_bytes > m.resident_bytes
    set_rebuild_checks(model, 1)  # the check keeps its sketches on the host: no tensor between steps
    checked = peak(model, batch, "M")
    assert checked.resident_bytes == m.resident_bytes and checked.fixed_bytes == m.fixed_bytes


class _CachingLinear(torch.nn.Linear):
    """A layer that keeps a tensor between steps as a plain attribute (as a lookup table would)."""

    def forward(self, x):
        if "table" not in self.__dict__:
            self.table = torch.ones(1000)  # float32: 4,000 bytes kept from the first step on
        return super().forward(x) * self.table[0]


def test_resident_bytes_count_a_tensor_a_layer_keeps_between_steps():
    model, batch = tiny_model(), tiny_batch()
    set_rebuild_checks(model, 0)
    before = peak(model, batch, "M")
    head = next(name for name, mod in model.named_modules() if isinstance(mod, torch.nn.Linear))
    plain = model.get_submodule(head)
    caching = _CachingLinear(plain.in_features, plain.out_features)
    caching.load_state_dict(plain.state_dict())
    parent, _, leaf = head.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, leaf, caching)
    after = peak(model, batch, "M")
    assert after.resident_bytes == before.resident_bytes + 1000 * 4


def test_profile_round_trips_through_json(tiny_profiled, tmp_path):
    _, _, profile = tiny_profiled
    path = tmp_path / "profile.json"
    profile.to_json(path)
    again = Profile.from_json(path)
    assert again == profile
    assert Profile.from_json(profile.to_json()) == profile


def test_a_model_without_reversible_blocks_is_refused():
    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(3 * 12 * 12, 10))
    with pytest.raises(ValueError, match="no reversible layer"):
        profile_model(model, tiny_batch(), repeats=1)


def test_a_model_on_two_devices_is_refused():
    model = tiny_model()
    model.head[-1].to("meta")
    with pytest.raises(ValueError, match="move the model first"):
        measure(model, tiny_batch(), {"M": "M"}, repeats=1)


def test_alternating_measurement_gives_each_setting_its_own_peak(tiny_profiled):
    model, batch, profile = tiny_profiled
    both = measure(model, batch, {"M": "M", "C": "C"}, repeats=2, max_repeats=2, warmup=1)
    assert both["M"].peak_bytes == profile.m_o_bytes
    assert both["C"].peak_bytes == profile.peak_C_bytes
    assert len(both["M"].times_s) == len(both["C"].times_s) == 2


def test_t_e_lost_in_noise_falls_back_to_the_forward_time(monkeypatch):
    # A clock under which both modes take the same time: the measured difference is 0, which
    # cannot be (M-mode does C-mode's work plus a rebuild), so t_e is the paper's t_f1.
    import revtrain.planner.block_timing as block_timing

    monkeypatch.setattr(block_timing, "timer", lambda device: lambda: lambda: 0.25)
    with prepare(tiny_model(), tiny_batch()) as setup:
        timing = block_timing.time_blocks(setup)
    assert len(timing) == 5
    for t in timing.values():
        assert (t.forward_M_s, t.backward_M_s, t.forward_C_s, t.backward_C_s) == (0.25,) * 4
        assert t.t_e_s == t.forward_M_s == 0.25
        assert t.t_e_iqr_s == 0 and t.pairs == TimingRule().min_pairs  # no spread: stops at the minimum


class _ScriptedClock:
    """A clock whose M runs take ``m`` and C runs ``c`` seconds, the M-C difference one pair
    ``noise`` above, the next ``noise`` below: forward and backward each take half a run."""

    def __init__(self, m: float, c: float, noise: float) -> None:
        self.m, self.c, self.noise, self.calls = m, c, noise, 0

    def __call__(self, device):
        def start():
            # Calls come in the order of time_blocks: (forward, backward) of one mode, then of
            # the other; which mode first alternates per pair, so track the pair ourselves.
            k = self.calls
            self.calls += 1
            run, pair = k // 2, k // 4
            first_is_m = pair % 2 == 0
            is_m = (run % 2 == 0) == first_is_m
            wobble = self.noise * (1 if pair % 2 == 0 else -1)
            seconds = (self.m + wobble) / 2 if is_m else self.c / 2
            return lambda: seconds

        return start


@pytest.mark.parametrize(("noise", "settles_early"), [(0.0001, True), (0.004, False)])
def test_t_e_is_timed_in_pairs_until_its_median_is_stable(monkeypatch, noise, settles_early):
    # t_e = 0.010 s. With a spread of 2% of it the rule stops at the minimum; with a spread of 80%
    # it needs far more pairs and stops at the cap. Every block's spread is recorded.
    import revtrain.planner.block_timing as block_timing

    rule = TimingRule(warmup_pairs=1, min_pairs=5, max_pairs=12, precision=0.05)
    monkeypatch.setattr(block_timing, "timer", _ScriptedClock(0.030, 0.020, noise))
    with prepare(tiny_model(), tiny_batch()) as setup:
        timing = block_timing.time_blocks(setup, rule)
    for t in timing.values():
        assert t.t_e_s == pytest.approx(0.010, abs=noise + 1e-12)
        assert t.pairs == (rule.min_pairs if settles_early else rule.max_pairs)
        assert t.t_e_iqr_s == pytest.approx(2 * noise, rel=1e-6)


def test_the_profile_records_the_spread_of_t_e(tiny_profiled):
    _, _, profile = tiny_profiled
    for b in profile.blocks:
        assert b.t_e_pairs is not None and TimingRule().min_pairs <= b.t_e_pairs <= TimingRule().max_pairs
        assert b.t_e_iqr_s is not None and b.t_e_iqr_s >= 0


@pytest.mark.parametrize(("noisy", "rounds"), [(False, 3), (True, 6)])
def test_whole_steps_are_timed_until_their_medians_are_stable(monkeypatch, noisy, rounds):
    # A step "takes" 1 s, or alternately 1 s and 2 s: the first is stable after the 3 rounds asked
    # for, the second never is (its median is known to ~30%, not 2%) and stops at max_repeats.
    import itertools

    import revtrain.planner.measure as measure_mod

    clock = itertools.cycle([1.0, 1.0, 2.0, 2.0] if noisy else [1.0])

    def scripted(fn, device):
        fn()
        return next(clock)

    monkeypatch.setattr(measure_mod, "timed", scripted)
    with prepare(tiny_model(), tiny_batch(), repeats=3, max_repeats=6, warmup=1) as setup:
        adaptive = measure_steps(setup, {"M": "M", "C": "C"})
        fixed = measure_steps(setup, {"M": "M"}, repeats=2)
    assert len(adaptive["M"].times_s) == len(adaptive["C"].times_s) == rounds
    assert len(fixed["M"].times_s) == 2


def test_each_timed_step_follows_a_step_of_its_own_setting_and_the_order_rotates(monkeypatch):
    # A step is faster or slower by what the step before it left in the allocator (on the CPU
    # a step right after a C-mode step is slower): every timed step must follow an untimed step
    # of its own setting, the steady state of training with it. Counted on the model's forwards.
    import revtrain.planner.measure as measure_mod

    model = tiny_model()
    block = next(b for _, b in reversible_blocks(model))
    forwards: list[str] = []
    timed_at: list[int] = []
    model.register_forward_pre_hook(lambda *_: forwards.append(block.mode))

    def counted(fn, device):
        timed_at.append(len(forwards))
        fn()
        return 1.0

    monkeypatch.setattr(measure_mod, "timed", counted)
    with prepare(model, tiny_batch(), repeats=3, max_repeats=3, warmup=1) as setup:
        measure_steps(setup, {"M": "M", "C": "C"})
    assert [forwards[i] for i in timed_at] == ["M", "C", "C", "M", "M", "C"]
    assert all(forwards[i - 1] == forwards[i] for i in timed_at)
