"""In-place activated batch norm (Rota Bulò et al. 2018) as an invertible layer with M/C modes.

``InPlaceABN`` is batch norm (affine) followed by a leaky ReLU, one layer. With a positive slope
and a nonzero scale ``γ`` it is invertible given its output and the per-channel statistics it
normalised with, so in M-mode it keeps only its output (which the convolution after it keeps
anyway) and rebuilds its input in backward; the gradients come straight from the output, in
closed form, without running the forward again. ``docs/layers.md`` derives the formulas.

``BatchNormLeakyReLU`` is the plain twin: an ``nn.BatchNorm2d`` followed by a leaky ReLU, with the
same parameter and buffer names, so state dicts move between the two.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from revtrain.core import Invertible, Mode, StepResult
from revtrain.core.step import Grads, State, autograd_grads
from revtrain.core.arguments import NO_ARGS, ExtraArgs
from revtrain.core.checks import sampled_call
from revtrain.errors import ReversibilityError

__all__ = ["ABNRecord", "InPlaceABN", "BatchNormLeakyReLU"]


@dataclass(frozen=True)
class ABNRecord:
    """What an M-mode forward leaves for the rebuild: the statistics and the affine parameters
    it normalised with (two vectors of ``C`` numbers, and references to ``γ`` and ``β``)."""

    mean: Tensor
    """Per-channel mean, shape ``(C,)``."""
    invstd: Tensor
    """Per-channel ``1 / sqrt(var + eps)``, shape ``(C,)``."""
    batch: bool
    """True for the batch's own statistics (training), False for the running ones (eval)."""
    weight: Tensor
    """The ``γ`` the forward used (the tensor itself, not a copy: under
    ``torch.func.functional_call`` it is the substituted one, not the module's)."""
    bias: Tensor
    """The ``β`` the forward used."""


