"""The rebuild check sees an error in any direction, never divides by a zero half, and blames
the right step when values are not finite."""

from __future__ import annotations

import math
import warnings

import numpy as np
import pytest
import torch
from torch import nn

from revtrain.core import ReversibleBlock, ReversibleSequence
from revtrain.core.checks import RunCheck, sketch
from revtrain.core.invertible import Invertible
from revtrain.errors import ReconstructionDriftWarning, ReconstructionError

from .helpers import conv_fn, make_stack


def _strict(model: nn.Module) -> nn.Module:
    for m in model.modules():
        if isinstance(m, ReversibleBlock):
            m.drift_action = "raise"
    return model


# -- zero halves: no false alarm -------------------------------------------------------------


def _zero(x: torch.Tensor, which: str) -> torch.Tensor:
    x = x.clone()
    half = x.shape[1] // 2
    if which == "x1":
        x[:, :half] = 0
    elif which == "x2":
        x[:, half:] = 0
    elif which == "all":
        x.zero_()
    elif which == "padding":  # i-RevNet pads the input with zero channels
        x[:, half - 1 : half + 1] = 0
    return x


def _tanh_stack(depth: int, coupling: str) -> ReversibleSequence:
    mult = 2 if coupling == "affine" else 1
    return ReversibleSequence(
        [
            ReversibleBlock(
                nn.Sequential(nn.Conv2d(4, 4 * mult, 3, padding=1), nn.Tanh()),
                nn.Sequential(nn.Conv2d(4, 4 * mult, 3, padding=1), nn.Tanh()),
                coupling=coupling,
            )
            for _ in range(depth)
        ]
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("coupling", ["additive", "affine"])
@pytest.mark.parametrize("which", ["x1", "x2", "all", "padding"])
def test_zero_halves_raise_no_false_alarm(which, coupling, dtype):
    torch.manual_seed(0)
    # float64: F and G with batch norm. float32: without, because batch norm of an all-zero
    # half divides the rebuild's rounding (1e-7) by sqrt(eps) and really does move the other
    # half by ~1e-3 (measured): a true report, not the false alarm tested here.
    model = make_stack(8, coupling) if dtype == torch.float64 else _tanh_stack(8, coupling)
    model = _strict(model.to(dtype))
    x = _zero(torch.randn(3, 8, 5, 5, dtype=dtype), which).requires_grad_(True)
    with warnings.catch_warnings():
        warnings.simplefilter("error", ReconstructionDriftWarning)
        model(x).square().sum().backward()
    assert torch.isfinite(x.grad).all()


class Momentum(nn.Module):
    """MomentumNet-style velocity update on a stream that starts at zero: v' = v + f(x)."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(width, width), nn.Tanh())

    def forward(self, x):
        return self.net(x)


def test_zero_stream_through_a_deep_stack_in_float32():
    torch.manual_seed(0)
    seq = _strict(ReversibleSequence([ReversibleBlock(Momentum(16), Momentum(16)) for _ in range(32)]))
    x = torch.randn(8, 16)
    v = torch.zeros(8, 16)  # the velocity stream starts at zero
    with warnings.catch_warnings():
        warnings.simplefilter("error", ReconstructionDriftWarning)
        y1, y2 = seq((v, x.requires_grad_(True)))
        (y1.square().sum() + y2.sum()).backward()


# -- errors in any direction are reported ----------------------------------------------------


class Replayed(nn.Module):
    """F whose second call (the rebuild) returns a perturbed value: an F that is not a pure
    function. ``kind`` picks the direction of the perturbation, ``size`` its norm relative to
    the output's."""

    def __init__(self, inner: nn.Module, kind: str, size: float) -> None:
        super().__init__()
        self.inner, self.kind, self.size = inner, kind, size
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        h = self.inner(x)
        if self.calls % 2 == 1 or self.size == 0:
            return h
        g = torch.Generator().manual_seed(7)
        if self.kind == "random":
            e = torch.randn(h.shape, generator=g, dtype=h.dtype)
        elif self.kind == "one sample":
            e = torch.zeros_like(h)
            e[0] = torch.randn(h[0].shape, generator=g, dtype=h.dtype)
        elif self.kind == "one entry":
            e = torch.zeros_like(h).flatten()
            e[17] = 1.0
            e = e.view_as(h)
        else:  # the same offset per channel everywhere
            e = torch.randn(1, h.shape[1], *([1] * (h.dim() - 2)), generator=g, dtype=h.dtype).expand_as(h)
        return h + self.size * h.norm() * e / e.norm()


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("kind", ["random", "one sample", "one entry", "channel offset"])
def test_a_one_percent_rebuild_error_is_reported_whatever_its_direction(kind, seed):
    torch.manual_seed(seed)
    block = _strict(ReversibleBlock(Replayed(conv_fn(4), kind, 0.01), conv_fn(4)))
    with pytest.raises(ReconstructionError, match="drifted"):
        block(torch.randn(4, 8, 5, 5, requires_grad=True)).square().sum().backward()


@pytest.mark.parametrize("kind", ["random", "rotation"])
def test_the_norm_alone_would_miss_it(kind):
    """A 1% error that keeps the norm (a rotation), or moves it by ~1e-4 only (a random
    error): invisible to a norm check at tolerance 1e-3, plain to a projection."""
    torch.manual_seed(0)
    x = torch.randn(4, 4, 5, 5, dtype=torch.float64)
    w = torch.randn_like(x)
    if kind == "rotation":  # turn x by 0.01 rad towards a direction orthogonal to it
        w = w - (w * x).sum() / x.square().sum() * x
        rebuilt = x * torch.cos(torch.tensor(0.01)) + w * (x.norm() / w.norm()) * torch.sin(torch.tensor(0.01))
    else:
        rebuilt = x + 0.01 * x.norm() * w / w.norm()
    assert abs(rebuilt.norm() - x.norm()) / x.norm() < 1e-3
    block = ReversibleBlock(nn.Identity(), nn.Identity(), drift_action="raise")
    check = RunCheck([True], torch.float64)
    check.forward(0, (x,), (x,))
    check.rebuilt(0, (rebuilt,))
    with pytest.raises(ReconstructionError, match="drifted"):
        check.finish([block], lambda i: "a test block")


def test_no_alarm_without_error():
    torch.manual_seed(0)
    block = _strict(ReversibleBlock(Replayed(conv_fn(4), "random", 0.0), conv_fn(4)))
    block(torch.randn(4, 8, 5, 5, requires_grad=True)).square().sum().backward()


@pytest.mark.parametrize("shape,dim", [((4, 16, 6, 6), 1), ((3, 7, 10), -1), ((5, 12), 1), ((2, 1000), 1)])
def test_a_sketch_leaves_the_generators_alone_and_equals_for_copies(shape, dim):
    """The forward sketches views split off the input, the rebuild fresh tensors: same numbers
    up to float32 rounding, and the model's random numbers untouched."""
    x = torch.randn(shape)
    x1, x2 = x.chunk(2, dim=dim)
    rng = torch.get_rng_state()
    printed = sketch((x1, x2))
    assert torch.equal(rng, torch.get_rng_state())
    assert printed.shape == (2, 65)
    torch.testing.assert_close(printed, sketch((x1.contiguous(), x2.contiguous())), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(printed[:, 0], torch.stack([x1.norm(), x2.norm()]))


@pytest.mark.parametrize("n", [1, 7, 64, 1000, 4099])
def test_a_sketch_estimates_the_norm_of_a_difference(n):
    """The root mean square of a sketch's projections estimates the tensor's norm (every entry
    of V^T X U has mean square |X|^2), whatever the size, within a factor of two here."""
    torch.manual_seed(0)
    ratios = []
    for _ in range(20):
        d = torch.randn(n, dtype=torch.float64)
        ratios.append(float(sketch((d,))[0, 1:].norm() / 8 / d.norm()))
    assert 0.5 < sum(ratios) / len(ratios) < 2.0 and min(ratios) > 0.1, ratios


# -- non-finite values: the right culprit ----------------------------------------------------


class NaNAfter(nn.Module):
    """Returns NaN in every entry of sample 0 (a log of a negative number, say)."""

    def forward(self, x):
        h = torch.tanh(x)
        return torch.cat([h[:1] * float("nan"), h[1:]])


@pytest.mark.parametrize("culprit", ["F", "G"])
def test_nan_from_the_forward_is_blamed_on_the_forward(culprit):
    f, g = (NaNAfter(), nn.Tanh()) if culprit == "F" else (nn.Tanh(), NaNAfter())
    block = ReversibleBlock(f, g)
    y = block(torch.randn(3, 8, requires_grad=True))
    with pytest.raises(ReconstructionError, match=rf"forward pass.*{culprit} returned NaN.*inverse is not at fault"):
        y.sum().backward()


def test_nan_from_the_forward_inside_a_run_names_the_block():
    layers = [ReversibleBlock(nn.Tanh(), nn.Tanh()) for _ in range(3)]
    layers[1] = ReversibleBlock(NaNAfter(), nn.Tanh())
    seq = ReversibleSequence(layers)
    with pytest.raises(ReconstructionError, match=r"forward pass of block 1 of a run of 3.*F returned"):
        seq(torch.randn(3, 8, requires_grad=True)).sum().backward()


@pytest.mark.parametrize("split_dim,shape", [(-1, (4, 7, 16)), (1, (4, 8, 5, 5)), (2, (3, 4, 6, 5))])
def test_rebuilt_contiguous_halves_compare_with_strided_originals(split_dim, shape):
    """The forward sees views split off the input, the rebuild returns fresh tensors: the
    check must compare them as the same values whatever the split dimension."""
    torch.manual_seed(0)
    half = shape[split_dim] // 2
    width = shape[-1] if split_dim != -1 else half

    def fn():
        return nn.Sequential(nn.Linear(width, width), nn.Tanh())

    seq = _strict(ReversibleSequence([ReversibleBlock(fn(), fn(), split_dim=split_dim) for _ in range(3)]))
    with warnings.catch_warnings():
        warnings.simplefilter("error", ReconstructionDriftWarning)
        seq(torch.randn(shape, requires_grad=True)).square().sum().backward()


def test_check_every_checks_all_layers_on_one_step_in_k(monkeypatch):
    """``check_every=2``: the first step sketches every block of the run (forward inputs, the
    run's output and the rebuilt inputs), the second none: the layers count their calls alike,
    so they check together."""
    from revtrain.core import checks

    seen: list[int] = []
    original = checks.sketch
    monkeypatch.setattr(checks, "sketch", lambda state: seen.append(1) or original(state))
    torch.manual_seed(0)
    model = make_stack(4, check_every=2)
    counted = []
    for _ in range(2):
        seen.clear()
        model(torch.randn(2, 8, 4, 4)).square().sum().backward()
        counted.append(len(seen))
        assert [b.__dict__["_check_calls"] for b in model] == [len(counted)] * 4
    # 4 forward inputs, the run's output and 4 rebuilt inputs on the first step; none on the second.
    assert counted == [9, 0]
    with pytest.raises(ValueError, match="check_every"):
        make_stack(1, check_every=0)


class _Drifting(nn.Module):
    """An F whose rebuild call returns 1/1.1 of what its forward call returned."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return torch.tanh(x) * (1.1 if self.calls % 2 else 1.0)


def test_check_every_still_reports_a_drifting_rebuild_within_that_many_steps():
    torch.manual_seed(0)
    block = ReversibleBlock(_Drifting(), nn.Identity(), check_every=3, drift_action="raise")
    raised = []
    for _ in range(6):
        try:
            block(torch.randn(2, 8, requires_grad=True)).sum().backward()
            raised.append(False)
        except ReconstructionError:
            raised.append(True)
    assert raised == [True, False, False, True, False, False]


def _drifting_model():
    return nn.Sequential(
        nn.Linear(8, 8),
        ReversibleSequence([ReversibleBlock(_Drifting(), nn.Identity(), drift_action="raise") for _ in range(2)]),
        ReversibleBlock(nn.Tanh(), nn.Tanh(), drift_action="raise"),
    )


@pytest.mark.parametrize("every,raised", [(1, [True] * 4), (3, [True, False, False, True]), (0, [False] * 4)])
def test_set_rebuild_checks_sets_every_reversible_layer_and_zero_turns_the_check_off(every, raised):
    """The two drifting blocks (a run of two) raise on a step that checks them; with ``every=3``
    every layer is checked at steps 0 and 3; with 0 nothing is checked and the drift goes
    unnoticed."""
    from revtrain.core import set_rebuild_checks

    torch.manual_seed(0)
    model = _drifting_model()
    assert set_rebuild_checks(model, every) == 3
    layers = [m for m in model.modules() if isinstance(m, ReversibleBlock)]
    assert all(b.check_reconstruction == (every > 0) and b.check_every == max(every, 1) for b in layers)
    got = []
    for _ in range(4):
        try:
            model(torch.randn(2, 8)).sum().backward()
            got.append(False)
        except ReconstructionError:
            got.append(True)
    assert got == raised


def test_set_rebuild_checks_leaves_gradients_unchanged():
    from revtrain.core import set_rebuild_checks

    grads = []
    for every in (1, 3, 0):
        torch.manual_seed(0)
        model = make_stack(3).double()
        set_rebuild_checks(model, every)
        x = torch.randn(2, 8, 4, 4, dtype=torch.float64, requires_grad=True)
        model(x).square().sum().backward()
        grads.append([x.grad] + [p.grad for p in model.parameters()])
    for other in grads[1:]:
        for a, b in zip(grads[0], other):
            torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_set_rebuild_checks_takes_numpy_integers():
    from revtrain.core import set_rebuild_checks

    model = make_stack(2)
    assert set_rebuild_checks(model, np.int64(4)) == 2
    assert all(b.check_every == 4 and type(b.check_every) is int for b in model)


@pytest.mark.parametrize("every", [-1, 1.5, True, "2"])
def test_set_rebuild_checks_refuses_anything_but_a_count_and_changes_nothing(every):
    from revtrain.core import set_rebuild_checks

    model = make_stack(2, check_every=3)
    with pytest.raises(ValueError, match="integer >= 0"):
        set_rebuild_checks(model, every)
    assert all(b.check_every == 3 and b.check_reconstruction for b in model)


def test_a_drift_message_on_cuda_names_tf32_when_it_is_allowed(monkeypatch):
    from revtrain.core import checks

    assert [name for name, _ in checks._tf32_flags()] == [
        "torch.backends.cudnn.allow_tf32", "torch.backends.cuda.matmul.allow_tf32"]
    on_gpu, on_cpu = True, False
    flags = [("torch.backends.cudnn.allow_tf32", True), ("torch.backends.cuda.matmul.allow_tf32", False)]
    monkeypatch.setattr(checks, "_tf32_flags", lambda: flags)
    assert "torch.backends.cudnn.allow_tf32 is True" in checks._tf32_hint(on_gpu)
    assert "set it to False" in checks._tf32_hint(on_gpu)
    assert checks._tf32_hint(on_cpu) == ""  # the CPU has no TF32
    flags[0] = ("torch.backends.cudnn.allow_tf32", False)
    assert checks._tf32_hint(on_gpu) == ""


def test_a_huge_but_finite_rebuild_error_is_drift_not_a_non_finite_rebuild():
    """Compared in float64: a float32 rebuild that is off by 1e30 warns of drift; only a
    non-finite rebuild raises as one."""
    torch.manual_seed(0)
    state = (torch.randn(4, 4, 6, 6), torch.randn(4, 2, 6, 6))
    layers = [ReversibleBlock(nn.Identity(), nn.Identity())]

    def run(rebuilt):
        check = RunCheck([True], torch.float32)
        check.forward(0, state, state)
        check.rebuilt(0, rebuilt)
        return check.finish(layers, str)

    with pytest.warns(ReconstructionDriftWarning, match="drifted .* by [0-9.]+e\\+(2|3)[0-9]"):
        errors = run((state[0] + 1e30, state[1]))
    assert math.isfinite(errors[0])
    with pytest.raises(ReconstructionError, match=r"non-finite values \(input x2\)"):
        run((state[0], torch.full_like(state[1], float("nan"))))


class _Float64Inverse(Invertible):
    """A float32 layer whose inverse computes (and returns) float64."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.log_s = nn.Parameter(torch.zeros(channels, 1, 1))

    def forward_state(self, xs):
        (x,) = xs
        return (x * self.log_s.exp(),)

    def inverse_state(self, ys):
        (y,) = ys
        return (y.double() * (-self.log_s.double()).exp(),)


def test_a_rebuild_in_another_precision_is_compared_through_whole_fingerprints():
    """A rebuild that comes back in float64 for a float32 forward cannot meet the forward's
    float32 projections in one product; it is compared through whole fingerprints (as before
    the one-product path): no error, no drift warning, and a drifting one is still caught."""
    x = torch.randn(2, 4, 8, 8, requires_grad=True)
    layer = _Float64Inverse(4)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        layer(x).sum().backward()
    assert x.grad is not None and x.grad.dtype == torch.float32
    with torch.no_grad():
        layer.log_s.fill_(0.5)
    original = layer.inverse_state
    layer.inverse_state = lambda ys: (original(ys)[0] * 1.01,)  # a 1% wrong inverse
    with pytest.warns(ReconstructionDriftWarning, match="drifted"):
        layer(torch.randn(2, 4, 8, 8, requires_grad=True)).sum().backward()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("check_every", [1, 2])
def test_an_m_mode_step_on_cuda_syncs_with_the_host_only_to_read_its_verdicts(check_every):
    """The check waits for the device only on a step it samples (its sketches go to the host);
    with ``check_every=2`` every other step checks, the first after the warm-up's even count, and
    the other step waits for nothing."""
    torch.manual_seed(0)
    model = make_stack(4, check_every=check_every).cuda()
    x = torch.randn(2, 8, 4, 4, device="cuda", requires_grad=True)
    for _ in range(2 * check_every):  # warm-up: plans and index patterns cached
        model(x).square().sum().backward()
    torch.cuda.synchronize()
    counts = []
    for _ in range(check_every):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                loss = model(x).square().sum()
                loss.backward()
            finally:
                torch.cuda.set_sync_debug_mode("default")
        # Only the warnings of synchronising ops (set_sync_debug_mode's first call also warns
        # that the mode is a prototype).
        counts.append(sum("called a synchronizing CUDA operation" in str(w.message) for w in caught))
    assert counts[0] >= 1 and counts[1:] == [0] * (check_every - 1), counts


def test_a_non_finite_rebuild_raises_before_the_run_hands_back_its_gradients():
    """The run reads its verdicts before returning its gradients: none of them reach .grad or a
    post-accumulate-grad hook (an optimizer step fused into backward, DDP's all-reduce).
    Reading them at the end of the whole backward instead, on a GPU, was tried and reverted
    for this."""
    f = nn.Sequential(nn.Linear(4, 4), NaNAfter())
    model = ReversibleSequence([ReversibleBlock(nn.Tanh(), nn.Tanh()), ReversibleBlock(f, nn.Tanh())])
    fired: list[str] = []
    for name, p in model.named_parameters():
        p.register_post_accumulate_grad_hook(lambda p, name=name: fired.append(name))
    x = torch.randn(3, 8, requires_grad=True)
    with pytest.raises(ReconstructionError, match="forward pass of block 1 of a run of 2.*F returned"):
        model(x).sum().backward()
    assert fired == [] and x.grad is None
    assert all(p.grad is None for p in model.parameters())


# -- the default schedule ---------------------------------------------------------------------


def test_the_default_schedule_checks_the_first_calls_then_one_in_default_every():
    from revtrain.core.checks import DEFAULT_EVERY, FIRST_CHECKS, check_due

    block = ReversibleBlock(nn.Tanh(), nn.Tanh())
    assert block.check_every is None and DEFAULT_EVERY <= 100
    due = [check_due(block) for _ in range(FIRST_CHECKS + 3 * DEFAULT_EVERY)]
    checked = [k for k, d in enumerate(due) if d]
    assert checked[:FIRST_CHECKS] == list(range(FIRST_CHECKS))
    gaps = [b - a for a, b in zip(checked[FIRST_CHECKS - 1 :], checked[FIRST_CHECKS:])]
    assert gaps == [DEFAULT_EVERY] * 3
    block.check_every = 1
    assert all(check_due(block) for _ in range(10))
    block.check_reconstruction = False
    assert not any(check_due(block) for _ in range(10))


class _DriftsLate(nn.Module):
    """An F that turns non-invertible from forward call ``start`` on: its rebuild call returns
    1/1.1 of what the forward returned."""

    def __init__(self, start: int) -> None:
        super().__init__()
        self.start, self.forwards, self.rebuilding = start, 0, False

    def forward(self, x):
        if not self.rebuilding:
            self.forwards += 1
        scale = 1.1 if (self.forwards > self.start and not self.rebuilding) else 1.0
        self.rebuilding = not self.rebuilding
        return torch.tanh(x) * scale


def test_a_drift_from_step_200_is_reported_within_default_every_steps():
    """A persistent drift that appears late (step 200 of a run) is reported by the default
    schedule by step 200 + DEFAULT_EVERY, and nothing is reported before it appears."""
    from revtrain.core.checks import DEFAULT_EVERY

    torch.manual_seed(0)
    f = _DriftsLate(start=200)
    model = ReversibleSequence([ReversibleBlock(nn.Tanh(), nn.Tanh()), ReversibleBlock(f, nn.Tanh()),
                                ReversibleBlock(nn.Tanh(), nn.Tanh())])
    reported = None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", ReconstructionDriftWarning)
        for step in range(200 + DEFAULT_EVERY + 1):
            before = len(caught)
            model(torch.randn(2, 8, requires_grad=True)).sum().backward()
            if len(caught) > before:
                reported = step
                break
    assert reported is not None and 200 <= reported <= 200 + DEFAULT_EVERY, reported
    assert "drifted" in str(caught[-1].message)


def test_a_healthy_bf16_autocast_run_warns_of_no_drift():
    """On CPU under bf16 autocast, F and G compute in bf16: the default tolerance follows the
    autocast dtype, so a healthy run of the zoo's RevNet says nothing, while float32 keeps its
    own (tighter) tolerance."""
    from revtrain.core.checks import TOLERANCES, tolerance_of
    from revtrain.models import create_model

    torch.manual_seed(0)
    model = create_model("revnet38", num_classes=10)
    model.train()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    with warnings.catch_warnings():
        warnings.simplefilter("error", ReconstructionDriftWarning)
        for _ in range(3):
            x, y = torch.randn(8, 3, 32, 32), torch.randint(0, 10, (8,))
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = nn.functional.cross_entropy(model(x), y)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
    block = ReversibleBlock(nn.Tanh(), nn.Tanh())
    assert tolerance_of(block, torch.bfloat16) == TOLERANCES[torch.bfloat16] > tolerance_of(block, torch.float32)
    block.drift_tolerance = 0.5
    assert tolerance_of(block, torch.bfloat16) == 0.5


@pytest.mark.parametrize("tf32_on", [True, False])
def test_tf32_on_cuda_gets_float16s_tolerance(monkeypatch, tf32_on):
    """TF32 keeps float16's 10 mantissa bits, and PyTorch allows it for CUDA convolutions by
    default: a float32 run on CUDA with a TF32 switch on is judged by float16's tolerance, so a
    rebuild error of 5e-3 (TF32's order) warns only where TF32 is off (or on the CPU)."""
    import revtrain.core.checks as checks

    monkeypatch.setattr(checks, "_tf32_flags", lambda: [("torch.backends.cudnn.allow_tf32", tf32_on)])
    block = ReversibleBlock(nn.Tanh(), nn.Tanh())
    assert checks.tolerance_of(block, torch.float32, tf32=True) == checks.TOLERANCES[torch.float16]
    assert checks.tolerance_of(block, torch.float64, tf32=True) == checks.TOLERANCES[torch.float64]
    torch.manual_seed(0)
    xs = [torch.randn(4, 64), torch.randn(4, 64)]
    ys = [torch.randn(4, 64), torch.randn(4, 64)]
    check = RunCheck([True], torch.float32)
    check.forward(0, xs, ys)
    check.cuda = True  # as if the tensors lived on a GPU
    check.rebuilt(0, [x * (1 + 5e-3) for x in xs])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        errors = check.finish([block], lambda i: f"block {i}")
    assert 4e-3 < errors[0] < 6e-3
    drift = [w for w in caught if issubclass(w.category, ReconstructionDriftWarning)]
    assert len(drift) == (0 if tf32_on else 1)


def test_set_rebuild_checks_none_restores_the_default_schedule():
    """After ``every=1`` (or 0), ``None`` puts every layer back on the default schedule: the
    first FIRST_CHECKS calls, then one in DEFAULT_EVERY; anything but None or an int >= 0 is refused."""
    from revtrain.core import set_rebuild_checks
    from revtrain.core.checks import DEFAULT_EVERY, FIRST_CHECKS, check_due

    model = _drifting_model()
    set_rebuild_checks(model, 0)
    assert set_rebuild_checks(model, None) == 3
    layers = [m for m in model.modules() if isinstance(m, ReversibleBlock)]
    assert all(b.check_reconstruction and b.check_every is None for b in layers)
    due = [check_due(layers[0]) for _ in range(FIRST_CHECKS + DEFAULT_EVERY)]
    assert due == [True] * FIRST_CHECKS + [False] * (DEFAULT_EVERY - 1) + [True]
    for bad in (-1, 1.5, "1", True):
        with pytest.raises(ValueError, match="None .*or an integer >= 0"):
            set_rebuild_checks(model, bad)
