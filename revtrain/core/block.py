"""``ReversibleBlock``: one RevNet/MemCNN coupling block with a memory mode."""

from __future__ import annotations

from collections.abc import Generator, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import Tensor, nn

from revtrain.core.arguments import NO_ARGS, ExtraArgs
from revtrain.core.coupling import (
    AdditiveCoupling,
    AffineCoupling,
    Coupling,
    CouplingLike,
    ExactAdditiveCoupling,
    FOut,
    InverseCoupling,
    get_coupling,
)
from revtrain.core.function import check_state, run_reversible
from revtrain.core.overlap import finish_phases
from revtrain.core.invertible import (
    MODES,
    InverseStep,
    Invertible,
    Mode,
    normalize_mode,
    replay,
    route_extra_grads,
)
from revtrain.core.randomness import known_random_free
from revtrain.core.replay import RngState
from revtrain.core.step import Grads, State, StepResult, autograd_grads
from revtrain.errors import ReversibilityError

__all__ = ["ReversibleBlock", "Mode", "MODES", "normalize_mode", "split_halves"]


def split_halves(x: Tensor, split_dim: int) -> tuple[Tensor, Tensor]:
    """Split ``x`` into two equal halves along ``split_dim`` (views, no copy)."""
    if not isinstance(x, Tensor):
        raise ReversibilityError(
            f"a reversible block takes a tensor or a pair (x1, x2) of tensors; got a "
            f"{type(x).__name__}"
        )
    if x.dim() == 0 or not -x.dim() <= split_dim < x.dim():
        raise ReversibilityError(
            f"cannot split a tensor of shape {tuple(x.shape)} along dim {split_dim}; pass a "
            "tensor that has that dimension or set split_dim to the channel dimension"
        )
    size = x.shape[split_dim]
    if size % 2:
        raise ReversibilityError(
            f"cannot split dim {split_dim} of size {size} (shape {tuple(x.shape)}) into two equal "
            f"halves; use an even size there (e.g. a 1x1 conv to {size + 1} channels before the "
            "block), or call the block on a pair block((x1, x2))"
        )
    x1, x2 = x.chunk(2, dim=split_dim)
    return x1, x2


@dataclass
class _CouplingRecord:
    """What the forward leaves for one block's rebuild: the generators before F and before G."""

    rng_f: RngState | None
    rng_g: RngState | None


@dataclass(frozen=True)
class _Roles:
    """Who plays ``F`` and ``G`` with which coupling: the block itself, or its inverse (whose
    "F" is the block's ``G`` and whose coupling is the block's coupling inverted)."""

    f: nn.Module
    g: nn.Module
    f_name: str
    g_name: str
    coupling: Coupling