class InPlaceABN(Invertible):
    """Batch norm + leaky ReLU that can drop its input and rebuild it from its output.

    ``y = LeakyReLU(γ·(x − μ)/sqrt(σ² + eps) + β)``, per channel (dimension 1), with batch
    statistics in training and running statistics in eval, exactly as ``nn.BatchNorm2d``
    followed by ``nn.LeakyReLU`` (C-mode is that computation under plain autograd).

    M-mode keeps only the output ``y`` and, per channel, the mean and inverse standard deviation
    it normalised with. Backward rebuilds ``x`` from ``y`` and computes every gradient from
    ``y`` and ``dL/dy`` in closed form (no second forward); running statistics are updated once,
    in the forward.

    Args:
        num_features: Channels ``C``.
        slope: Negative slope of the leaky ReLU; must be positive (0 would lose the sign of
            the negative half and with it the inverse).
        eps: Added to the variance, as in ``nn.BatchNorm2d``.
        momentum: Running-average factor, or None for a cumulative average (as in
            ``nn.BatchNorm2d``).
        min_weight: In M-mode the forward refuses any ``|γ|`` below this: the rebuild divides
            by ``γ``, so a rounding error ``u`` in the output becomes ``u·|β|/|γ|`` in the
            rebuilt normalised input. ``γ`` is learned, so it is checked in the forwards of
            M-mode training steps the rebuild check samples (one device sync each;
            ``check_every=1``: every step) and in every direct :meth:`step_forward`.
        closed_form_backward: Compute M-mode gradients from the output in closed form (True),
            or rebuild the input and run the forward once more under autograd (False; slower,
            kept to compare).
        mode: ``"M"`` or ``"C"``; settable any time via ``layer.mode``.
        check_reconstruction: Compare a sketch (norm and random projections) of the input seen
            in the forward with that of the rebuilt one in backward, on the steps the check
            samples (see ``docs/core.md``); False also stops the ``min_weight`` check in M-mode
            training steps.
        drift_tolerance: Relative difference allowed by that check (default: by the precision
            the layer computes in, as for every reversible layer).
        drift_action: ``"warn"`` or ``"raise"`` when it is exceeded.
    """

    def __init__(
        self,
        num_features: int,
        slope: float = 0.01,
        *,
        eps: float = 1e-5,
        momentum: float | None = 0.1,
        min_weight: float = 1e-4,
        closed_form_backward: bool = True,
        mode: Mode = "M",
        check_reconstruction: bool = True,
        drift_tolerance: float | None = None,
        drift_action: Literal["warn", "raise"] = "warn",
    ) -> None:
        super().__init__(
            mode,
            preserve_rng_state=False,  # no randomness inside
            check_reconstruction=check_reconstruction,
            drift_tolerance=drift_tolerance,
            drift_action=drift_action,
        )
        _check_config(num_features, slope, eps, momentum)
        if not (isinstance(min_weight, (int, float)) and min_weight >= 0 and math.isfinite(min_weight)):
            raise ValueError(f"min_weight must be a finite number >= 0, got {min_weight!r}")
        self.num_features = num_features
        self.slope = float(slope)
        self.eps = float(eps)
        self.momentum = momentum
        self.min_weight = float(min_weight)
        self.closed_form_backward = closed_form_backward
        self.weight = nn.Parameter(torch.ones(num_features))
        self.bias = nn.Parameter(torch.zeros(num_features))
        self.register_buffer("running_mean", torch.zeros(num_features))
        self.register_buffer("running_var", torch.ones(num_features))
        self.register_buffer("num_batches_tracked", torch.tensor(0, dtype=torch.long))

    def extra_repr(self) -> str:
        return (
            f"{self.num_features}, slope={self.slope:g}, eps={self.eps:g}, "
            f"momentum={self.momentum}, mode={self.mode!r}"
        )

    # -- the computation (C-mode, and M-mode without grad) -----------------------------------

    def forward_state(self, xs: State) -> State:
        (x,) = xs
        self._check_input(x)
        if self.training:
            factor = self._count_step()
            z = F.batch_norm(x, self.running_mean, self.running_var, self.weight, self.bias,
                             True, factor, self.eps)
        else:
            z = F.batch_norm(x, self.running_mean, self.running_var, self.weight, self.bias,
                             False, 0.0, self.eps)
        return (F.leaky_relu(z, self.slope),)

    def inverse_state(self, ys: State) -> State:
        """Rebuild ``x`` from ``y`` with the running statistics (eval mode only).

        In training the forward normalised with the batch's own statistics, which ``y`` alone
        does not determine; use :meth:`invert` with the :class:`ABNRecord` that
        :meth:`step_forward` returned.
        """
        if self.training:
            raise ReversibilityError(
                "InPlaceABN in training mode normalises with the batch's own statistics, so its "
                "input cannot be rebuilt from the output alone; call layer.invert(y, record) "
                "with the record of that forward (layer.step_forward((x,)) returns it), or put "
                "the layer in eval mode to invert with the running statistics"
            )
        return (self.invert(ys[0], self._eval_record()),)

    def invert(self, y: Tensor, record: ABNRecord) -> Tensor:
        """``x`` from ``y`` and the forward's record: ``z = y`` where ``y > 0``, else
        ``y / slope``; then ``x = (z − β)/(γ·invstd) + μ``."""
        _check_weight(record.weight, self.min_weight)
        with torch.no_grad():
            return self._rebuild(y, record)

    def _rebuild(self, y: Tensor, record: ABNRecord) -> Tensor:
        # Half types are rebuilt in float32 and rounded once, to y's dtype.
        compute = torch.promote_types(y.dtype, torch.float32)
        z = F.leaky_relu(y.to(compute), 1.0 / self.slope)  # a fresh tensor: becomes x in place
        w, b = record.weight.detach().to(compute), record.bias.detach().to(compute)
        scale = (w * record.invstd.to(compute)).reciprocal()
        shift = record.mean.to(compute) - b * scale
        shape = _channel_shape(y)
        return z.mul_(scale.view(shape)).add_(shift.view(shape)).to(y.dtype)

    # -- the reversible step ------------------------------------------------------------------

    def step_forward(self, xs: State, extra: ExtraArgs = NO_ARGS) -> tuple[State, Any]:
        _refuse_extra(extra)
        (x,) = xs
        self._check_input(x)
        if sampled_call():  # one device sync: in an M-mode run, on the calls the check samples
            _check_weight(self.weight, self.min_weight)
        w, b = self.weight.detach(), self.bias.detach()
        with torch.no_grad():
            if self.training:
                factor = self._count_step()
                y, mean, invstd = torch.native_batch_norm(
                    x, w, b, self.running_mean, self.running_var, True, factor, self.eps
                )
                record = ABNRecord(mean, invstd, True, self.weight, self.bias)
            else:
                y = F.batch_norm(x, self.running_mean, self.running_var, w, b, False, 0.0, self.eps)
                record = self._eval_record()
            # Activate in place: the fresh normalised tensor becomes the output, one tensor in all.
            F.leaky_relu(y, self.slope, inplace=True)
        return (y,), record

    def step_reverse(
        self,
        ys: State,
        dys: Grads,
        record: Any,
        params: Sequence[Tensor],
        need_input_grad: bool,
        extra: ExtraArgs = NO_ARGS,
    ) -> StepResult:
        """Rebuild ``x`` from ``y`` and backpropagate ``dy`` (closed form; see docs/layers.md).

        ``params`` are matched to ``γ``/``β`` of the record (the tensors the forward used).
        """
        if not isinstance(record, ABNRecord):
            raise ReversibilityError(
                "InPlaceABN's rebuild needs the statistics its forward normalised with; pass the "
                "record that step_forward returned (reverse_step(layer, y, dy, record=...))"
            )
        (y,), (dy,) = ys, dys
        if self.closed_form_backward:
            return self._closed_form_reverse(y.detach(), dy, record, params, need_input_grad)
        return self._recompute_reverse(y.detach(), dy, record, params, need_input_grad)

    def _closed_form_reverse(
        self, y: Tensor, dy: Tensor | None, record: ABNRecord, params: Sequence[Tensor],
        need_input_grad: bool,
    ) -> StepResult:
        # γ was checked in the forward where the schedule samples it (docs/layers.md); no sync here.
        x = self._rebuild(y, record)
        if dy is None:
            return StepResult((x,), (None,), [None] * len(params))
        # dz = dy where y > 0, else slope·dy: the sign of z survives in y.
        dz = torch.ops.aten.leaky_relu_backward(dy, y, self.slope, True)
        w = record.weight.detach()
        if record.batch:
            # Batch norm's own backward kernel on the rebuilt x with the forward's statistics:
            # dβ = Σdz, dγ = Σdz·x̂, dx = γ·s·(dz − dβ/N − x̂·dγ/N), fused (docs/layers.md).
            dx, dgamma, dbeta = torch.ops.aten.native_batch_norm_backward(
                dz, x, w, None, None, record.mean, record.invstd, True, self.eps,
                [need_input_grad, True, True],
            )
        else:  # running statistics are constants: dx = γ·s·dz
            shape, dims = _channel_shape(y), [0, *range(2, y.dim())]
            dbeta = dz.sum(dims, dtype=w.dtype)
            dgamma = (dz * (x - record.mean.view(shape))).sum(dims, dtype=w.dtype) * record.invstd
            dx = (dz * (w * record.invstd).view(shape)).to(y.dtype) if need_input_grad else None
        del dz
        grads = _match(params, {id(record.weight): dgamma, id(record.bias): dbeta})
        return StepResult((x,), (dx if need_input_grad else None,), grads)

    def _recompute_reverse(
        self, y: Tensor, dy: Tensor | None, record: ABNRecord, params: Sequence[Tensor],
        need_input_grad: bool,
    ) -> StepResult:
        """The generic path: rebuild ``x``, run the forward again under autograd (no running
        statistics update), differentiate."""
        x = self._rebuild(y, record).requires_grad_(need_input_grad)
        if dy is None:
            return StepResult((x.detach(),), (None,), [None] * len(params))
        w, b = record.weight, record.bias
        with torch.enable_grad():
            if record.batch:
                z = F.batch_norm(x, None, None, w, b, True, 0.0, self.eps)
            else:  # running statistics are constants of the forward
                shape = _channel_shape(x)
                z = (x - record.mean.view(shape)) * (record.invstd * w).view(shape) + b.view(shape)
            out = F.leaky_relu(z, self.slope)
        grads = autograd_grads([out], [x, *params] if need_input_grad else list(params), [dy])
        dx = grads.pop(0) if need_input_grad else None
        return StepResult((x.detach(),), (dx,), grads)

    # -- helpers ------------------------------------------------------------------------------

    def _count_step(self) -> float:
        """Count one training forward; the running-average factor ``nn.BatchNorm2d`` would use."""
        self.num_batches_tracked.add_(1)
        if self.momentum is None:
            return 1.0 / float(self.num_batches_tracked)
        return self.momentum

    def _eval_record(self) -> ABNRecord:
        mean = self.running_mean.detach().clone()
        invstd = torch.rsqrt(self.running_var.detach() + self.eps)
        return ABNRecord(mean, invstd, False, self.weight, self.bias)

    def _check_input(self, x: Tensor) -> None:
        if x.dim() < 2 or x.shape[1] != self.num_features:
            raise ValueError(
                f"InPlaceABN({self.num_features}) expects input (N, {self.num_features}, ...), "
                f"got shape {tuple(x.shape)}; build it with num_features={x.shape[1] if x.dim() > 1 else '?'}"
                " or fix the layer before it"
            )
        if self.training and x.numel() // self.num_features < 2:
            raise ValueError(
                f"InPlaceABN in training mode needs more than one value per channel to compute "
                f"batch statistics, got input shape {tuple(x.shape)}; use a larger batch or "
                "input, or eval mode"
            )


