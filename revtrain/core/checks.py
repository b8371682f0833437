"""Checks on every rebuild: does the rebuilt input match the one the forward saw?

The forward records a small *fingerprint* of each layer's input state and the scale of the
run's output; backward computes the same fingerprint of the rebuilt state and compares, with
one device sync for a whole run of layers.

A fingerprint of a tensor ``x`` is :data:`PROJECTIONS` random projections of it and an estimate
of its norm, from one pass over the data. ``x`` is seen (as a view, no copy) as ``A × R`` rows
of ``L`` contiguous values; one batched matrix product gives each row's projection onto two
fixed random vectors ``u_1, u_2`` (``W = X u``, two numbers per row), and fixed random vectors
across ``A`` (4) and across ``R`` (8) fold those into 2 × 4 × 8 numbers. Each projection is onto a
rank-one random tensor ``s_A ⊗ s_R ⊗ u``, whose projection of an error ``E`` has mean square
``‖E‖²``;
the root mean square of the differences over all projections estimates ``‖Δx‖`` in whatever
direction the error lies. (A norm alone misses errors orthogonal to ``x``: a 1% random error
moves the norm by 1e-4, a rotation not at all.) Two vectors ``u`` keep an error that is the same
in every row (a per-channel offset) from hiding in the one direction a single ``u`` cannot see.
The norm estimate is ``‖W‖ / √2`` (within a few percent for hundreds of rows); tensors of fewer
than :data:`EXACT_NORM_ROWS` rows pay one more pass for the exact norm. The random vectors are
drawn once per shape from a fixed seed (never from torch's global generators) and cached.

The estimated error of one half is ``rms_j |Δp_j|``, divided by ``max(‖x_half‖, FLOOR · s)``,
where ``s`` is the larger of the norms of the layer's whole input and whole output state: a half
that is exactly zero (a zero stream, zero padding) is measured against the scale of the rest of
the block and never divides by zero.

A non-finite rebuild of a finite input raises :class:`ReconstructionError` naming the culprit:
the forward itself (``F`` or ``G`` already returned non-finite values) or the inverse. A relative
error above the layer's ``drift_tolerance`` warns, or raises with ``drift_action="raise"``.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Sequence

import torch
from torch import Tensor

from revtrain.errors import ReconstructionDriftWarning, ReconstructionError

__all__ = [
    "fingerprint",
    "layout_of",
    "norms",
    "check_rebuilds",
    "PROJECTIONS",
    "FLOOR",
    "RebuildCheck",
]

ROW_VECTORS = 2
"""Random vectors along the rows (both applied in one batched matrix product)."""

PROJECTIONS = 64
"""Random projections per tensor: 2 row vectors x 4 vectors across ``A`` x 8 across ``R``."""

EXACT_NORM_ROWS = 64
"""Below this many rows the norm estimate is too rough: compute the norm exactly."""

FLOOR = 0.1
"""A half's error is measured against at least this fraction of the block's input/output scale."""

_MAX_ROW = 4096
_SEED = 0x5EED
_FOLD_A, _FOLD_R = 4, 8  # random vectors across the two row dimensions: 2 x 4 x 8 = 64 projections
_vectors: dict[tuple[int, int, int, torch.dtype, torch.device], tuple[Tensor, Tensor, Tensor]] = {}

Layout = tuple[int, ...]
"""Per tensor of a state, where its rows start (see :func:`layout_of`)."""


def _row_start(x: Tensor) -> int:
    """The first dimension of a row: trailing dimensions that are contiguous in memory, up to
    :data:`_MAX_ROW` values (the last one always), leaving at least one dimension before."""
    if x.dim() < 2 or (x.stride(-1) != 1 and x.shape[-1] != 1):
        return max(x.dim() - 1, 0)
    k, length = x.dim() - 1, x.shape[-1]
    while k > 1 and x.stride(k - 1) == length and length * x.shape[k - 1] <= _MAX_ROW:
        length *= x.shape[k - 1]
        k -= 1
    return k


def layout_of(state: Sequence[Tensor]) -> Layout:
    """How each tensor of ``state`` is cut into rows; a rebuild is fingerprinted with the
    forward's layout, so that a contiguous rebuild compares with a strided original."""
    return tuple(_row_start(x) for x in state)


def _as_slabs(x: Tensor, k: int) -> Tensor:
    """``x`` as ``(A, R, L)``: dims ``[0, k-1)``, dim ``k-1`` and dims ``[k, ...)`` merged.

    A view where strides allow (a half split off a contiguous ``(B, C, H, W)`` tensor is the view
    ``(B, C/2, H·W)``; a half of ``(B, T, D)`` split on the last dimension ``(B, T, D/2)``), a
    copy otherwise (a strided tensor fingerprinted with another tensor's layout).
    """
    if x.dim() < 2:
        return x.reshape(1, 1, -1)
    shape = (-1, x.shape[k - 1], math.prod(x.shape[k:]))
    try:
        return x.view(shape)
    except RuntimeError:
        return x.reshape(shape)