class ReversibleBlock(Invertible):
    """A reversible coupling block ``y1 = c(x1, F(x2)), y2 = c(x2, G(y1))``.

    The block works under plain ``loss.backward()`` and ``torch.autograd.grad``. Its mode
    decides what backward costs:

    - ``"M"`` (memory-centric): the input is not kept; backward rebuilds it from the output
      with the inverse, building the graphs of ``F`` and ``G`` once and reusing them for the
      gradients (RevNet Algorithm 1: ``F`` and ``G`` run once more each). Consecutive M-mode
      blocks keep only their last output, whether inside a
      :class:`~revtrain.core.ReversibleSequence` or chained in any container.
    - ``"C"`` (compute-centric): plain autograd; keeps what backward needs, no extra compute.

    Args:
        f: Module applied to the second half; its output is coupled into the first half.
        g: Module applied to the new first half; its output is coupled into the second half.
        coupling: ``"additive"`` (``y = x + h``), ``"affine"`` (``y = x * exp(s) + t``),
            ``"exact"`` (additive on a fixed-point grid: bit-exact rebuilds, see
            :class:`~revtrain.core.ExactAdditiveCoupling`), or a
            :class:`~revtrain.core.Coupling` instance.
        split_dim: Dimension along which a single input tensor is split in halves.
        mode: ``"M"`` or ``"C"``; can be changed any time through ``block.mode``.
        preserve_rng_state: Capture the random generators before ``F`` and ``G`` in the forward
            and replay them in the rebuild, so dropout inside ``F``/``G`` rebuilds exactly. Turn
            off only when ``F`` and ``G`` use no randomness.
        check_reconstruction, drift_tolerance, drift_action, check_every: The rebuild check
            and its schedule (see :class:`~revtrain.core.Invertible`).

    Call it on one tensor (split in halves along ``split_dim``, output concatenated) or on a
    pair ``block((x1, x2)) -> (y1, y2)``. Further arguments go to ``F`` and ``G``:
    ``block(x, mask, pos=p)`` computes ``F(x2, mask, pos=p)`` and ``G(y1, mask, pos=p)``;
    tensors among them get gradients. ``block.inverse(y, ...)`` rebuilds the input; in M-mode
    it keeps only its own output too. Forward hooks on the block do not fire for blocks run
    inside an M-mode run of a sequence.
    """

    output_names = ((0, "F"), (1, "G"))
    """Which function produced each output half, in the order they are computed."""

    def __init__(
        self,
        f: nn.Module,
        g: nn.Module,
        coupling: CouplingLike = "additive",
        split_dim: int = 1,
        mode: Mode = "M",
        *,
        preserve_rng_state: bool = True,
        check_reconstruction: bool = True,
        drift_tolerance: float | None = None,
        drift_action: Literal["warn", "raise"] = "warn",
        check_every: int | None = None,
    ) -> None:
        super().__init__(
            mode,
            preserve_rng_state=preserve_rng_state,
            check_reconstruction=check_reconstruction,
            drift_tolerance=drift_tolerance,
            drift_action=drift_action,
            check_every=check_every,
        )
        if not isinstance(f, nn.Module) or not isinstance(g, nn.Module):
            raise TypeError(
                "ReversibleBlock needs F and G as nn.Module instances (wrap a function in a small "
                f"nn.Module); got {type(f).__name__} and {type(g).__name__}"
            )
        self.f = f
        self.g = g
        self.coupling: Coupling = get_coupling(coupling, split_dim)
        self.split_dim = split_dim

    def extra_repr(self) -> str:
        return f"mode={self._mode!r}, coupling={self.coupling.name!r}, split_dim={self.split_dim}"

    @property
    def roles(self) -> _Roles:
        # Made once per (F, G, coupling): this runs for every block call.
        f, g, coupling = self._modules["f"], self._modules["g"], self.coupling
        roles = self.__dict__.get("_roles")
        if roles is None or roles.f is not f or roles.g is not g or roles.coupling is not coupling:
            roles = self.__dict__["_roles"] = _Roles(f, g, "F", "G", coupling)  # type: ignore[arg-type]
        return roles

    @property
    def inverse_roles(self) -> _Roles:
        return _Roles(self.g, self.f, "G", "F", InverseCoupling(self.coupling))

    # -- the coupling itself, shared by every path ------------------------------------------

    def checked_call(
        self, fn: nn.Module, fn_name: str, inp: Tensor, other: Tensor, extra: ExtraArgs = NO_ARGS
    ) -> FOut:
        """``fn(inp, *extra)``, refusing an ``fn`` that edits its input in place or whose
        output does not fit the coupling with ``other`` (the half it is coupled into)."""
        version = inp._version
        try:
            h = extra.call(fn, inp)
        except (RuntimeError, TypeError) as err:
            _explain_call_error(fn, fn_name, inp, extra, err)
            raise
        if inp._version != version:
            raise ReversibilityError(
                f"{fn_name} modified its input in place (e.g. nn.ReLU(inplace=True) or x.add_() "
                f"as its first operation), so the block's input cannot be rebuilt; make the first "
                f"operation of {fn_name} out-of-place"
            )
        self.coupling.check_shapes(other, h, self.split_dim, fn_name)
        return h

    def forward_pair(self, x1: Tensor, x2: Tensor, extra: ExtraArgs = NO_ARGS) -> tuple[Tensor, Tensor]:
        """The coupling computed directly, under the ambient autograd mode."""
        (y1, y2), _ = _couple_forward(self, self.roles, x1, x2, extra, rng=False)
        return y1, y2

    def inverse_pair(self, y1: Tensor, y2: Tensor, extra: ExtraArgs = NO_ARGS) -> tuple[Tensor, Tensor]:
        """Rebuild ``(x1, x2)`` from ``(y1, y2)`` under the ambient autograd mode."""
        (x2, x1), _ = _couple_forward(self, self.inverse_roles, y2, y1, extra, rng=False)
        return x1, x2

    # -- Invertible: states are pairs of halves ----------------------------------------------

    def forward_state(self, xs: State, *args: Any, **kwargs: Any) -> State:
        return self.forward_pair(*xs, extra=ExtraArgs.of(args, kwargs))

    def inverse_state(self, ys: State, *args: Any, **kwargs: Any) -> State:
        return self.inverse_pair(*ys, extra=ExtraArgs.of(args, kwargs))

    def to_state(self, value: Any) -> State:
        if isinstance(value, (tuple, list)):
            if len(value) != 2:
                raise ReversibilityError(
                    f"a block called on a pair takes (x1, x2); got a {type(value).__name__} of "
                    f"{len(value)} items"
                )
            return tuple(value)
        return split_halves(value, self.split_dim)

    def from_state(self, state: State) -> Any:
        return torch.cat(list(state), dim=self.split_dim)

    def describe(self) -> str:
        return self.extra_repr()

    # -- entry points ------------------------------------------------------------------------

    def forward(self, x: Any, *args: Any, **kwargs: Any) -> Any:  # type: ignore[override]
        return self._run(x, args, kwargs, inverse=False)

    def inverse(self, y: Any, *args: Any, **kwargs: Any) -> Any:  # type: ignore[override]
        """Rebuild the input from the output: one tensor in, one out; a pair in, a pair out.

        In M-mode with gradients enabled the inverse keeps only its own output (memcnn's
        ``keep_input_inverse=False``): backward rebuilds ``y`` by running the block forward,
        ``F`` and ``G`` once more each, like the forward's backward.
        """
        return self._run(y, args, kwargs, inverse=True)

    def inverse_step(self) -> InverseStep:
        return _BlockInverse(self)

    def _run(self, value: Any, args: tuple, kwargs: dict, *, inverse: bool) -> Any:
        pair = isinstance(value, (tuple, list))
        xs = self.to_state(value)
        check_state(xs)
        extra = ExtraArgs.of(args, kwargs)
        xs, source = self.coupling.prepare_input(xs, value)
        if self._mode == "M" and torch.is_grad_enabled():
            step = self.inverse_step() if inverse else self
            out = run_reversible((step,), xs, None if pair else self.split_dim, extra, source)
        else:
            a, b = (self.inverse_pair if inverse else self.forward_pair)(*xs, extra=extra)  # type: ignore[misc]
            out = (a, b) if pair else torch.cat([a, b], dim=self.split_dim)
        self.coupling.mark_output(out)
        return out

    # -- the reversible step: RevNet Algorithm 1 ---------------------------------------------

    def step_forward(self, xs: State, extra: ExtraArgs = NO_ARGS) -> tuple[State, Any]:
        return _couple_forward(self, self.roles, xs[0], xs[1], extra, rng=_capture_rng(self))

    def step_reverse(
        self,
        ys: State,
        dys: Grads,
        record: Any,
        params: Sequence[Tensor],
        need_input_grad: bool,
        extra: ExtraArgs = NO_ARGS,
    ) -> StepResult:
        return _couple_reverse(self.roles, ys, dys, record, params, need_input_grad, extra)

    def reverse_phases(
        self, ys: State, record: Any, params: Sequence[Tensor], need_input_grad: bool, extra: ExtraArgs = NO_ARGS
    ) -> Generator[Any, Any, StepResult]:
        """:meth:`step_reverse` in three phases (rebuild ``x2``; take ``dys``, rebuild ``x1``;
        gradients), for a driver that overlaps the rebuild of the block below with this
        block's gradients (``ReversibleSequence(..., overlap_rebuild=True)``)."""
        return _couple_phases(self.roles, ys, record, params, need_input_grad, extra)


