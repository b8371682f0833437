"""``ReversibleBlock``: one RevNet/MemCNN coupling block with a memory mode."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal, NamedTuple

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
from revtrain.core.invertible import (
    MODES,
    InverseStep,
    Invertible,
    Mode,
    normalize_mode,
    replay,
    route_extra_grads,
)
from revtrain.core.replay import RngState
from revtrain.core.step import Grads, State, StepResult, add_grads, autograd_grads
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


class _Roles(NamedTuple):
    """Who plays ``F`` and ``G`` with which coupling: the block itself, or its inverse (whose
    "F" is the block's ``G`` and whose coupling is the block's coupling inverted)."""

    f: nn.Module
    g: nn.Module
    f_name: str
    g_name: str
    coupling: Coupling


class ReversibleBlock(Invertible):
    """A reversible coupling block ``y1 = c(x1, F(x2)), y2 = c(x2, G(y1))``.

    Its mode decides what backward costs: ``"M"`` keeps no input and rebuilds it in backward
    (RevNet's Algorithm 1, :func:`_couple_reverse`; chained M-mode blocks keep only their last
    output, in any container); ``"C"`` is plain autograd.

    Args:
        f: Module applied to the second half; its output is coupled into the first half.
        g: Module applied to the new first half; its output is coupled into the second half.
        coupling: ``"additive"`` (``y = x + h``), ``"affine"`` (``y = x * exp(s) + t``),
            ``"exact"`` (additive on a fixed-point grid: bit-exact rebuilds, see
            :class:`~revtrain.core.ExactAdditiveCoupling`), or a
            :class:`~revtrain.core.Coupling` instance.
        split_dim: Dimension along which a single input tensor is split in halves.
        mode: ``"M"`` or ``"C"``; can be changed any time through ``block.mode``.
        preserve_rng_state: Capture the random generators before ``F`` and ``G`` and replay
            them in the rebuild (only for the one that drew), so dropout rebuilds exactly. Pass
            False where ``F`` and ``G`` draw no random numbers: the captures then go too.
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
        super().__init__(mode, preserve_rng_state=preserve_rng_state, check_reconstruction=check_reconstruction,
                         drift_tolerance=drift_tolerance, drift_action=drift_action, check_every=check_every)
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
        return _Roles(self.f, self.g, "F", "G", self.coupling)

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
        return _couple_forward(self, self.roles, xs[0], xs[1], extra, rng=self.preserve_rng_state)

    def step_reverse(
        self,
        ys: State,
        dys: Grads,
        record: Any,
        params: Sequence[Tensor],
        need_input_grad: bool,
        extra: ExtraArgs = NO_ARGS,
        *,
        top: tuple[Tensor, FOut, Tensor] | None = None,
        on_input: Callable[[State], None] | None = None,
    ) -> StepResult:
        """Algorithm 1 (:func:`_couple_reverse`); ``top`` and ``on_input`` are the overlap's
        hooks (``core/overlap.py``)."""
        return _couple_reverse(self.roles, ys, dys, record, params, need_input_grad, extra, top, on_input)

    def rebuild_top(self, ys: State, record: Any, extra: ExtraArgs = NO_ARGS) -> tuple[Tensor, FOut, Tensor]:
        """Step 1 of :meth:`step_reverse` alone (rebuild ``x2``, keeping ``G``'s graph), for
        ``core/overlap.py``, which passes its result back as ``step_reverse(..., top=...)``."""
        rng_g = record.rng_g if isinstance(record, _CouplingRecord) else None
        return _rebuild_half(self.g, self.coupling, ys[0], ys[1], rng_g, extra, True, True)


