"""Checks on every rebuild: does the rebuilt input match the one the forward saw?

The forward records a small *fingerprint* of each layer's input state and the scale of the
run's output (``core/fingerprint.py``); backward takes the same projections of the rebuilt
state and compares (folding them and subtracting the forward's in one product where it can),
with one device sync for a whole run of layers.

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

from revtrain.core.fingerprint import (
    FOLD_EVERY,
    PROJECTIONS,
    Fingerprints,
    Layout,
    comparable_plan,
    projection_errors,
    row_projections,
    take_rows,
    transposed_projections,
)
from revtrain.errors import ReconstructionDriftWarning, ReconstructionError

__all__ = [
    "check_rebuilds",
    "verdict_dtype",
    "RunCheck",
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
        after: Fingerprint of the rebuilt input (None where only its comparison was kept:
            :class:`RunCheck`).
        output_norms: Norms of the layer's output in the forward (its scale and finiteness).
        output_names: ``(output index, name)`` of what produced each output tensor, in the order
            they are computed, for blame (``((0, "F"), (1, "G"))`` for a block).
    """

    def __init__(
        self,
        layer: object,
        where: str | Callable[[], str],
        before: Tensor,
        after: Tensor | None,
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
        before = torch.stack([checks[k].before for k in members])
        after = torch.stack([checks[k].after for k in members])  # type: ignore[misc]
        verdicts = before.new_empty(before.shape[:2], dtype=verdict_dtype(before.device))
        _compare(before, after, verdicts)
        summary = _summarise(*_on_host(
            before, verdicts, torch.stack([checks[k].output_norms.reshape(-1) for k in members])
        ))
        group_errors, group_names = _read(summary, lambda m: checks[members[m]])
        for m, k in enumerate(members):
            errors[k], names[k] = group_errors[m], group_names[m]
    _report(errors, names, [c.layer for c in checks], lambda k: checks[k])
    return errors


class RunCheck:
    """Backward's side of an M-mode run's check: compares each rebuilt input with the forward's
    fingerprint as the rebuilds come, keeping per layer only what the verdict needs.

    Each rebuilt state's row projections are taken when it is added; every :data:`FOLD_EVERY`
    layers they are compared at once with the forward's fingerprints, in one product for states
    of one plan (:func:`~revtrain.core.fingerprint.projection_errors`), through whole fingerprints
    otherwise (:func:`_compare`). What waits through backward's memory peak is one number per
    half (its projection error, non-finite where the rebuild is), not its fingerprint.
    :meth:`finish` reads the verdicts of all layers on the host, with one copy from a GPU,
    screens them, and builds a :class:`RebuildCheck` only for a layer a message names.

    Args:
        prints: The forward's fingerprints, ``(states, halves, 1 + PROJECTIONS)``.
        rows: The rows of ``prints`` that hold the checked layers' inputs, in the order
            backward meets the layers (top first).
    """

    def __init__(self, prints: Tensor, rows: Sequence[int]) -> None:
        self._prints_before = prints
        self._rows = list(rows)
        # The usual case, every layer of the run checked: the rows follow each other, and the
        # forward's fingerprints of a group of layers are a slice.
        first = self._rows[0] if self._rows else 0
        self._offset = first if self._rows == list(range(first, first + len(self._rows))) else None
        # Their projections as projection_errors reads them, sliced per group (h rows per state).
        self._halves = prints.shape[1]
        self._before_t = transposed_projections(prints) if self._offset is not None else None
        self._compared = 0
        # The layers added since the last comparison: their row projections where the state's
        # plan allows comparing them directly (all of one plan), else their fingerprints.
        self._waiting = 0
        self._plan: object = None  # the waiting states' common plan; None: through _prints
        self._projections: list[Tensor] = []
        self._prints = Fingerprints()
        # Filled in as layers are compared (allocated once: 16 bytes per layer of two halves).
        self._verdicts = prints.new_empty((len(self._rows), prints.shape[1]), dtype=verdict_dtype(prints.device))

    def add(self, state: Sequence[Tensor], layout: Layout) -> None:
        """The next layer's rebuilt input (fingerprinted with the forward's ``layout``)."""
        plan = comparable_plan(state, layout, self._prints_before.dtype)
        if self._waiting and plan is not self._plan:
            self._compare_waiting()  # one kind, one plan per comparison
        self._plan = plan
        if plan is not None:
            self._projections.extend(row_projections(state, plan))
        else:
            self._prints.add(state, layout)
        self._waiting += 1
        if self._waiting >= FOLD_EVERY:
            self._compare_waiting()

    def _compare_waiting(self) -> None:
        if not self._waiting:
            return
        start, stop = self._compared, self._compared + self._waiting
        if self._plan is not None:
            if self._before_t is not None:
                h, first = self._halves, self._offset + start  # type: ignore[operator]
                before_t = self._before_t[first * h : (first + stop - start) * h]
            else:
                before_t = transposed_projections(self._before(start, stop))
            projection_errors(self._projections, self._plan, before_t, self._verdicts[start:stop])  # type: ignore[arg-type]
            self._projections = []
        else:
            _compare(self._before(start, stop), self._prints.take(), self._verdicts[start:stop])  # type: ignore[arg-type]
        self._compared, self._waiting = stop, 0

    def _before(self, start: int, stop: int) -> Tensor:
        """The forward's fingerprints of layers ``start:stop``: a view where their rows follow
        each other (a run whose layers are all checked), else a copy (without a device sync:
        :func:`~revtrain.core.fingerprint.take_rows`)."""
        if self._offset is not None:
            return self._prints_before[self._offset + start : self._offset + stop]
        return take_rows(self._prints_before, self._rows[start:stop])

    def finish(
        self, layers: Sequence[object], where: Callable[[int], str], output_norms: Tensor, *, estimate: bool = False
    ) -> list[float] | None:
        """Verdicts for all layers (``where(k)`` names layer ``k``, ``output_norms`` ``(layers,
        m)`` are its forward output's norms): warns or raises as :func:`check_rebuilds` does.

        Returns the estimated relative error per layer, or None where every layer passed
        :func:`_all_within` at a glance (the usual case: the estimates are then not worked
        out); ``estimate=True`` always works them out."""
        self._compare_waiting()
        if len(layers) != self._compared:
            raise RuntimeError(f"{self._compared} rebuilt inputs for {len(layers)} checked layers")
        if not layers:
            return []
        before = self._before(0, len(layers))
        host = _on_host(before, self._verdicts, output_norms)
        if not estimate and _all_within(host[0], host[1], [getattr(layer, "drift_tolerance") for layer in layers]):
            return None

        def check(k: int) -> RebuildCheck:
            layer = layers[k]
            return RebuildCheck(layer, functools.partial(where, k), before[k], None, output_norms[k],
                                getattr(layer, "output_names", None))

        errors, names = _read(_summarise(*host), check)
        _report(errors, names, layers, check)
        return errors


def _all_within(before: np.ndarray, verdicts: np.ndarray, tolerances: Sequence[float]) -> bool:
    """Whether every layer passes at a glance: each rebuilt half finite and its relative error,
    measured against its own forward norm, within its layer's tolerance. The arithmetic is
    :func:`_summarise`'s (:func:`_rms_error` over a denominator, in float64), whose
    denominator is at least that norm; division rounds monotonically, so a layer that passes
    here has a relative error within tolerance there too, to the last bit. Anything else (a
    larger error, a zero or non-finite norm) goes to the full summary. A few array ops where
    the summary takes ~30: at a small shape the summary was 2% of an M-mode step."""
    with np.errstate(all="ignore"):  # x / 0 and NaNs only fail the test
        drift = _rms_error(verdicts) / before[..., 0].astype(np.float64, copy=False)
        return bool(np.isfinite(verdicts).all() and (drift <= np.asarray(tolerances, dtype=np.float64)[:, None]).all())


def _rms_error(verdicts: np.ndarray) -> np.ndarray:
    """Each half's root mean square projection error, in float64, from its verdict (the root
    sum of squares): one function for the screen and the summary, so that they round alike."""
    return verdicts.astype(np.float64, copy=False) / math.sqrt(PROJECTIONS)


def _compare(before: Tensor, after: Tensor, out: Tensor) -> None:
    """Fill ``out`` ``(layers, halves)`` with each half's verdict: the root sum of squares of
    its projections' differences (rebuilt minus forward), from ``(layers, halves, 1 +
    PROJECTIONS)`` fingerprints, summed in ``out``'s precision (:func:`verdict_dtype`): non-finite
    exactly where a rebuilt projection is. On a CPU with numpy (a few microseconds against ~80
    for torch's small ops inside a backward), elsewhere on the device, without a sync."""
    if out.device.type == "cpu" and before.dtype in _NUMPY_DTYPES:
        a, b, verdicts = after.detach().numpy(), before.detach().numpy(), out.numpy()
        with np.errstate(all="ignore"):  # non-finite values are what this looks for
            diff = a[..., 1:].astype(verdicts.dtype) - b[..., 1:]
            np.sqrt(np.einsum("lhp,lhp->lh", diff, diff), out=verdicts)
        return
    torch.linalg.vector_norm(after[..., 1:] - before[..., 1:], dim=-1, dtype=out.dtype, out=out)


def verdict_dtype(device: torch.device) -> torch.dtype:
    """The precision of the verdicts: float64 where the device has it, so that a sum of squares
    of float32 differences cannot overflow (a verdict is then non-finite exactly where a rebuilt
    projection is; float64 states would need differences above 1e154). Apple's MPS has no
    float64: float32 there, where a difference above ~1e18 would read as non-finite."""
    return torch.float32 if device.type == "mps" else torch.float64


_NUMPY_DTYPES = (torch.float32, torch.float64)


def _read(summary: np.ndarray, check: Callable[[int], RebuildCheck]) -> tuple[list[float], list[str]]:
    """Errors and the names of the worst halves from :func:`_summarise`'s rows; raises for a
    non-finite rebuild of a finite input."""
    errors: list[float] = [math.nan] * len(summary)
    names: list[str] = [""] * len(summary)
    for k, (finite_before, finite_after, drift, which, halves, first_bad) in enumerate(summary.tolist()):
        if not finite_before:
            continue  # the forward's input was not finite; the loss shows that already
        half = (lambda j: f"x{int(j) + 1}" if halves > 1 else "x")
        if not finite_after:
            bad = check(k)
            raise ReconstructionError(_non_finite_message(bad, half(first_bad), bad.output_norms.flatten().tolist()))
        errors[k] = drift
        names[k] = half(which)
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
    """The tensors as arrays in host memory: from a GPU in one copy (one sync, as float64),
    from the CPU without a copy (in their own dtype). ``gather`` forces the one-copy path (a
    test runs it on the CPU)."""
    tensors = tuple(t.detach() if t.requires_grad else t for t in tensors)  # a detach is an op
    if not (tensors[0].device.type != "cpu" if gather is None else gather):
        return [t.numpy() for t in tensors]
    dtype = verdict_dtype(tensors[0].device)  # float64 where the device has it
    flat = torch.cat([t.reshape(-1).to(dtype) for t in tensors]).cpu().numpy().astype(np.float64, copy=False)
    sizes = np.cumsum([t.numel() for t in tensors])[:-1]
    return [part.reshape(t.shape) for part, t in zip(np.split(flat, sizes), tensors)]


def _summarise(before: np.ndarray, verdicts: np.ndarray, out_norms: np.ndarray) -> np.ndarray:
    """Per layer: forward input finite, rebuild finite, largest relative error, its half, the
    number of halves and the first non-finite rebuilt half.

    ``before``: ``(layers, halves, 1 + PROJECTIONS)`` forward fingerprints; ``verdicts``:
    ``(layers, halves)`` from :func:`_compare` or :func:`~revtrain.core.fingerprint.projection_errors`;
    ``out_norms``: ``(layers, m)``. Worked out in float64.
    """
    before, verdicts, out_norms = (a.astype(np.float64, copy=False) for a in (before, verdicts, out_norms))
    with np.errstate(all="ignore"):  # non-finite values are what this looks for
        finite_before = np.isfinite(before).reshape(len(before), -1).all(axis=1)
        finite_halves = np.isfinite(verdicts)
        finite_after = finite_halves.all(axis=1)
        first_bad = np.argmin(finite_halves, axis=1)
        in_scale = np.sqrt(np.square(before[..., 0]).sum(axis=1))
        out_scale = np.sqrt(np.square(out_norms).sum(axis=1))
        scale = np.fmax(in_scale, out_scale)  # fmax: a non-finite output norm does not poison it
        error = _rms_error(verdicts)
        denominator = np.fmax(before[..., 0], FLOOR * scale[:, None])
        # Input and output exactly zero: any rebuilt value is wrong.
        zero = np.where(error > 0, math.inf, 0.0)
        drift = np.where(denominator == 0, zero, error / np.where(denominator == 0, 1.0, denominator))
        which = np.argmax(drift, axis=1)  # like torch.max: a NaN wins
        worst = np.take_along_axis(drift, which[:, None], axis=1)[:, 0]
    halves = np.full(len(before), before.shape[1])
    return np.stack([finite_before, finite_after, worst, which, halves, first_bad], axis=1).astype(np.float64)


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