class _BlockInverse(InverseStep):
    """A block's inverse as a reversible step: the block with ``F``/``G`` swapped, its
    coupling inverted and its halves swapped, so the rebuild is Algorithm 1 too."""

    module: ReversibleBlock
    output_names = ((1, "G"), (0, "F"))

    def step_forward(self, ys: State, extra: ExtraArgs = NO_ARGS) -> tuple[State, Any]:
        block = self.module
        (x2, x1), record = _couple_forward(block, block.inverse_roles, ys[1], ys[0], extra, rng=_capture_rng(block))
        return (x1, x2), record

    def step_reverse(
        self,
        xs: State,
        dxs: Grads,
        record: Any,
        params: Sequence[Tensor],
        need_input_grad: bool,
        extra: ExtraArgs = NO_ARGS,
    ) -> StepResult:
        r = _couple_reverse(
            self.module.inverse_roles, (xs[1], xs[0]), (dxs[1], dxs[0]), record, params, need_input_grad, extra
        )
        return StepResult((r.inputs[1], r.inputs[0]), (r.grad_inputs[1], r.grad_inputs[0]), r.param_grads, r.extra_grads)


# -- the two halves of the algorithm, for a block or its inverse -------------------------------


_BUILT_IN_COUPLINGS = frozenset({AdditiveCoupling, ExactAdditiveCoupling, AffineCoupling})
"""Couplings whose forward and inverse draw no random numbers (matched by exact type)."""


