"""In-place ABN's claims, proven by counting: what M-mode keeps, what its backward computes.

- Between two convolutions, an M-mode ``InPlaceABN`` keeps nothing beyond what the
  convolution after it keeps anyway (its output, the very same storage) and 2×C statistics;
  C-mode and the plain twin keep the batch norm's input and output on top (measured with
  ``revtrain.memory`` at two depths, and by the identity of the saved storages).
- Its closed-form backward runs no batch-norm forward: it rebuilds the input and runs batch
  norm's backward kernel once, allocating three activations (the rebuilt input, its gradient
  and the leaky ReLU's gradient between them); the generic "rebuild, then run the forward
  again" path runs the batch norm once more and allocates five.
"""

from __future__ import annotations

from functools import partial

import pytest
import torch
from torch import nn

from revtrain.core import set_modes
from revtrain.layers import BatchNormLeakyReLU, InPlaceABN
from revtrain.memory import track_peak_memory
from tests.op_log import OpLog

B, C, H = 8, 16, 16
ACT = B * C * H * H * 4  # bytes of one float32 activation (B, C, H, H)


def _stack(depth: int, norm_act) -> nn.Sequential:
    """conv, [norm_act, conv] * depth: every norm + activation sits between two convolutions."""
    layers: list[nn.Module] = [nn.Conv2d(C, C, 3, padding=1, bias=False)]
    for _ in range(depth):
        if norm_act is not None:
            layers.append(norm_act(C))
        layers.append(nn.Conv2d(C, C, 3, padding=1, bias=False))
    return nn.Sequential(*layers)


def _kept_after_forward(depth: int, norm_act, mode: str | None = None) -> int:
    torch.manual_seed(0)
    model = _stack(depth, norm_act)
    if mode is not None:
        set_modes(model, mode)
    x = torch.randn(B, C, H, H, requires_grad=True)
    with track_peak_memory("cpu") as mem:
        out = model(x)
    del out
    return mem.end_bytes  # what the forward left for backward (and the output)


KINDS = {
    "M": (InPlaceABN, "M"),
    "C": (InPlaceABN, "C"),
    "plain twin": (BatchNormLeakyReLU, None),
    "plain twin, in-place LeakyReLU": (partial(BatchNormLeakyReLU, inplace=True), None),
}
# Activations each norm + activation layer keeps beyond the convolution's saved input.
EXTRA_ACTIVATIONS = {"M": 0, "C": 2, "plain twin": 2, "plain twin, in-place LeakyReLU": 1}


@pytest.mark.parametrize("kind", list(KINDS))
def test_what_each_layer_keeps_measured_at_two_depths(kind):
    norm_act, mode = KINDS[kind]
    # The rebuild check draws its random vectors once per tensor shape and process (cached, a
    # few KiB): draw them before measuring, so that they are not counted as kept by one depth.
    _kept_after_forward(1, norm_act, mode)
    extra = {}
    for depth in (2, 6):
        convs_only = _kept_after_forward(depth, None)
        extra[depth] = _kept_after_forward(depth, norm_act, mode) - convs_only
    per_layer = (extra[6] - extra[2]) / 4
    expected = EXTRA_ACTIVATIONS[kind] * ACT
    # Besides activations a layer keeps per-channel vectors (statistics) and in M-mode the rebuild
    # check's fingerprint of its input (1 + PROJECTIONS float32 values): 260 bytes, under 1% of an
    # activation here.
    assert expected <= per_layer <= expected + 0.01 * ACT, (kind, per_layer / ACT)
    assert expected * 2 <= extra[2] <= expected * 2 + 0.02 * ACT, (kind, extra[2] / ACT)


def test_m_mode_saves_the_very_storage_the_next_convolution_saves():
    """No hidden copy: the output M-mode saves for its rebuild is the convolution's input."""
    model = _stack(3, InPlaceABN)
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        ptr = t.untyped_storage().data_ptr()
        if ptr not in params and t.numel() > C:  # activations, not parameters or statistics
            saved[ptr] = saved.get(ptr, 0) + 1
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(torch.randn(B, C, H, H, requires_grad=True))
    # The first convolution saves the input; each In-place ABN output is saved twice (by its
    # own rebuild and by the next convolution), as one storage.
    assert sorted(saved.values()) == [1, 2, 2, 2]


BATCH_NORM_FORWARD = {
    "native_batch_norm", "_native_batch_norm_legit", "_native_batch_norm_legit_no_training",
    "_batch_norm_impl_index", "batch_norm", "cudnn_batch_norm", "miopen_batch_norm",
}


def _backward_log(closed_form: bool) -> tuple[list[str], int]:
    torch.manual_seed(0)
    layer = InPlaceABN(C, closed_form_backward=closed_form, check_reconstruction=False)
    x = torch.randn(B, C, H, H, requires_grad=True)
    y = layer(x)
    dy = torch.randn_like(y)
    with OpLog() as log, track_peak_memory("cpu") as mem:
        y.backward(dy)
    return log.ops, mem.peak_bytes


def test_closed_form_backward_runs_no_batch_norm_forward_and_allocates_three_activations():
    ops, peak = _backward_log(closed_form=True)
    assert not BATCH_NORM_FORWARD & set(ops), ops
    assert ops.count("native_batch_norm_backward") == 1 and ops.count("leaky_relu_backward") == 1
    # The rebuilt input, dz (freed once dx exists) and dx; the rest is per-channel vectors.
    assert 3 * ACT <= peak <= 3 * ACT + 0.01 * ACT, peak / ACT


def test_recompute_backward_runs_the_batch_norm_once_more():
    ops, peak = _backward_log(closed_form=False)
    assert sum(op in BATCH_NORM_FORWARD for op in ops) >= 1
    assert ops.count("native_batch_norm") == 1 and "native_batch_norm_backward" in ops
    assert peak >= 5 * ACT, peak / ACT  # rebuilt input, two forward outputs, two gradients


def test_m_mode_forward_runs_one_batch_norm_and_activates_in_place():
    layer = InPlaceABN(C)
    layer.check_reconstruction = False  # the check's fingerprint is counted in the test above
    x = torch.randn(B, C, H, H, requires_grad=True)
    with OpLog() as log, track_peak_memory("cpu") as mem:
        y = layer(x)
    assert log.ops.count("native_batch_norm") == 1 and "leaky_relu_" in log.ops
    assert "leaky_relu" not in log.ops  # no out-of-place activation: one full-size result
    assert ACT <= mem.peak_bytes <= ACT + 0.01 * ACT and y.numel() * 4 == ACT