class _BlockInverse(InverseStep):
    """A block's inverse as a reversible step: the block with ``F``/``G`` swapped, its
    coupling inverted and its halves swapped, so the rebuild is Algorithm 1 too."""

    module: ReversibleBlock
    output_names = ((1, "G"), (0, "F"))

    def step_forward(self, ys: State, extra: ExtraArgs = NO_ARGS) -> tuple[State, Any]:
        block = self.module
        (x2, x1), record = _couple_forward(block, block.inverse_roles, ys[1], ys[0], extra, rng=block.preserve_rng_state)
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
        # Replay only what drew random numbers (a replay costs more than these comparisons);
        # one comparison where neither drew.
        after = RngState.capture(x1.device)
        if rng_f.same_as(after):
            rng_f = rng_g = None
        else:
            rng_f, rng_g = (None if rng_f.same_as(rng_g) else rng_f), (None if rng_g.same_as(after) else rng_g)
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
    top: tuple[Tensor, FOut, Tensor] | None = None,
    on_input: Callable[[State], None] | None = None,
) -> StepResult:
    """RevNet's Algorithm 1: from the output ``(y1, y2)`` and its gradient ``(dy1, dy2)`` back
    to the input ``(x1, x2)``, its gradient and the parameter gradients.

    Two hooks for the overlap (``core/overlap.py``): ``top``, step 1 already done
    (:meth:`ReversibleBlock.rebuild_top`); ``on_input``, called with the rebuilt input before
    ``F``'s backward.

    ``G`` and ``F`` run once each, building the graph that their backward then reuses: about
    4N for the block (forward N, rebuild N, backward 2N), never "rebuild, then run the forward
    again". A gradient of None means "this output was not used": like plain autograd, the
    functions that only feed it then get no gradient.
    """
    rng_f, rng_g = (record.rng_f, record.rng_g) if isinstance(record, _CouplingRecord) else (None, None)
    y1, y2 = ys
    dy1, dy2 = dys
    _consume(ys, dys)  # from here on, each tensor dies as soon as this function is done with it
    params = list(params)
    wrt = [*params, *(t for t in extra.tensors if t.requires_grad)]

    # 1. x2 = c⁻¹(y2, G(y1)), keeping G's graph (z1 is y1 as G's input).
    z1, h_g, x2 = top or _rebuild_half(roles.g, roles.coupling, y1, y2, rng_g, extra, dy2 is not None, True)
    del top
    del y2
    # 2. Backward through G and the coupling: dx2 so far, and dz1 = dy1 + dG/dz1ᵀ dh_g.
    dx2, dz1, grads = _backprop_half(roles.coupling, z1, h_g, x2, dy2, dy1, wrt, True)
    del dy1, dy2, h_g
    # 3. x1 = c⁻¹(y1, F(x2)), keeping F's graph (x2 requires grad where its gradient is needed).
    build_f = dz1 is not None
    x2, h_f, x1 = _rebuild_half(roles.f, roles.coupling, x2, z1, rng_f, extra, build_f, need_input_grad and build_f)
    del y1, z1
    x2_out = x2.detach() if x2.requires_grad else x2
    if on_input is not None:
        on_input((x1, x2_out))
    # 4. Backward through F and the coupling: dx1, and dx2 += dF/dx2ᵀ dh_f.
    dx1, dx2_f, f_grads = _backprop_half(roles.coupling, x2, h_f, x1, dz1, None, wrt, need_input_grad)
    grads = [add_grads(a, b) for a, b in zip(grads, f_grads)]
    n = len(params)
    return StepResult((x1, x2_out), (dx1, add_grads(dx2, dx2_f)), grads[:n], route_extra_grads(extra, grads[n:]))


def _rebuild_half(
    fn: nn.Module, coupling: Coupling, inp: Tensor, out: Tensor, rng: RngState | None, extra: ExtraArgs,
    graph: bool, input_grad: bool,
) -> tuple[Tensor, FOut, Tensor]:
    """One rebuild of Algorithm 1: ``h = fn(inp)`` (with its graph when ``graph``, replaying the
    forward's random numbers) and the half ``x = c⁻¹(out, h)``. Returns ``(inp as fn's input,
    h, x)``; ``x`` carries no graph."""
    inp = inp.detach().requires_grad_(input_grad and graph)
    with replay(rng), torch.set_grad_enabled(graph):
        h = extra.call(fn, inp)
    x = coupling.inverse(out.detach(), _detached(h))  # detached inputs: no graph, no no_grad()
    return inp, h, (x.detach() if x.requires_grad else x)


def _backprop_half(
    coupling: Coupling, inp: Tensor, h: FOut, x: Tensor, dy: Tensor | None, d_inp: Tensor | None,
    wrt: list[Tensor], input_grad: bool,
) -> tuple[Tensor | None, Tensor | None, list[Tensor | None]]:
    """The backward of one half of Algorithm 1: ``dy`` (the gradient of ``y = c(x, h)``) through
    the coupling and through ``fn``'s graph. Returns ``(dx, d_inp, grads of wrt)``, ``d_inp``
    added to the gradient that already reached ``fn``'s input."""
    if dy is None:
        return None, d_inp, [None] * len(wrt)
    dx, dh = coupling.vjp(x, _detached(h), dy)
    del dy
    grads = autograd_grads([h], [inp, *wrt] if input_grad else wrt, [dh])
    d_fn = grads.pop(0) if input_grad else None
    return dx, add_grads(d_inp, d_fn), grads


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