def _capture_rng(block: ReversibleBlock) -> bool:
    """Whether a block's M-mode forward captures the random generators for its rebuild: when
    asked to (``preserve_rng_state``), unless the run knows that nothing below the block draws
    random numbers (``core/randomness.py``) and the coupling is a built-in one."""
    return block.preserve_rng_state and not (known_random_free() and type(block.coupling) in _BUILT_IN_COUPLINGS)


def _couple_forward(
    block: ReversibleBlock, roles: _Roles, x1: Tensor, x2: Tensor, extra: ExtraArgs, *, rng: bool
) -> tuple[State, _CouplingRecord]:
    """``y1 = c(x1, F(x2)); y2 = c(x2, G(y1))`` under the ambient grad mode."""
    coupling = roles.coupling
    rng_f = RngState.capture(x1.device) if rng else None
    y1 = coupling.forward(x1, block.checked_call(roles.f, roles.f_name, x2, x1, extra))
    rng_g = RngState.capture(x1.device) if rng else None
    y2 = coupling.forward(x2, block.checked_call(roles.g, roles.g_name, y1, x2, extra))
    if rng_f is not None and rng_g is not None:
        # Replay only what drew random numbers: 5% of a small M-mode step went to replaying
        # generators for F and G without randomness.
        g_drew = not rng_g.same_as(RngState.capture(x1.device))
        rng_f = None if rng_f.same_as(rng_g) else rng_f
        rng_g = rng_g if g_drew else None
    if type(coupling).check_range is not Coupling.check_range:  # skip describe() where a no-op
        coupling.check_range((y1, y2), block.describe())
    return (y1, y2), _CouplingRecord(rng_f, rng_g)


def _couple_reverse(
    roles: _Roles,
    ys: State,
    dys: Grads,
    record: Any,
    params: Sequence[Tensor],
    need_input_grad: bool,
    extra: ExtraArgs,
) -> StepResult:
    """Rebuild ``(x1, x2)`` from ``(y1, y2)`` and backpropagate, building each graph once.

    ``G`` runs once on ``y1`` building its graph: ``x2 = c⁻¹(y2, G(y1))`` is rebuilt and
    ``dy2`` backpropagated through that graph; then ``F`` runs once on the rebuilt ``x2``
    building its graph: ``x1 = c⁻¹(y1, F(x2))``, and ``dz1`` is backpropagated. The three
    phases of :func:`_couple_phases`, one after the other.
    """
    phases = _couple_phases(roles, ys, record, params, need_input_grad, extra, build_g=dys[1] is not None)
    next(phases)
    phases.send(dys)
    return finish_phases(phases)


