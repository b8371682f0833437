"""Checks on every rebuild: does the rebuilt input match the one the forward saw?

The forward records a small *fingerprint* of each layer's input state and the scale of the
run's output (``core/fingerprint.py``); backward computes the same fingerprint of the rebuilt
state and compares, with one device sync for a whole run of layers.

The estimated error of one half is ``rms_j |Δp_j|`` over the :data:`PROJECTIONS` projections,
divided by ``max(‖x_half‖, FLOOR · s)``, where ``s`` is the larger of the norms of the layer's
whole input and whole output state: a half that is exactly zero (a zero stream, zero padding) is
measured against the scale of the rest of the block and never divides by zero.

A non-finite rebuild of a finite input raises :class:`ReconstructionError` naming the culprit:
the forward itself (``F`` or ``G`` already returned non-finite values) or the inverse. A relative
error above the layer's ``drift_tolerance`` warns, or raises with ``drift_action="raise"``.
"""

from __future__ import annotations

import functools
import math
import warnings
from collections.abc import Callable, Sequence

import numpy as np
import torch
from torch import Tensor

from revtrain.core.fingerprint import PROJECTIONS
from revtrain.errors import ReconstructionDriftWarning, ReconstructionError

__all__ = [
    "check_rebuilds",
    "check_run",
    "PROJECTIONS",
    "FLOOR",
    "RebuildCheck",
]

FLOOR = 0.1
"""A half's error is measured against at least this fraction of the block's input/output scale."""


class RebuildCheck:
    """One layer's forward and rebuilt fingerprints, with what the message needs.

    Args:
        layer: Gives ``drift_tolerance`` and ``drift_action``.
        where: Names the layer in messages (or a function that returns the name).
        before: Fingerprint of the forward's input.
        after: Fingerprint of the rebuilt input.
        output_norms: Norms of the layer's output in the forward (its scale and finiteness).
        output_names: ``(output index, name)`` of what produced each output tensor, in the order
            they are computed, for blame (``((0, "F"), (1, "G"))`` for a block).
    """

    def __init__(
        self,
        layer: object,
        where: str | Callable[[], str],
        before: Tensor,
        after: Tensor,
        output_norms: Tensor,
        output_names: Sequence[tuple[int, str]] | None = None,
    ) -> None:
        self.layer = layer
        self._where = where
        self.before = before
        self.after = after
        self.output_norms = output_norms
        self.output_names = output_names

    @property
    def where(self) -> str:
        """The layer named for messages (built only when a message needs it)."""
        return self._where if isinstance(self._where, str) else self._where()


def check_rebuilds(checks: Sequence[RebuildCheck]) -> list[float]:
    """Compare forward and rebuilt fingerprints of many layers; one device sync in all.

    Non-finite rebuilds raise at once. Errors above tolerance are reported together: one
    :class:`ReconstructionError` (layers with ``drift_action="raise"``) or one warning per run,
    naming the worst layer and how many exceeded their tolerance.

    Returns the estimated relative error per layer (NaN where the forward was not finite).
    """
    if not checks:
        return []
    groups: dict[tuple[int, int, int], list[int]] = {}
    for k, check in enumerate(checks):
        key = (*check.before.shape, check.output_norms.numel())
        groups.setdefault(key, []).append(k)
    errors: list[float] = [math.nan] * len(checks)
    names: list[str] = [""] * len(checks)
    for members in groups.values():
        summary = _summarise(*_on_host(
            torch.stack([checks[k].before for k in members]),
            torch.stack([checks[k].after for k in members]),
            torch.stack([checks[k].output_norms.reshape(-1) for k in members]),
        ))
        group_errors, group_names = _read(summary, lambda m: checks[members[m]])
        for m, k in enumerate(members):
            errors[k], names[k] = group_errors[m], group_names[m]
    _report(errors, names, [c.layer for c in checks], lambda k: checks[k])
    return errors


def check_run(
    layers: Sequence[object],
    where: Callable[[int], str],
    before: Tensor,
    after: Tensor,
    output_norms: Tensor,
) -> list[float]:
    """:func:`check_rebuilds` for layers whose fingerprints are stacked already (an M-mode
    run's checked layers): ``before``/``after`` ``(layers, halves, 1 + PROJECTIONS)``,
    ``output_norms`` ``(layers, m)``; ``where(k)`` names layer ``k``. The arithmetic of all
    layers runs at once on the host (one copy from a GPU, one sync); a
    :class:`RebuildCheck` is made only for a layer a message names (per-layer tensors were
    most of the check's cost on small tensors)."""
    if not layers:
        return []

    def check(k: int) -> RebuildCheck:
        layer = layers[k]
        return RebuildCheck(layer, functools.partial(where, k), before[k], after[k], output_norms[k],
                            getattr(layer, "output_names", None))

    errors, names = _read(_summarise(*_on_host(before, after, output_norms)), check)
    _report(errors, names, layers, check)
    return errors