class BatchNormLeakyReLU(nn.BatchNorm2d):
    """``nn.BatchNorm2d`` followed by a leaky ReLU: the plain twin of :class:`InPlaceABN`.

    Same parameters and buffers under the same names (``weight``, ``bias``, ``running_mean``,
    ``running_var``, ``num_batches_tracked``), so ``load_state_dict`` works both ways. Accepts
    ``(N, C, *)`` inputs like :class:`InPlaceABN`.

    Args:
        num_features: Channels.
        slope: Negative slope of the leaky ReLU.
        eps: As in ``nn.BatchNorm2d``.
        momentum: As in ``nn.BatchNorm2d``.
        inplace: Apply the leaky ReLU in place on the batch norm's output (saves that tensor
            in plain autograd too; the usual ``nn.LeakyReLU(inplace=True)``).
    """

    def __init__(
        self,
        num_features: int,
        slope: float = 0.01,
        *,
        eps: float = 1e-5,
        momentum: float | None = 0.1,
        inplace: bool = False,
    ) -> None:
        _check_config(num_features, slope, eps, momentum)
        super().__init__(num_features, eps=eps, momentum=momentum)
        self.slope = float(slope)
        self.inplace = inplace

    def _check_input_dim(self, input: Tensor) -> None:
        # (N, C, *) like InPlaceABN, not only 4-D: the computation does not depend on it.
        if input.dim() < 2:
            raise ValueError(f"expected input (N, C, ...), got {input.dim()}D input")

    def forward(self, x: Tensor) -> Tensor:
        return F.leaky_relu(super().forward(x), self.slope, inplace=self.inplace)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, slope={self.slope:g}, inplace={self.inplace}"


