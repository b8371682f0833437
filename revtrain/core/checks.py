"""Checks on every rebuild: does the rebuilt input match the one the forward saw?

The forward records a small *fingerprint* of each layer's input state and of the run's output;
backward computes the same fingerprint of the rebuilt state and compares, with one device sync
for a whole run of layers.

A fingerprint of a tensor ``x`` is its norm and :data:`PROJECTIONS` random projections
``s_j · (X u_k)``, where ``X`` is ``x`` seen as a matrix of rows (a view, no copy), ``u_k`` fixed
random vectors along the rows and ``s_j`` fixed random vectors across them: each projection is
onto a rank-one random tensor ``s_j ⊗ u_k``, whose projection of an error ``E`` has mean square
``‖E‖²``. A norm alone misses an error orthogonal to ``x`` (a 1% random error moves the norm by
1e-4); a random projection sees an error in any direction. Two vectors ``u_k`` (two
matrix-vector products, each about as costly as the norm) keep an error that is the same in
every row (a per-channel offset) from hiding in the one direction a single ``u`` cannot see.
The random vectors are drawn once per shape from a fixed seed (never from torch's global
generators) and cached.

The estimated error of one half is ``max(|Δnorm|, rms_j |Δp_j|)``, divided by
``max(‖x_half‖, FLOOR · s)``, where ``s`` is the larger of the norms of the layer's whole input
and whole output state: a half that is exactly zero (a zero stream, zero padding) is measured
against the scale of the rest of the block and never divides by zero.

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

__all__ = ["fingerprint", "norms", "check_rebuilds", "PROJECTIONS", "FLOOR", "RebuildCheck"]

ROW_VECTORS = 2
"""Random vectors along the rows: one matrix-vector product each."""

PROJECTIONS = 4
"""Random projections per tensor (``PROJECTIONS / ROW_VECTORS`` per matrix-vector product)."""

FLOOR = 0.1
"""A half's error is measured against at least this fraction of the block's input/output scale."""

_SEED = 0x5EED
_vectors: dict[tuple[int, int, torch.dtype, torch.device], tuple[Tensor, Tensor]] = {}


def _rows(x: Tensor) -> Tensor:
    """``x`` as a ``(rows, L)`` matrix, a view where strides allow (a copy otherwise).

    ``L`` collects the trailing dimensions that are contiguous, leaving out the first (the batch)
    so that the vector along the rows stays as short as one sample: halves split off a
    contiguous ``(B, C, H, W)`` tensor are ``(B, C/2·H·W)`` views with a row stride of ``C·H·W``.
    """
    if x.dim() <= 1:
        return x.reshape(1, -1)
    length, k = 1, x.dim()
    while k > 1 and (x.shape[k - 1] == 1 or x.stride(k - 1) == length):
        length *= x.shape[k - 1]
        k -= 1
    try:
        return x.view(-1, length)
    except RuntimeError:  # leading dimensions that cannot be merged: copy (rare)
        return x.reshape(-1, length)


def _random_vectors(rows: int, length: int, dtype: torch.dtype, device: torch.device) -> tuple[Tensor, Tensor]:
    key = (rows, length, dtype, device)
    cached = _vectors.get(key)
    if cached is None:
        gen = torch.Generator().manual_seed(_SEED + 1_000_003 * length + rows)
        u = torch.randn(ROW_VECTORS, length, generator=gen, dtype=torch.float64)
        s = torch.randn(ROW_VECTORS, PROJECTIONS // ROW_VECTORS, rows, generator=gen, dtype=torch.float64)
        cached = (u.to(device=device, dtype=dtype), s.to(device=device, dtype=dtype))
        _vectors[key] = cached
    return cached


def _fingerprint_one(x: Tensor) -> Tensor:
    x = x.detach()
    if x.numel() == 0:
        return torch.zeros(1 + PROJECTIONS, dtype=torch.float64, device=x.device)
    matrix = _rows(x)
    if x.dtype in (torch.float16, torch.bfloat16):  # half-precision products round coarsely
        matrix = matrix.float()
    # Row norms first: reducing a strided view row by row is several times faster than at once.
    norm = torch.linalg.vector_norm(torch.linalg.vector_norm(matrix, dim=1))
    u, s = _random_vectors(matrix.shape[0], matrix.shape[1], matrix.dtype, matrix.device)
    projections = [s[k] @ (matrix @ u[k]) for k in range(ROW_VECTORS)]
    return torch.cat([norm.reshape(1), *projections]).to(torch.float64)


def fingerprint(state: Sequence[Tensor]) -> Tensor:
    """``(len(state), 1 + PROJECTIONS)`` float64: each tensor's norm and its random projections."""
    return torch.stack([_fingerprint_one(x) for x in state])


def norms(state: Sequence[Tensor]) -> Tensor:
    """The norm of each tensor of ``state`` (float64), for the scale of a layer's output."""

    def norm(x: Tensor) -> Tensor:
        low = x.dtype in (torch.float16, torch.bfloat16)
        return torch.linalg.vector_norm(x.detach(), dtype=torch.float32 if low else None)

    return torch.stack([norm(x).to(torch.float64) for x in state])


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
        projected = math.sqrt(sum((x - y) ** 2 for x, y in zip(a[1:], b[1:])) / (len(a) - 1))
        error = max(abs(a[0] - b[0]), projected)
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
        f"(relative error of input {name}, estimated from its norm and {PROJECTIONS} random "
        f"projections) > drift_tolerance={tolerance:g}{others}; gradients may be inaccurate. "
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
