"""The autograd function behind M-mode: RevNet Algorithm 1 over a run of blocks.

One :class:`_MModeRun` covers a run of consecutive M-mode blocks. Its forward runs them
without building a graph and saves only the run's output. Its backward walks the blocks in
reverse; for each block it runs ``G`` once on the output half ``y1`` (building ``G``'s graph),
rebuilds ``x2``, backpropagates through ``G``, then runs ``F`` once on the rebuilt ``x2``
(building ``F``'s graph), rebuilds ``x1`` and backpropagates through ``F``. So backward costs
one extra forward of ``F`` and ``G`` (about 4N in all, against 3N for plain autograd), never
the 5N of "rebuild, then run the forward again".

Nothing outlives a step: everything the backward needs lives on ``ctx``; the rebuilt input of
a block is the output of the block below and dies as soon as that block is done.
"""

from __future__ import annotations

import contextlib
import math
import warnings
from dataclasses import dataclass

import torch
from torch import Tensor

from revtrain.core.block import ReversibleBlock
from revtrain.core.coupling import FOut
from revtrain.core.replay import AutocastState, RngState, frozen_running_stats
from revtrain.errors import ReconstructionDriftWarning, ReconstructionError, ReversibilityError

__all__ = ["run_m_mode", "check_pair"]


def check_pair(x1: Tensor, x2: Tensor) -> None:
    """Raise a clear error when the halves cannot be coupled."""
    if x1.device != x2.device or x1.dtype != x2.dtype:
        raise ReversibilityError(
            f"the two halves differ: x1 is {x1.dtype} on {x1.device}, x2 is {x2.dtype} on "
            f"{x2.device}; move both to one device and dtype (e.g. x2 = x2.to(x1)) before the block"
        )


@dataclass
class _BlockRecord:
    """What the forward leaves for one block's backward: generator states and input norms."""

    rng_f: RngState | None
    rng_g: RngState | None
    norms: tuple[Tensor, Tensor] | None
    f_params: list[Tensor]
    g_params: list[Tensor]


def _norms(x1: Tensor, x2: Tensor) -> tuple[Tensor, Tensor]:
    """Norms of the halves: reduced in their own precision (float32 at least), no upcast copy."""

    def norm(x: Tensor) -> Tensor:
        low = x.dtype in (torch.float16, torch.bfloat16)
        return torch.linalg.vector_norm(x.detach(), dtype=torch.float32 if low else None)

    return norm(x1), norm(x2)


def _trainable(module: torch.nn.Module) -> list[Tensor]:
    return [p for p in module.parameters() if p.requires_grad]


def _grad(outputs: FOut, inputs: list[Tensor], grad_outputs: FOut) -> list[Tensor | None]:
    """``torch.autograd.grad`` over tuples, casting each gradient to its output's dtype."""
    outs = outputs if isinstance(outputs, tuple) else (outputs,)
    douts = grad_outputs if isinstance(grad_outputs, tuple) else (grad_outputs,)
    pairs = [(o, d.to(o.dtype)) for o, d in zip(outs, douts) if o.requires_grad]
    if not pairs or not inputs:
        return [None] * len(inputs)
    return list(
        torch.autograd.grad(
            [o for o, _ in pairs], inputs, [d for _, d in pairs], allow_unused=True
        )
    )


def _detached(h: FOut) -> FOut:
    return tuple(t.detach() for t in h) if isinstance(h, tuple) else h.detach()


def _add(a: Tensor, b: Tensor | None) -> Tensor:
    return a if b is None else a + b