def _couple_phases(
    roles: _Roles,
    ys: State,
    record: Any,
    params: Sequence[Tensor],
    need_input_grad: bool,
    extra: ExtraArgs,
    *,
    build_g: bool = True,
) -> Generator[Any, Any, StepResult]:
    """Algorithm 1 in three phases, so that a driver can interleave the phases of two blocks
    (PaReprop: rebuild the block below while this one computes gradients).

    1. ``G`` forward on ``y1`` (with its graph when ``build_g``) and ``x2`` rebuilt; then it
       yields and receives the output gradients ``dys``.
    2. ``G``'s backward, ``F`` forward on ``x2`` and ``x1`` rebuilt; yields the rebuilt input.
    3. ``F``'s backward; returns the :class:`StepResult`.
    """
    rng_f = record.rng_f if isinstance(record, _CouplingRecord) else None
    rng_g = record.rng_g if isinstance(record, _CouplingRecord) else None
    coupling = roles.coupling
    y1, y2 = ys
    _consume(ys, ())  # from here on, y2 dies as soon as this function is done with it
    params = list(params)
    extra_wrt = [t for t in extra.tensors if t.requires_grad]
    n_params = len(params)
    z1 = y1.detach().requires_grad_(build_g)
    with replay(rng_g), torch.set_grad_enabled(build_g):
        h_g = extra.call(roles.g, z1)
    h_g_value = _detached(h_g)
    with torch.no_grad():
        x2 = coupling.inverse(y2, h_g_value)
    del y2

    dys = yield None
    dy1, dy2 = dys
    _consume((), dys)  # dy1 dies once added into dz1
    # A gradient of None means "this output was not used": like plain autograd, the
    # functions that only feed it then get no gradient (None, not zeros).
    dx2: Tensor | None = None
    grads: list[Tensor | None] = [None] * (n_params + len(extra_wrt))
    dz1 = dy1
    if dy2 is not None:
        dx2, dh_g = coupling.vjp(x2, h_g_value, dy2)
        del dy2
        dz1_g, *grads = autograd_grads([h_g], [z1, *params, *extra_wrt], [dh_g])
        del dh_g
        dz1 = dz1_g if dy1 is None else _add(dy1, dz1_g)
        del dz1_g
    del h_g, h_g_value, dy1

    build_f = dz1 is not None
    x2 = x2.detach().requires_grad_(need_input_grad and build_f)
    with replay(rng_f), torch.set_grad_enabled(build_f):
        h_f = extra.call(roles.f, x2)
    h_f_value = _detached(h_f)
    with torch.no_grad():  # z1 as it is: no graph is built here, and a detach is one more op
        x1 = coupling.inverse(z1, h_f_value)
    if x1.requires_grad:  # an inverse that returned z1 itself, or turned grad mode back on
        x1 = x1.detach()
    del y1, z1  # G's graph is gone: nothing reads the output half any more

    # The rebuilt x2 as the layer below sees it: without F's graph (one detach, for both uses).
    x2_out = x2.detach() if x2.requires_grad else x2
    yield (x1, x2_out)
    dx1: Tensor | None = None
    if build_f:
        dx1, dh_f = coupling.vjp(x1, h_f_value, dz1)  # type: ignore[arg-type]
        f_inputs = [x2, *params, *extra_wrt] if need_input_grad else [*params, *extra_wrt]
        f_grads = autograd_grads([h_f], f_inputs, [dh_f])
        if need_input_grad:
            dx2_f = f_grads.pop(0)
            dx2 = dx2_f if dx2 is None else _add(dx2, dx2_f)
        grads = [_sum(a, b) for a, b in zip(grads, f_grads)]
    extra_grads = route_extra_grads(extra, grads[n_params:])
    return StepResult((x1, x2_out), (dx1, dx2), grads[:n_params], extra_grads)


def _explain_call_error(fn: nn.Module, fn_name: str, inp: Tensor, extra: ExtraArgs, err: Exception) -> None:
    """Raise a clear error for the usual reasons ``F``/``G`` fails on its input; else return."""
    tensors = [t for t in (*fn.parameters(), *fn.buffers()) if t.is_floating_point()]
    dtypes = {t.dtype for t in tensors}
    devices = {t.device for t in tensors}
    autocast = torch.is_autocast_enabled(inp.device.type) if inp.device.type in ("cpu", "cuda") else False
    if dtypes and inp.dtype not in dtypes and not autocast:
        have = ", ".join(sorted(str(d).removeprefix("torch.") for d in dtypes))
        raise ReversibilityError(
            f"{fn_name} has {have} parameters but the block's input is "
            f"{str(inp.dtype).removeprefix('torch.')}: convert one to the other "
            f"(model.to(torch.{str(inp.dtype).removeprefix('torch.')}) or "
            f"x.to(torch.{sorted(str(d).removeprefix('torch.') for d in dtypes)[0]}))"
        ) from err
    if devices and inp.device not in devices:
        raise ReversibilityError(
            f"{fn_name} lives on {', '.join(sorted(map(str, devices)))} but the block's input is on "
            f"{inp.device}: move both to one device (model.to(x.device))"
        ) from err
    if isinstance(err, TypeError) and extra and "positional argument" in str(err):
        raise ReversibilityError(
            f"{fn_name} does not take the extra arguments the block was called with "
            f"({len(extra.args)} positional, {len(extra.kwargs or {})} keyword): a block passes "
            f"everything after its input on to F and G. Give {fn_name}.forward those parameters, "
            "or call a block on a pair as block((x1, x2)), not block(x1, x2)"
        ) from err


def _consume(ys: Sequence[Tensor], dys: Sequence[Tensor | None]) -> None:
    """Empty the caller's state lists (M-mode's backward passes lists it no longer reads)."""
    for items in (ys, dys):
        if isinstance(items, list):
            items.clear()


def _detached(h: FOut) -> FOut:
    return tuple(t.detach() for t in h) if isinstance(h, tuple) else h.detach()


def _add(a: Tensor, b: Tensor | None) -> Tensor:
    return a if b is None else a + b


def _sum(a: Tensor | None, b: Tensor | None) -> Tensor | None:
    if a is None:
        return b
    return a if b is None else a + b