def _random_vectors(
    a: int, rows: int, length: int, dtype: torch.dtype, device: torch.device
) -> tuple[Tensor, Tensor, Tensor]:
    key = (a, rows, length, dtype, device)
    cached = _vectors.get(key)
    if cached is None:
        gen = torch.Generator().manual_seed(_SEED + 1_000_003 * length + 1009 * rows + a)
        u = _typical_sums(torch.randn(length, ROW_VECTORS, generator=gen, dtype=torch.float64)).T
        s_a = _typical_sums(torch.randn(a, _FOLD_A, generator=gen, dtype=torch.float64))
        s_r = _typical_sums(torch.randn(rows, _FOLD_R, generator=gen, dtype=torch.float64))
        cached = tuple(t.to(device=device, dtype=dtype) for t in (u, s_a, s_r))  # type: ignore[assignment]
        _vectors[key] = cached  # type: ignore[assignment]
    return cached  # type: ignore[return-value]


def _typical_sums(vectors: Tensor) -> Tensor:
    """Random column vectors whose sums are ``±sqrt(n)``, their typical size.

    An error that is the same all along one axis (a per-channel offset: the same in every
    position of a row, and in every sample) reaches a projection only through the sum of the
    random vector along that axis. Left to chance, a sum near zero would hide such errors for
    every tensor of that shape; fixed at its typical size, they are seen like any other.
    """
    n = vectors.shape[0]
    signs = torch.tensor([(-1.0) ** j for j in range(vectors.shape[1])], dtype=vectors.dtype)
    return vectors - vectors.mean(dim=0, keepdim=True) + signs / math.sqrt(n)


def _fingerprint_one(x: Tensor, k: int) -> Tensor:
    x = x.detach()
    if x.numel() == 0:
        return torch.zeros(1 + PROJECTIONS, dtype=torch.float64, device=x.device)
    slabs = _as_slabs(x, k)
    if slabs.dtype in (torch.float16, torch.bfloat16):  # half-precision products round coarsely
        slabs = slabs.float()
    a, rows, length = slabs.shape
    u, s_a, s_r = _random_vectors(a, rows, length, slabs.dtype, slabs.device)
    w = torch.matmul(u, slabs.transpose(1, 2))  # (A, 2, R): every row against both vectors
    # Fold the rows with random vectors across A, then across R: (4, 2, 8) projections. Two
    # small matrix products (an einsum here cost several times the pass over the data).
    across_a = (s_a.T @ w.reshape(a, ROW_VECTORS * rows)).reshape(_FOLD_A * ROW_VECTORS, rows)
    projections = across_a @ s_r
    if a * rows < EXACT_NORM_ROWS:
        norm = torch.linalg.vector_norm(slabs)
    else:
        norm = torch.linalg.vector_norm(w) / math.sqrt(ROW_VECTORS)
    return torch.cat([norm.reshape(1), projections.flatten()]).to(torch.float64)


def fingerprint(state: Sequence[Tensor], layout: Layout | None = None) -> Tensor:
    """``(len(state), 1 + PROJECTIONS)`` float64: each tensor's norm and random projections.

    Args:
        state: The tensors.
        layout: How to cut them into rows (:func:`layout_of`); default: their own layout.
            Compare two fingerprints only when they were taken with the same layout.
    """
    layout = layout_of(state) if layout is None else layout
    return torch.stack([_fingerprint_one(x, k) for x, k in zip(state, layout)])


def norms(state: Sequence[Tensor]) -> Tensor:
    """The norm of each tensor of ``state`` (float64, estimated as in :func:`fingerprint`)."""
    return fingerprint(state)[:, 0]


class RebuildCheck:
    """One layer's forward and rebuilt fingerprints, with what the message needs.

    Args:
        layer: Gives ``drift_tolerance`` and ``drift_action``.
        where: Names the layer in messages.
        before: Fingerprint of the forward's input.
        after: Fingerprint of the rebuilt input.
        output_norms: Norms of the layer's output in the forward (its scale and finiteness).
        output_names: ``(output index, name)`` of what produced each output tensor, in the order
            they are computed, for blame (``((0, "F"), (1, "G"))`` for a block).
    """

    def __init__(
        self,
        layer: object,
        where: str,
        before: Tensor,
        after: Tensor,
        output_norms: Tensor,
        output_names: Sequence[tuple[int, str]] | None = None,
    ) -> None:
        self.layer = layer
        self.where = where
        self.before = before
        self.after = after
        self.output_norms = output_norms
        self.output_names = output_names