class _MModeRun(torch.autograd.Function):
    """Forward: a run of M-mode blocks without a graph. Backward: Algorithm 1, block by block."""

    @staticmethod
    def forward(ctx, blocks, concat_dim, param_lists, x1, x2, *params):  # type: ignore[override]
        device = x1.device
        records: list[_BlockRecord] = []
        for block, (f_params, g_params) in zip(blocks, param_lists):
            rng_f = RngState.capture(device) if block.preserve_rng_state else None
            norms = _norms(x1, x2) if block.check_reconstruction else None
            y1 = block.coupling.forward(x1, block._apply_fn(block.f, "F", x2, x1))
            rng_g = RngState.capture(device) if block.preserve_rng_state else None
            y2 = block.coupling.forward(x2, block._apply_fn(block.g, "G", y1, x2))
            records.append(_BlockRecord(rng_f, rng_g, norms, f_params, g_params))
            x1, x2 = y1, y2
        ctx.blocks = blocks
        ctx.records = records
        ctx.concat_dim = concat_dim
        ctx.autocast = AutocastState.capture(device)
        ctx.set_materialize_grads(False)
        if concat_dim is None:
            ctx.save_for_backward(x1, x2)
            return x1, x2
        y = torch.cat([x1, x2], dim=concat_dim)
        ctx.save_for_backward(y)
        return y

    @staticmethod
    def backward(ctx, *grads):  # type: ignore[override]
        if torch.is_grad_enabled():  # autograd enables grad mode in backward only for create_graph
            raise ReconstructionError(
                "double backward (create_graph=True) through M-mode reversible blocks is not "
                "supported; run those blocks in C-mode (revtrain.set_modes(model, 'C')) when you "
                "need higher-order gradients"
            )
        try:
            saved = ctx.saved_tensors
        except RuntimeError as err:
            if "inplace" not in str(err):
                raise
            raise ReconstructionError(
                "the output of an M-mode reversible block was modified in place before backward, "
                "so its input can no longer be rebuilt; use an out-of-place op on the block's "
                "output (e.g. torch.relu(y) instead of y.relu_(), or nn.ReLU(inplace=False) right "
                "after the block), or run that block in C-mode"
            ) from err
        if ctx.concat_dim is None:
            y1, y2 = (t.detach() for t in saved)
            dy1, dy2 = grads
        else:
            y1, y2 = saved[0].detach().chunk(2, dim=ctx.concat_dim)
            dy1, dy2 = (None, None) if grads[0] is None else grads[0].chunk(2, dim=ctx.concat_dim)

        blocks: tuple[ReversibleBlock, ...] = ctx.blocks
        n = len(blocks)
        param_grads: list[list[Tensor | None]] = [[] for _ in range(n)]
        rebuilt_norms: list[tuple[int, tuple[Tensor, Tensor]]] = []
        # Backward runs with grad mode off; the rebuild needs graphs of F and G.
        with torch.enable_grad(), ctx.autocast.context():
            for i in reversed(range(n)):
                block, record = blocks[i], ctx.records[i]
                need_dx2 = i > 0 or ctx.needs_input_grad[4]
                # Restored only after the gradients: batch norm's graph saves its running stats.
                with frozen_running_stats([block]):
                    x1, x2, dy1, dy2, grads_fg = _block_backward(
                        block, record, y1, y2, dy1, dy2, need_dx2
                    )
                param_grads[i] = grads_fg
                if record.norms is not None:
                    rebuilt_norms.append((i, _norms(x1, x2)))
                y1, y2 = x1, x2
        if rebuilt_norms:
            _check_rebuilds(blocks, ctx.records, rebuilt_norms)
        dx1 = dy1 if ctx.needs_input_grad[3] else None
        dx2 = dy2 if ctx.needs_input_grad[4] else None

        flat = [g for block_grads in param_grads for g in block_grads]
        return (None, None, None, dx1, dx2, *flat)