def _read(summary: np.ndarray, check: Callable[[int], RebuildCheck]) -> tuple[list[float], list[str]]:
    """Errors and the names of the worst halves from :func:`_summarise`'s rows; raises for a
    non-finite rebuild of a finite input."""
    errors: list[float] = [math.nan] * len(summary)
    names: list[str] = [""] * len(summary)
    for k, (finite_before, finite_after, drift, which, halves) in enumerate(summary.tolist()):
        if not finite_before:
            continue  # the forward's input was not finite; the loss shows that already
        if not finite_after:
            bad = check(k)
            _check_one(bad, bad.before.tolist(), bad.after.tolist(), bad.output_norms.flatten().tolist())  # raises
        errors[k] = drift
        names[k] = f"x{int(which) + 1}" if halves > 1 else "x"
    return errors, names


def _report(errors: list[float], names: list[str], layers: Sequence[object], check: Callable[[int], RebuildCheck]) -> None:
    """Warn, or raise for layers with ``drift_action="raise"``, about errors above tolerance."""
    over = [
        (errors[k], k, names[k])
        for k, layer in enumerate(layers)
        if errors[k] > float(getattr(layer, "drift_tolerance"))
    ]
    if over:
        strict = [o for o in over if getattr(layers[o[1]], "drift_action") == "raise"]
        drift, k, name = max(strict or over, key=lambda o: o[0])
        message = _drift_message((drift, check(k), name), len(over), len(errors))
        if strict:
            raise ReconstructionError(message)
        warnings.warn(message, ReconstructionDriftWarning, stacklevel=4)


def _on_host(*tensors: Tensor, gather: bool | None = None) -> list[np.ndarray]:
    """The tensors as float64 arrays in host memory: from a GPU in one copy (one sync), from
    the CPU without a copy. ``gather`` forces the one-copy path (a test runs it on the CPU)."""
    tensors = tuple(t.detach() for t in tensors)
    if not (tensors[0].device.type != "cpu" if gather is None else gather):
        return [t.numpy().astype(np.float64, copy=False) for t in tensors]
    flat = torch.cat([t.reshape(-1).to(torch.float64) for t in tensors]).cpu().numpy()
    sizes = np.cumsum([t.numel() for t in tensors])[:-1]
    return [part.reshape(t.shape) for part, t in zip(np.split(flat, sizes), tensors)]


def _summarise(before: np.ndarray, after: np.ndarray, out_norms: np.ndarray) -> np.ndarray:
    """Per layer: forward input finite, rebuild finite, largest relative error, its half, and
    the number of halves.

    ``before``/``after``: ``(layers, halves, 1 + PROJECTIONS)``; ``out_norms``: ``(layers, m)``.
    The same arithmetic as :func:`_check_one`, which stays the reference for messages.
    """
    with np.errstate(all="ignore"):  # non-finite values are what this looks for
        finite_before = np.isfinite(before).reshape(len(before), -1).all(axis=1)
        finite_after = np.isfinite(after).reshape(len(after), -1).all(axis=1)
        in_scale = np.sqrt(np.square(before[..., 0]).sum(axis=1))
        out_scale = np.sqrt(np.square(out_norms).sum(axis=1))
        scale = np.fmax(in_scale, out_scale)  # fmax: a non-finite output norm does not poison it
        error = np.sqrt(np.square(after[..., 1:] - before[..., 1:]).mean(axis=-1))
        denominator = np.fmax(before[..., 0], FLOOR * scale[:, None])
        # Input and output exactly zero: any rebuilt value is wrong.
        zero = np.where(error > 0, math.inf, 0.0)
        drift = np.where(denominator == 0, zero, error / np.where(denominator == 0, 1.0, denominator))
        which = np.argmax(drift, axis=1)  # like torch.max: a NaN wins
        worst = np.take_along_axis(drift, which[:, None], axis=1)[:, 0]
    halves = np.full(len(before), before.shape[1])
    return np.stack([finite_before, finite_after, worst, which, halves], axis=1).astype(np.float64)


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
        "coupling (coupling='exact'); raise drift_tolerance to accept it" + _tf32_hint(check.before)
    )


def _tf32_hint(fingerprint: Tensor) -> str:
    """On CUDA with TF32 allowed, name it: TF32 rounds what F and G read to 10 mantissa bits, so
    a rebuilt input that differs from the forward's in the last float32 bits can round to
    another TF32 value. On an H100, float32 stacks (revtrain's and the peer libraries' alike)
    showed 10-20x the CPU's gradient error with PyTorch's default settings
    (results/core_stack_cuda_h100.md)."""
    if not fingerprint.is_cuda:
        return ""
    on = [name for name, flag in _tf32_flags() if flag]
    if not on:
        return ""
    return (
        f". TF32 is allowed ({' and '.join(on)} is True): it rounds the inputs of F and G to 10 "
        "mantissa bits, which can magnify rebuild errors; set it to False for M-mode training"
    )


def _tf32_flags() -> list[tuple[str, bool]]:
    """PyTorch's two TF32 switches and their values (False where a build lacks one)."""
    flags = []
    for name, owner, attr in (("torch.backends.cudnn.allow_tf32", torch.backends.cudnn, "allow_tf32"),
                              ("torch.backends.cuda.matmul.allow_tf32", torch.backends.cuda.matmul, "allow_tf32")):
        try:
            flags.append((name, bool(getattr(owner, attr))))
        except (AttributeError, RuntimeError):
            flags.append((name, False))
    return flags


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
