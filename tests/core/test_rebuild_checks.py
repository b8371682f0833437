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
from revtrain.core.checks import RebuildCheck, check_rebuilds
from revtrain.core.fingerprint import _Plan, _slab, fingerprint, layout_of
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
    ones = torch.ones(1, dtype=torch.float64)
    layout = layout_of([x])
    check = RebuildCheck(block, "a test block", fingerprint([x], layout), fingerprint([rebuilt], layout), ones)
    with pytest.raises(ReconstructionError, match="drifted"):
        check_rebuilds([check])


def test_no_alarm_without_error():
    torch.manual_seed(0)
    block = _strict(ReversibleBlock(Replayed(conv_fn(4), "random", 0.0), conv_fn(4)))
    block(torch.randn(4, 8, 5, 5, requires_grad=True)).square().sum().backward()


@pytest.mark.parametrize("shape,dim", [((4, 16, 6, 6), 1), ((3, 7, 10), -1), ((5, 12), 1)])
def test_fingerprint_reads_views_without_copies_and_leaves_generators_alone(shape, dim):
    x = torch.randn(shape)
    x1, x2 = x.chunk(2, dim=dim)
    layout = layout_of((x1, x2))
    for half, k in zip((x1, x2), layout):
        assert _slab(half, _Plan.of(half, k)).data_ptr() == half.data_ptr()  # a view of the half, not a copy
    rng = torch.get_rng_state()
    prints = fingerprint((x1, x2), layout)
    assert torch.equal(rng, torch.get_rng_state())
    # A contiguous copy (what a rebuild returns) fingerprinted with the original's layout gives
    # the same numbers, up to float32 products summed in another order.
    copies = (x1.contiguous(), x2.contiguous())
    torch.testing.assert_close(prints, fingerprint(copies, layout), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("shape", [(2, 8, 4, 4), (8, 16, 8, 8), (3, 6, 5)])
def test_a_run_whose_first_state_is_cut_otherwise_folds_as_batches_with_the_same_values(shape, monkeypatch):
    """The first state of a stack is two halves split off the input (strided), the rest are
    fresh tensors: at small shapes their rows differ (other plans). The fold keeps them batches
    (one per stretch of one plan), never the per-state path, and the fingerprints are the ones
    taken state by state."""
    from revtrain.core import fingerprint as fp

    torch.manual_seed(0)
    states = [tuple(torch.randn(shape).chunk(2, dim=1))]
    states += [tuple(torch.randn(states[0][0].shape) for _ in range(2)) for _ in range(5)]
    layouts = [layout_of(s) for s in states]
    if len(shape) == 4 and shape[0] == 2:
        assert layouts[0] != layouts[1]  # the case this is about: two plans in one run

    def refuse(self):
        raise AssertionError("folded state by state")

    monkeypatch.setattr(fp.Fingerprints, "_fold_mixed", refuse)
    taken = fp.Fingerprints()
    indices = [taken.add(s, lay) for s, lay in zip(states, layouts)]
    stacked = taken.stacked(indices)
    one_by_one = torch.stack([fingerprint(s, lay) for s, lay in zip(states, layouts)])
    torch.testing.assert_close(stacked, one_by_one, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(taken.stacked([4, 0, 2]), one_by_one[[4, 0, 2]], rtol=1e-6, atol=1e-6)


def test_states_whose_plans_alternate_fold_once_per_plan(monkeypatch):
    """A B A B ...: one batch per stretch would be one fold per state; past a few stretches the
    states fold once per plan instead, with the same values."""
    from revtrain.core import fingerprint as fp

    torch.manual_seed(0)
    shapes = [(4, 3, 5), (2, 6, 5)] * 3
    states = [tuple(torch.randn(sh) for _ in range(2)) for sh in shapes]
    folds = []
    original = fp._fold_group
    monkeypatch.setattr(fp, "_fold_group", lambda *a: folds.append(1) or original(*a))
    taken = fp.Fingerprints()
    for s in states:
        taken.add(s)
    got = taken.results()
    assert len(folds) == 2
    for s, g in zip(states, got):
        torch.testing.assert_close(g, fingerprint(s), rtol=1e-6, atol=1e-6)


def test_states_of_another_number_of_tensors_still_fold_state_by_state():
    from revtrain.core import fingerprint as fp

    torch.manual_seed(0)
    states = [tuple(torch.randn(4, 3, 5) for _ in range(2)), (torch.randn(4, 3, 5),), tuple(torch.randn(4, 3, 5) for _ in range(2))]
    taken = fp.Fingerprints()
    for s in states:
        taken.add(s)
    got = taken.results()
    for s, g in zip(states, got):
        torch.testing.assert_close(g, fingerprint(s), rtol=1e-6, atol=1e-6)


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
    """``check_every=2``: the first step fingerprints every block of the run (forward and
    rebuild), the second none: the layers count their calls alike, so they check together and
    the check's per-run cost is paid on one step in two only."""
    from revtrain.core.checks import RunCheck
    from revtrain.core.fingerprint import Fingerprints

    seen: list[bool] = []  # per fingerprint taken: was it of an input (forward or rebuild)?
    forward, rebuild = Fingerprints.add, RunCheck.add

    def counting_forward(self, state, layout=None):
        seen.append(layout is not None)
        return forward(self, state, layout)

    def counting_rebuild(self, state, layout):
        seen.append(True)
        return rebuild(self, state, layout)

    monkeypatch.setattr(Fingerprints, "add", counting_forward)
    monkeypatch.setattr(RunCheck, "add", counting_rebuild)
    torch.manual_seed(0)
    model = make_stack(4, check_every=2)
    checked = []
    for _ in range(2):
        seen.clear()
        model(torch.randn(2, 8, 4, 4)).square().sum().backward()
        checked.append((sum(seen), len(seen)))
        assert [b.__dict__["_check_calls"] for b in model] == [len(checked)] * 4
    # 4 blocks x (forward input + rebuilt input), and the run's output scale, on the first step.
    assert checked == [(8, 9), (0, 0)]
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
    from types import SimpleNamespace

    from revtrain.core import checks

    assert [name for name, _ in checks._tf32_flags()] == [
        "torch.backends.cudnn.allow_tf32", "torch.backends.cuda.matmul.allow_tf32"]
    on_gpu, on_cpu = SimpleNamespace(is_cuda=True), SimpleNamespace(is_cuda=False)
    flags = [("torch.backends.cudnn.allow_tf32", True), ("torch.backends.cuda.matmul.allow_tf32", False)]
    monkeypatch.setattr(checks, "_tf32_flags", lambda: flags)
    assert "torch.backends.cudnn.allow_tf32 is True" in checks._tf32_hint(on_gpu)
    assert "set it to False" in checks._tf32_hint(on_gpu)
    assert checks._tf32_hint(on_cpu) == ""  # the CPU has no TF32
    flags[0] = ("torch.backends.cudnn.allow_tf32", False)
    assert checks._tf32_hint(on_gpu) == ""


@pytest.mark.parametrize("shape", [(8, 16, 8, 8), (4, 16, 6, 6), (3, 7, 10), (2, 12, 5, 5)])
def test_row_projections_on_cpu_equal_the_batched_product(monkeypatch, shape):
    """The CPU path for larger tensors (the transposed product ``u^T X^T``) computes what the
    batched product computes, on strided halves and odd row lengths, and the fingerprints
    folded from it equal those folded from the batched product."""
    from revtrain.core import fingerprint as fp

    torch.manual_seed(0)
    half = torch.randn(shape, dtype=torch.float64).chunk(2, dim=1)[1]
    layout = layout_of([half])
    monkeypatch.setattr(fp, "_plans", {})
    monkeypatch.setattr(fp, "_state_plans", {})
    batched = fingerprint([half], layout)
    monkeypatch.setattr(fp, "_TRANSPOSED_MIN", 0)  # small tensors take it too here
    monkeypatch.setattr(fp, "_plans", {})
    monkeypatch.setattr(fp, "_state_plans", {})
    plan = fp._Plan.of(half, layout[0])
    assert plan.u_t is not None
    slab = fp._slab(half, plan)
    torch.testing.assert_close(fp._row_projections(slab, plan), torch.bmm(slab, plan.u), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(fingerprint([half], layout), batched, rtol=1e-12, atol=1e-12)


def test_fingerprints_reach_the_host_in_one_copy_with_the_same_values():
    """From a GPU the check copies before, after and output norms to the host together (one
    sync, as float64); that path, forced on the CPU, gives exactly the values of the arrays
    read in place (which keep their dtype and share the tensors' memory)."""
    from revtrain.core.checks import _on_host

    torch.manual_seed(0)
    tensors = (torch.randn(3, 2, 65, dtype=torch.float64), torch.randn(3, 2, 65, dtype=torch.float64),
               torch.randn(3, 2, dtype=torch.float32))
    for tensor, direct, gathered in zip(tensors, _on_host(*tensors), _on_host(*tensors, gather=True)):
        assert direct.dtype == tensor.numpy().dtype and gathered.dtype == np.float64
        assert np.shares_memory(direct, tensor.numpy())
        assert direct.shape == gathered.shape and (direct.astype(np.float64) == gathered).all()


def test_row_projections_of_a_tensor_at_an_odd_offset_equal_the_batched_product(monkeypatch):
    """The transposed product reads a tensor at any offset and strides (here offset 1, which a
    complex view of the rows could not take) with the batched product's values."""
    from revtrain.core import fingerprint as fp

    monkeypatch.setattr(fp, "_TRANSPOSED_MIN", 0)
    monkeypatch.setattr(fp, "_plans", {})
    torch.manual_seed(0)
    x = torch.randn(1 + 8 * 4 * 16, dtype=torch.float64)[1:].view(8, 4, 16)  # storage offset 1
    plan = fp._Plan.of(x, fp.layout_of([x])[0])
    assert plan.u_t is not None
    slab = fp._slab(x, plan)
    torch.testing.assert_close(fp._row_projections(slab, plan), torch.bmm(slab, plan.u), rtol=1e-12, atol=1e-12)


# -- backward's incremental comparison equals the one-shot reference ----------------------------


@pytest.mark.parametrize("rows", [[1, 2, 3, 4, 5, 6], [6, 4, 3, 1, 0]], ids=["every layer", "some layers"])
@pytest.mark.parametrize("path", ["one product", "numpy", "torch ops"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["float64", "float32"])
def test_run_check_gives_check_rebuilds_verdicts(rows, path, dtype, monkeypatch):
    """``RunCheck`` compares rebuilt inputs with the forward's as they come (groups of
    ``FOLD_EVERY``, forward rows a view or a copy): states of one shape by one product against
    the forward's projections (``projection_errors``), others through whole fingerprints (with
    numpy on CPUs, torch ops elsewhere). The same errors as ``check_rebuilds`` on whole
    fingerprints: to 1e-9 in float64; in float32 to its rounding of the projections (the one
    product sums in another order than fold-then-subtract: ~1e-7 of the state's norm, so 1e-6
    absolute on the relative errors). A non-finite rebuild raises naming its half."""
    from revtrain.core import checks
    from revtrain.core import fingerprint as fp
    from revtrain.core.checks import RunCheck
    from revtrain.core.fingerprint import Fingerprints

    if path == "torch ops":
        monkeypatch.setattr(checks, "_NUMPY_DTYPES", ())
    products = []
    monkeypatch.setattr(checks, "projection_errors", lambda *a: products.append(1) or fp.projection_errors(*a))

    torch.manual_seed(0)
    # Halves of two shapes have no one plan: they go through whole fingerprints.
    second = (4, 4, 6, 6) if path == "one product" else (4, 2, 6, 6)
    states = [(torch.randn(4, 4, 6, 6, dtype=dtype), torch.randn(second, dtype=dtype)) for _ in range(7)]
    taken = Fingerprints()
    for state in states:
        taken.add(state)
    prints = taken.stacked(range(7))
    rebuilt = [tuple(x + 10.0 ** -(2 + k % 3) * torch.randn_like(x) for x in states[r]) for k, r in enumerate(rows)]
    layers = [ReversibleBlock(nn.Identity(), nn.Identity(), drift_tolerance=1.0) for _ in rows]
    out_norms = torch.ones(len(rows), 2, dtype=dtype)
    check = RunCheck(prints, rows)
    # A run whose layers are all checked reads the forward's rows as views (no copy at the peak).
    assert (check._before(0, 4).data_ptr() == prints[1].data_ptr()) == (rows[0] == 1)
    for state in rebuilt:
        check.add(state, layout_of(state))
    errors = check.finish(layers, str, out_norms, estimate=True)
    assert len(products) == (2 if path == "one product" else 0)  # groups of FOLD_EVERY = 4
    reference = check_rebuilds([
        RebuildCheck(layer, "ref", fingerprint(states[r]), fingerprint(state), out_norms[k])
        for k, (layer, r, state) in enumerate(zip(layers, rows, rebuilt))
    ])
    assert all(e > 1e-5 for e in errors)
    atol = 0.0 if dtype == torch.float64 else 1e-6
    rtol = 1e-9 if dtype == torch.float64 else 1e-5
    torch.testing.assert_close(torch.tensor(errors), torch.tensor(reference), rtol=rtol, atol=atol)

    check = RunCheck(prints, rows)
    for k, state in enumerate(rebuilt):
        check.add((state[0], state[1].clone().fill_(float("inf"))) if k == 2 else state, layout_of(state))
    with pytest.raises(ReconstructionError, match=r"layer 2 .*non-finite values \(input x2\)"):
        check.finish(layers, lambda k: f"layer {k}", out_norms)


def test_the_quick_screen_passes_only_layers_the_full_summary_passes():
    """``RunCheck.finish`` skips the full summary where every layer passes ``_all_within``;
    that screen must never pass a layer whose estimated error exceeds its tolerance (it
    divides by the half's own norm, the summary by at least that), whatever the values:
    errors near the tolerance, zero and non-finite norms, non-finite rebuilds."""
    from revtrain.core.checks import _all_within, _summarise

    rng = np.random.default_rng(0)
    passed = failed_but_fine = 0
    for trial in range(2000):
        layers, halves = rng.integers(1, 6), rng.integers(1, 3)
        before = rng.standard_normal((layers, halves, 65)).astype(np.float32)
        before[..., 0] = np.abs(before[..., 0]) * 10.0 ** rng.uniform(-3, 3, (layers, halves))
        tolerances = 10.0 ** rng.uniform(-4, -1, layers)
        # Projection errors around each layer's limit: tolerance x sqrt(P) x the half's norm.
        verdicts = tolerances[:, None] * 8.0 * before[..., 0] * rng.uniform(0.5, 1.5, (layers, halves))
        special = rng.integers(0, 6)
        if special == 1:
            before[rng.integers(layers), rng.integers(halves), 0] = 0.0  # a zero half
        elif special == 2:
            before[rng.integers(layers), rng.integers(halves), 0] = np.nan
        elif special == 3:
            verdicts[rng.integers(layers), rng.integers(halves)] = np.inf  # a non-finite rebuild
        elif special == 4:
            verdicts[...] = 0.0
        elif special == 5:  # exactly at each limit, where roundings decide
            verdicts = tolerances[:, None] * 8.0 * before[..., 0].astype(np.float64)
        out_norms = np.abs(rng.standard_normal((layers, halves))).astype(np.float32)
        summary = _summarise(before, verdicts, out_norms)
        finite_before, finite_after, worst = summary[:, 0], summary[:, 1], summary[:, 2]
        fine = bool(np.all((finite_before == 0) | ((finite_after == 1) & (worst <= tolerances))))
        if _all_within(before, verdicts, list(tolerances)):
            passed += 1
            assert fine, f"trial {trial}: the screen passed what the summary flags"
        elif fine:
            failed_but_fine += 1
    # Both outcomes occur: the test exercises the screen on both sides of the limit.
    assert passed > 100 and failed_but_fine > 100
    # A case the screen once passed by one rounding (it compared v <= tol * 8 * b while the
    # summary flags v / 8 / b > tol).
    b, tol = np.float32(0.72188306), 0.02876604512282172
    before = np.zeros((1, 1, 65), np.float32)
    before[0, 0, 0] = b
    verdicts = np.array([[tol * 8.0 * float(b)]])
    worst = _summarise(before, verdicts, np.zeros((1, 1), np.float32))[0, 2]
    assert worst > tol and not _all_within(before, verdicts, [tol])


def test_finish_reports_drift_after_a_failed_screen_and_nothing_after_a_passed_one():
    from revtrain.core.checks import RunCheck
    from revtrain.core.fingerprint import Fingerprints

    torch.manual_seed(0)
    states = [(torch.randn(4, 4, 6, 6), torch.randn(4, 4, 6, 6)) for _ in range(3)]
    taken = Fingerprints()
    for state in states:
        taken.add(state)
    prints = taken.stacked(range(3))
    layers = [ReversibleBlock(nn.Identity(), nn.Identity(), drift_tolerance=1e-3) for _ in range(3)]
    out_norms = torch.ones(3, 2)

    def run(noise: float) -> RunCheck:
        check = RunCheck(prints, [0, 1, 2])
        for state in states:
            check.add(tuple(x + noise * torch.randn_like(x) for x in state), layout_of(state))
        return check

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert run(0.0).finish(layers, str, out_norms) is None  # screened: no estimates worked out
    errors = run(0.0).finish(layers, str, out_norms, estimate=True)
    assert errors is not None and max(errors) < 1e-6
    with pytest.warns(ReconstructionDriftWarning, match="3 of 3 checked layers"):
        errors = run(0.1).finish(layers, str, out_norms)
    assert errors is not None and min(errors) > 1e-2


@pytest.mark.parametrize("path", ["one product", "fingerprints"])
def test_a_huge_but_finite_rebuild_error_is_drift_not_a_non_finite_rebuild(path):
    """Verdicts are summed in float64: a float32 rebuild that is off by 1e30 (its squares
    overflow float32) warns of drift; only a non-finite rebuild raises as one."""
    from revtrain.core.checks import RunCheck
    from revtrain.core.fingerprint import Fingerprints

    torch.manual_seed(0)
    second = (4, 4, 6, 6) if path == "one product" else (4, 2, 6, 6)
    state = (torch.randn(4, 4, 6, 6), torch.randn(second))
    taken = Fingerprints()
    taken.add(state)
    prints = taken.stacked([0])
    layers = [ReversibleBlock(nn.Identity(), nn.Identity())]
    check = RunCheck(prints, [0])
    check.add((state[0] + 1e30, state[1]), layout_of(state))
    with pytest.warns(ReconstructionDriftWarning, match="drifted .* by [0-9.]+e\\+(2|3)[0-9]"):
        errors = check.finish(layers, str, torch.ones(1, 2))
    assert errors is not None and math.isfinite(errors[0])
    check = RunCheck(prints, [0])
    check.add((state[0], torch.full_like(state[1], float("nan"))), layout_of(state))
    with pytest.raises(ReconstructionError, match=r"non-finite values \(input x2\)"):
        check.finish(layers, str, torch.ones(1, 2))


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


@pytest.mark.parametrize("rows", [[2, 3, 4], [4, 3, 2], [5], [0, 2, 1, 5], [], [3, 1]])
def test_take_rows_equals_indexing_and_is_a_view_for_rows_in_order(rows):
    from revtrain.core.fingerprint import take_rows

    t = torch.randn(6, 2, 5)
    taken = take_rows(t, rows)
    torch.testing.assert_close(taken, t[rows], rtol=0, atol=0)
    if len(rows) > 1 and rows == list(range(rows[0], rows[-1] + 1)):
        assert taken.data_ptr() == t[rows[0]].data_ptr()  # a view: nothing copied


@pytest.mark.parametrize("rows", [[-1], [-2, -1], [-1, -2], [-3, -2, -1], [0, -1], [-1, 3, 0]])
def test_take_rows_reads_negative_rows_as_indexing_does(rows):
    """A slice from a negative start to a non-negative stop is empty: negative rows must not
    take the view path as they are."""
    from revtrain.core.fingerprint import take_rows

    t = torch.randn(6, 2, 5)
    torch.testing.assert_close(take_rows(t, rows), t[rows], rtol=0, atol=0)


@pytest.mark.parametrize("device", ["cpu", "meta"])  # meta: the GPU path (index_select), on the host
@pytest.mark.parametrize("rows", [[5, 6], [4, 5, 6], [7], [-7], [6, 5], [0, 9, 2]])
def test_take_rows_refuses_rows_out_of_range_as_indexing_does(rows, device):
    """A slice past the end comes out short without a word; t[rows] raises (on a GPU an index
    out of range would be a device-side assert)."""
    from revtrain.core.fingerprint import take_rows

    with pytest.raises(IndexError):
        torch.empty(6, 2, 5)[rows]
    t = torch.empty(6, 2, 5, device=device)
    with pytest.raises(IndexError, match="out of range for a tensor of 6 rows"):
        take_rows(t, rows)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("check_every", [1, 2])
def test_an_m_mode_step_on_cuda_syncs_with_the_host_only_to_read_its_verdicts(check_every):
    """Indexing a GPU tensor with a Python list waits for the device; the check's only wait is
    the one copy of the run's verdicts to the host, on a step that checks (with ``check_every=2``
    every other step checks, the first after the warm-up's even count; the other step waits for
    nothing)."""
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
    assert counts == [1] + [0] * (check_every - 1), counts


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


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_large_cuda_halves_take_the_transposed_product_with_the_batched_result():
    from revtrain.core import fingerprint as fp

    x = torch.randn(32, 32, 32, 32, device="cuda", dtype=torch.float64)
    plan = fp._Plan.of(x, 2)
    assert plan.u_t is not None  # from _TRANSPOSED_MIN values
    slab = fp._slab(x, plan)
    torch.testing.assert_close(fp._row_projections(slab, plan), torch.bmm(slab, plan.u), rtol=1e-12, atol=1e-12)
    assert fp._Plan.of(torch.randn(2, 8, 4, 4, device="cuda"), 2).u_t is None  # small: batched