def _block_backward(
    block: ReversibleBlock,
    record: _BlockRecord,
    y1: Tensor,
    y2: Tensor,
    dy1: Tensor | None,
    dy2: Tensor | None,
    need_dx2: bool,
) -> tuple[Tensor, Tensor, Tensor | None, Tensor | None, list[Tensor | None]]:
    """Rebuild one block's input from its output and backpropagate through it."""
    coupling = block.coupling
    f_params, g_params = record.f_params, record.g_params
    # A gradient of None means "this output was not used": like plain autograd, the functions
    # that only feed it then get no gradient (None, not zeros), and their graph is not built.
    # G: one run on y1 builds its graph; rebuild x2 and backpropagate dy2 through G.
    z1 = y1.detach().requires_grad_(dy2 is not None)
    with _replay(record.rng_g), torch.set_grad_enabled(dy2 is not None):
        h_g = block.g(z1)
    h_g_value = _detached(h_g)
    with torch.no_grad():
        x2 = coupling.inverse(y2, h_g_value)
    dx2: Tensor | None = None
    g_grads: list[Tensor | None] = [None] * len(g_params)
    dz1 = dy1
    if dy2 is not None:
        dx2, dh_g = coupling.vjp(x2, h_g_value, dy2)
        dz1_g, *g_grads = _grad(h_g, [z1, *g_params], dh_g)
        dz1 = dz1_g if dy1 is None else _add(dy1, dz1_g)
        del dh_g
    del h_g, h_g_value

    # F: one run on the rebuilt x2 builds its graph; rebuild x1 and backpropagate dz1 through F.
    build_f = dz1 is not None
    x2 = x2.detach().requires_grad_(need_dx2 and build_f)
    with _replay(record.rng_f), torch.set_grad_enabled(build_f):
        h_f = block.f(x2)
    h_f_value = _detached(h_f)
    with torch.no_grad():
        x1 = coupling.inverse(z1.detach(), h_f_value)
    dx1: Tensor | None = None
    f_grads: list[Tensor | None] = [None] * len(f_params)
    if build_f:
        dx1, dh_f = coupling.vjp(x1, h_f_value, dz1)
        f_inputs = [x2, *f_params] if need_dx2 else list(f_params)
        f_grads = _grad(h_f, f_inputs, dh_f)
        if need_dx2:
            dx2_f = f_grads.pop(0)
            dx2 = dx2_f if dx2 is None else _add(dx2, dx2_f)
    return x1, x2.detach(), dx1, dx2, [*f_grads, *g_grads]


def _replay(state: RngState | None) -> contextlib.AbstractContextManager[None]:
    return state.replay() if state is not None else contextlib.nullcontext()


def _check_rebuilds(
    blocks: tuple[ReversibleBlock, ...],
    records: list[_BlockRecord],
    rebuilt: list[tuple[int, tuple[Tensor, Tensor]]],
) -> None:
    """Compare rebuilt input norms with the forward's; one device sync for the whole run."""
    original = torch.stack([n for i, _ in rebuilt for n in records[i].norms])  # type: ignore[union-attr]
    now = torch.stack([n for _, pair in rebuilt for n in pair])
    values = torch.stack([original, now]).tolist()
    for k, (i, _) in enumerate(rebuilt):
        block = blocks[i]
        where = f"block {i} of a run of {len(blocks)} M-mode blocks ({block.extra_repr()})"
        for half in range(2):
            before, after = values[0][2 * k + half], values[1][2 * k + half]
            if not math.isfinite(before):
                continue  # the forward itself was not finite; the loss shows that already
            if not math.isfinite(after):
                raise ReconstructionError(
                    f"rebuilding the input of {where} produced non-finite values (half x{half + 1})"
                    " although the forward input was finite: the inverse overflowed or divided by "
                    "~0. Run this block in C-mode (block.mode = 'C'), use a bounded coupling "
                    "scale, a smaller learning rate, or check it with revtrain.verify_invertible"
                )
            drift = abs(after - before) / max(before, 1e-30)
            if drift > block.drift_tolerance:
                message = (
                    f"the rebuilt input of {where} drifted from the forward's by {drift:.2e} "
                    f"(relative norm, half x{half + 1}) > drift_tolerance={block.drift_tolerance:g}; "
                    "gradients may be inaccurate. Use float64, fewer consecutive M-mode blocks, or "
                    "C-mode for this block; raise drift_tolerance to accept it"
                )
                if block.drift_action == "raise":
                    raise ReconstructionError(message)
                warnings.warn(message, ReconstructionDriftWarning, stacklevel=2)


def run_m_mode(
    blocks: tuple[ReversibleBlock, ...], x1: Tensor, x2: Tensor, concat_dim: int | None
) -> Tensor | tuple[Tensor, Tensor]:
    """Run consecutive M-mode blocks; return a pair, or the halves concatenated on ``concat_dim``."""
    # Parameters are inputs of the function so that autograd routes their gradients; the
    # lists are collected once here and reused by backward.
    param_lists = tuple((_trainable(block.f), _trainable(block.g)) for block in blocks)
    params = [p for f_params, g_params in param_lists for p in (*f_params, *g_params)]
    return _MModeRun.apply(blocks, concat_dim, param_lists, x1, x2, *params)