def check_rebuilds(checks: Sequence[RebuildCheck]) -> list[float]:
    """Compare forward and rebuilt fingerprints of many layers; one device sync in all.

    Non-finite rebuilds raise at once. Errors above tolerance are reported together: one
    :class:`ReconstructionError` (layers with ``drift_action="raise"``) or one warning per run,
    naming the worst layer and how many exceeded their tolerance.

    Returns the estimated relative error per layer (NaN where the forward was not finite).
    """
    if not checks:
        return []
    packed = torch.cat(
        [torch.cat([c.before.flatten(), c.after.flatten(), c.output_norms.flatten()]) for c in checks]
    ).tolist()
    errors: list[float] = []
    over: list[tuple[float, RebuildCheck, str]] = []
    offset = 0
    for check in checks:
        n_state, width = check.before.shape
        size = n_state * width
        before = [packed[offset + i * width : offset + (i + 1) * width] for i in range(n_state)]
        after = [packed[offset + size + i * width : offset + size + (i + 1) * width] for i in range(n_state)]
        out_norms = packed[offset + 2 * size : offset + 2 * size + check.output_norms.numel()]
        offset += 2 * size + check.output_norms.numel()
        drift, name = _check_one(check, before, after, out_norms)
        errors.append(drift)
        if drift > float(getattr(check.layer, "drift_tolerance")):
            over.append((drift, check, name))
    if over:
        strict = [o for o in over if getattr(o[1].layer, "drift_action") == "raise"]
        message = _drift_message(max(strict or over, key=lambda o: o[0]), len(over), len(checks))
        if strict:
            raise ReconstructionError(message)
        warnings.warn(message, ReconstructionDriftWarning, stacklevel=3)
    return errors


def _check_one(
    check: RebuildCheck, before: list[list[float]], after: list[list[float]], out_norms: list[float]
) -> tuple[float, str]:
    """The largest estimated relative error over the halves, and which half it is."""
    if not all(math.isfinite(v) for row in before for v in row):
        return math.nan, ""  # the forward's input was not finite; the loss shows that already
    names = [f"x{i + 1}" for i in range(len(before))] if len(before) > 1 else ["x"]
    if not all(math.isfinite(v) for row in after for v in row):
        bad = next(n for n, row in zip(names, after) if not all(math.isfinite(v) for v in row))
        raise ReconstructionError(_non_finite_message(check, bad, out_norms))
    in_scale = math.sqrt(sum(row[0] ** 2 for row in before))
    out_scale = math.sqrt(sum(v * v for v in out_norms))
    scale = max(in_scale, out_scale)
    worst, worst_name = 0.0, names[0]
    for name, b, a in zip(names, before, after):
        error = math.sqrt(sum((x - y) ** 2 for x, y in zip(a[1:], b[1:])) / (len(a) - 1))
        denominator = max(b[0], FLOOR * scale)
        if denominator == 0.0:  # input and output exactly zero: any rebuilt value is wrong
            drift = math.inf if error > 0 else 0.0
        else:
            drift = error / denominator
        if drift > worst:
            worst, worst_name = drift, name
    return worst, worst_name


def _drift_message(worst: tuple[float, RebuildCheck, str], count: int, total: int) -> str:
    drift, check, name = worst
    tolerance = float(getattr(check.layer, "drift_tolerance"))
    others = f" ({count} of {total} checked layers of this run exceed their tolerance)" if count > 1 else ""
    return (
        f"the rebuilt input of {check.where} drifted from the forward's by {drift:.2e} "
        f"(relative error of input {name}, estimated from {PROJECTIONS} random projections) "
        f"> drift_tolerance={tolerance:g}{others}; gradients may be inaccurate. "
        "Use float64, fewer consecutive M-mode layers, C-mode for this layer, or an exact "
        "coupling (coupling='exact'); raise drift_tolerance to accept it"
    )


def _non_finite_message(check: RebuildCheck, bad: str, out_norms: list[float]) -> str:
    if not all(math.isfinite(v) for v in out_norms):
        order = check.output_names or [(i, f"output {i + 1}") for i in range(len(out_norms))]
        culprit = next(name for i, name in order if not math.isfinite(out_norms[i]))
        return (
            f"the forward pass of {check.where} already produced non-finite values for a finite "
            f"input: {culprit} returned NaN or inf (the inverse is not at fault; the loss is "
            "non-finite too). Lower the learning rate, check the input scale and what "
            f"{culprit} computes (a log or division of values near 0), or clip gradients"
        )
    return (
        f"rebuilding the input of {check.where} produced non-finite values (input {bad}) although "
        "the forward's input and output were finite: the inverse overflowed or divided by ~0. "
        "Run this layer in C-mode (layer.mode = 'C'), use a bounded coupling scale, a smaller "
        "learning rate, or check it with revtrain.verify_invertible"
    )
