"""The rebuild check: does the input M-mode rebuilds in backward match the one the forward saw?

On a call the schedule samples (:func:`check_due`), the forward sketches each checked layer's
input and output state, the backward the rebuilt input, and the run compares them. The sketch of
a tensor (``n`` values as a matrix ``X`` of rows of about ``sqrt(n)``) is its norm and the 64
entries of ``V^T X U``, Gaussian ``U``, ``V`` drawn from a fixed seed per size by their own
generator (no cache, the model's random numbers untouched). Every entry of ``V^T D U`` has mean
square ``|D|^2``, so the sketches' difference estimates the rebuild error in any direction.

A half's relative error is that estimate over ``max(|x_half|, FLOOR * s)``, ``s`` the larger norm
of the layer's input and output. Above the tolerance (by default from :data:`TOLERANCES`, for the
precision ``F`` and ``G`` ran in) it warns, or raises with ``drift_action="raise"``; a non-finite
rebuild of a finite input raises, naming ``F``/``G`` or the inverse.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Sequence
from contextvars import ContextVar
from typing import Any

import torch
from torch import Tensor

from revtrain.core.step import owner_module
from revtrain.errors import ReconstructionDriftWarning, ReconstructionError

__all__ = ["PROJECTIONS", "FLOOR", "FIRST_CHECKS", "DEFAULT_EVERY", "TOLERANCES", "check_due", "sampled_call", "sketch",
           "tolerance_of", "RunCheck"]

PROJECTIONS = 64  # random projections per tensor in a sketch (8 x 8)
FLOOR = 0.1  # a half's error is measured against at least this fraction of the layer's scale
FIRST_CHECKS = 5  # the default schedule checks a layer's first calls ...
DEFAULT_EVERY = 50  # ... then one call in this many
TOLERANCES = {torch.float64: 1e-3, torch.float32: 1e-3, torch.float16: 2e-2, torch.bfloat16: 1e-1}
"""Default relative rebuild error allowed, by the precision ``F`` and ``G`` compute in; float32
on CUDA with TF32 allowed (PyTorch's default for convolutions) gets float16's, since TF32 keeps
float16's 10 mantissa bits."""

_SIDE = 8  # the sketch is _SIDE x _SIDE
_SEED = 0x5EED


def check_due(layer: Any) -> bool:
    """Whether ``layer`` checks its rebuild in this M-mode forward (and counts the call, per
    layer): ``check_every=None``: the first :data:`FIRST_CHECKS` calls, then one in
    :data:`DEFAULT_EVERY`; ``k``: one call in ``k``, from the first."""
    if not layer.check_reconstruction:
        return False
    every = getattr(layer, "check_every", None)
    if every == 1:
        return True
    holder = owner_module(layer) or layer  # the inverse of a layer counts on the layer
    calls = holder.__dict__.get("_check_calls", 0)
    holder.__dict__["_check_calls"] = calls + 1
    if every is None:
        return calls < FIRST_CHECKS or (calls - FIRST_CHECKS + 1) % DEFAULT_EVERY == 0
    return calls % every == 0


SAMPLED_CALL: ContextVar[bool | None] = ContextVar("revtrain_sampled_call", default=None)  # set by runs


def sampled_call() -> bool:
    """Whether a layer's own host-reading checks (a device sync) run in this forward: in an
    M-mode run, on the calls the rebuild check samples; elsewhere (a direct ``step_forward``), always."""
    return SAMPLED_CALL.get() is not False


def tolerance_of(layer: Any, compute_dtype: torch.dtype, *, tf32: bool = False) -> float:
    """The layer's ``drift_tolerance``, or the default for ``compute_dtype`` where it is None
    (float16's for float32 when ``tf32``: CUDA tensors with a TF32 switch on)."""
    tolerance = getattr(layer, "drift_tolerance", None)
    if tolerance is not None:
        return float(tolerance)
    if tf32 and compute_dtype == torch.float32:
        return TOLERANCES[torch.float16]
    return TOLERANCES.get(compute_dtype, TOLERANCES[torch.float32])


def sketch(state: Sequence[Tensor]) -> Tensor:
    """``(len(state), 1 + PROJECTIONS)``: each tensor's norm and its projections (float64 for
    float64 tensors, float32 otherwise)."""
    return torch.stack([_sketch_one(t) for t in state])


def _sketch_one(x: Tensor) -> Tensor:
    flat = x.detach().reshape(-1)
    if flat.is_complex():
        flat = torch.view_as_real(flat).reshape(-1)
    if flat.dtype != torch.float64:
        flat = flat.float()
    n = flat.numel()
    width = 1 << max(0, math.isqrt(max(n, 1) - 1).bit_length())  # a power of two >= sqrt(n)
    rows, rest = divmod(n, width)
    g = torch.Generator().manual_seed(_SEED)  # the same projections for the rebuild
    uv = torch.randn(width + rows + (rest > 0), _SIDE, generator=g, dtype=torch.float64).to(flat)
    u, v = uv[:width], uv[width:]
    parts = flat[: rows * width].view(rows, width) @ u  # (rows, 8)
    if rest:
        parts = torch.cat([parts, (flat[rows * width :] @ u[:rest])[None]])
    projected = (v.T @ parts).reshape(-1)
    norm = torch.linalg.vector_norm(flat, dtype=torch.float64).to(flat.dtype)  # no float32 overflow
    return torch.cat([norm[None], projected])


class RunCheck:
    """The check of one M-mode run: which layers are ``due``, the forward's and the rebuilds'
    sketches, the verdict (default tolerances for ``compute_dtype``, what ``F``, ``G`` ran in)."""

    def __init__(self, due: Sequence[bool], compute_dtype: torch.dtype) -> None:
        self.due = list(due)
        self.compute_dtype = compute_dtype
        # Host lists, state index -> sketch (layer i's input is state i): no tensor is kept.
        self.before: dict[int, list] = {}
        self.after: dict[int, list] = {}
        self.cuda = False

    @classmethod
    def start(cls, layers: Sequence[Any], compute_dtype: torch.dtype) -> RunCheck | None:
        """The check for a run on this call, or None where no layer of it is due."""
        due = [check_due(layer) for layer in layers]
        return cls(due, compute_dtype) if any(due) else None

    def forward(self, i: int, xs: Sequence[Tensor], ys: Sequence[Tensor]) -> None:
        """Layer ``i`` mapped ``xs`` to ``ys`` in the forward."""
        if self.due[i]:
            if i not in self.before:
                self.before[i] = sketch(xs).tolist()
            self.before[i + 1] = sketch(ys).tolist()
            self.cuda = xs[0].is_cuda

    def rebuilt(self, i: int, xs: Sequence[Tensor]) -> None:
        """Backward rebuilt ``xs`` as layer ``i``'s input."""
        if self.due[i]:
            self.after[i] = sketch(xs).tolist()

    def finish(self, layers: Sequence[Any], where: Any) -> list[float]:
        """Compare and report (``where(i)`` names layer ``i``); returns the relative error of each
        checked layer, top first (NaN where the forward's input was not finite)."""
        checked = sorted(self.after, reverse=True)
        if not checked:
            return []
        lists = [self.before[i] for i in checked] + [self.after[i] for i in checked] + [self.before[i + 1] for i in checked]
        shaped = [torch.tensor(v, dtype=torch.float64) for v in lists]
        k = len(checked)
        errors: list[float] = []
        over: list[tuple[float, int, str, float]] = []
        tf32 = self.cuda and any(flag for _, flag in _tf32_flags())
        for j, i in enumerate(checked):
            before, after, outputs = shaped[j], shaped[k + j], shaped[2 * k + j]
            if not torch.isfinite(before).all():
                errors.append(math.nan)  # the forward's input was not finite; the loss shows it
                continue
            halves = before.shape[0]
            name = (lambda h: f"x{h + 1}" if halves > 1 else "x")
            finite = torch.isfinite(after).all(dim=1)
            if not finite.all():
                bad = name(int((~finite).nonzero()[0]))
                raise ReconstructionError(_non_finite_message(layers[i], where(i), bad, outputs[:, 0].tolist()))
            error = torch.linalg.vector_norm(after[:, 1:] - before[:, 1:], dim=1) / math.sqrt(PROJECTIONS)
            scale = max(float(torch.linalg.vector_norm(before[:, 0])), float(torch.linalg.vector_norm(outputs[:, 0])))
            denominator = torch.clamp(before[:, 0], min=FLOOR * scale)
            drift = torch.where(denominator > 0, error / denominator.clamp(min=1e-300),
                                torch.where(error > 0, math.inf, 0.0))
            worst = int(drift.argmax())
            errors.append(float(drift[worst]))
            tolerance = tolerance_of(layers[i], self.compute_dtype, tf32=tf32)
            if errors[-1] > tolerance:
                over.append((errors[-1], i, name(worst), tolerance))
        if over:
            strict = [o for o in over if getattr(layers[o[1]], "drift_action", "warn") == "raise"]
            drift_value, i, half, tolerance = max(strict or over, key=lambda o: o[0])
            others = f" ({len(over)} of {k} checked layers of this run exceed their tolerance)" if len(over) > 1 else ""
            message = (
                f"the rebuilt input of {where(i)} drifted from the forward's by {drift_value:.2e} "
                f"(relative error of input {half}, estimated from {PROJECTIONS} random projections) "
                f"> drift_tolerance={tolerance:g}{others}; gradients may be inaccurate. Use float64, "
                "fewer consecutive M-mode layers, C-mode for this layer, or an exact coupling "
                "(coupling='exact'); raise drift_tolerance to accept it" + _tf32_hint(self.cuda)
            )
            if strict:
                raise ReconstructionError(message)
            warnings.warn(message, ReconstructionDriftWarning, stacklevel=4)
        return errors


def _tf32_hint(cuda: bool) -> str:
    """On CUDA with TF32 allowed, name it: TF32 rounds what ``F`` and ``G`` read to 10 mantissa
    bits, which can magnify rebuild errors."""
    if not cuda:
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


def _non_finite_message(layer: Any, where: str, bad: str, out_norms: list[float]) -> str:
    if not all(math.isfinite(v) for v in out_norms):
        order = getattr(layer, "output_names", None) or [(i, f"output {i + 1}") for i in range(len(out_norms))]
        culprit = next(name for i, name in order if not math.isfinite(out_norms[i]))
        return (
            f"the forward pass of {where} already produced non-finite values for a finite "
            f"input: {culprit} returned NaN or inf (the inverse is not at fault; the loss is "
            "non-finite too). Lower the learning rate, check the input scale and what "
            f"{culprit} computes (a log or division of values near 0), or clip gradients"
        )
    return (
        f"rebuilding the input of {where} produced non-finite values (input {bad}) although "
        "the forward's input and output were finite: the inverse overflowed or divided by ~0. "
        "Run this layer in C-mode (layer.mode = 'C'), use a bounded coupling scale, a smaller "
        "learning rate, or check it with revtrain.verify_invertible"
    )