def _refuse_extra(extra: ExtraArgs) -> None:
    if extra:
        raise TypeError(
            "InPlaceABN takes one input tensor and no extra arguments: call it as layer(x)"
        )


def _check_config(num_features: int, slope: float, eps: float, momentum: float | None) -> None:
    if not isinstance(num_features, int) or num_features < 1:
        raise ValueError(f"num_features must be a positive int, got {num_features!r}")
    if not isinstance(slope, (int, float)) or not math.isfinite(slope) or slope <= 0:
        raise ReversibilityError(
            f"the leaky ReLU slope must be a finite number > 0, got {slope!r}: only a positive slope maps "
            "negative values one to one (slope 0, a ReLU, maps them all to 0), so that the input can be "
            "rebuilt; use e.g. slope=0.01 (In-place ABN's default)"
        )
    if not isinstance(eps, (int, float)) or not eps > 0:
        raise ValueError(f"eps must be > 0, got {eps!r}")
    if momentum is not None and not 0.0 <= momentum <= 1.0:
        raise ValueError(f"momentum must be in [0, 1] or None, got {momentum!r}")


def _check_weight(weight: Tensor, min_weight: float) -> None:
    """Refuse a scale the inverse would divide by ~0 (one device sync)."""
    w = weight.detach()
    if w.device.type == "meta":  # shapes only, no values to check
        return
    bad = ~(w.abs() >= min_weight)  # NaN fails the comparison too
    if bool(bad.any()):
        channels = bad.nonzero().flatten().tolist()
        shown = ", ".join(f"{c} (γ={w[c].item():.3g})" for c in channels[:5])
        more = f" and {len(channels) - 5} more" if len(channels) > 5 else ""
        raise ReversibilityError(
            f"InPlaceABN in M-mode cannot rebuild its input: |γ| < min_weight={min_weight:g} in "
            f"channel(s) {shown}{more}. The inverse divides by γ. Run this layer in C-mode "
            "(layer.mode = 'C'), keep γ away from zero (e.g. no weight decay on it), or lower "
            "min_weight if you accept the larger rebuild error"
        )


def _match(params: Sequence[Tensor], grads: dict[int, Tensor]) -> list[Tensor | None]:
    """The gradient of each tensor of ``params`` (by identity), in its dtype; None if absent."""
    return [grads[id(p)].to(p.dtype) if id(p) in grads else None for p in params]


def _channel_shape(x: Tensor) -> tuple[int, ...]:
    """Shape that broadcasts a per-channel vector over ``x`` (channels in dimension 1)."""
    return (1, x.shape[1]) + (1,) * (x.dim() - 2)
