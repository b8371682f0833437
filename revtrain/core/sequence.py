"""``ReversibleSequence``: a stack of reversible blocks whose M-mode runs keep one output."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from revtrain.core.arguments import NO_ARGS, ExtraArgs
from revtrain.core.block import ReversibleBlock
from revtrain.core.function import check_state, run_reversible
from revtrain.core.step import Grads, State, StepResult, add_grads

__all__ = ["ReversibleSequence"]


class ReversibleSequence(nn.Module):
    """Reversible blocks applied in order, with each block's mode respected.

    Consecutive M-mode blocks run as one autograd function that keeps only the last output, so
    an all-M stack's activation memory does not grow with depth; C-mode blocks run as ordinary
    layers. Call it like a block (one tensor or a pair, further arguments to every ``F`` and
    ``G``). It is a reversible step itself, so :func:`~revtrain.core.reverse_step` can run all
    its blocks at once (PETRA).

    Args:
        *blocks: ``ReversibleBlock`` instances, or one iterable of them, sharing ``split_dim``.
        overlap_rebuild: Rebuild block ``i-1`` while block ``i`` computes its gradients, on a
            second CUDA stream (``core/overlap.py``; no gain on a CPU). Same gradients.
    """

    check_reconstruction = False  # each block checks its own rebuild
    drift_tolerance = float("inf")
    drift_action = "warn"

    def __init__(self, *blocks: ReversibleBlock | Iterable[ReversibleBlock], overlap_rebuild: bool = False) -> None:
        super().__init__()
        self.overlap_rebuild = bool(overlap_rebuild)
        if len(blocks) == 1 and not isinstance(blocks[0], nn.Module):
            blocks = tuple(blocks[0])  # type: ignore[arg-type]
        if not blocks:
            raise ValueError("ReversibleSequence needs at least one ReversibleBlock")
        for i, block in enumerate(blocks):
            if not isinstance(block, ReversibleBlock):
                raise TypeError(
                    f"ReversibleSequence holds only ReversibleBlock instances; item {i} is a "
                    f"{type(block).__name__}. Put ordinary layers around the sequence in an "
                    "nn.Sequential instead"
                )
        split_dims = {block.split_dim for block in blocks}  # type: ignore[union-attr]
        if len(split_dims) != 1:
            raise ValueError(f"all blocks of a ReversibleSequence must share split_dim; got {split_dims}")
        self.blocks = nn.ModuleList(blocks)  # type: ignore[arg-type]
        self.split_dim = split_dims.pop()

    def __len__(self) -> int:
        return len(self.blocks)

    def __iter__(self) -> Iterator[ReversibleBlock]:
        return iter(self.blocks)  # type: ignore[arg-type]

    def __getitem__(self, index: int) -> ReversibleBlock:
        return self.blocks[index]  # type: ignore[return-value]

    def forward(self, x: Any, *args: Any, **kwargs: Any) -> Any:
        """Run the blocks on ``x`` (one tensor, or a pair ``(x1, x2)``); further arguments go to
        every block's ``F`` and ``G``."""
        return self._run(x, args, kwargs, inverse=False)

    def inverse(self, y: Any, *args: Any, **kwargs: Any) -> Any:
        """Rebuild the input from the output, block by block in reverse; M-mode blocks keep
        only their last output here too (see ``ReversibleBlock.inverse``)."""
        return self._run(y, args, kwargs, inverse=True)

    def _run(self, value: Any, args: tuple, kwargs: dict, *, inverse: bool) -> Any:
        pair = isinstance(value, (tuple, list))
        xs = self.to_state(value)
        check_state(xs)
        extra = ExtraArgs.of(args, kwargs)
        blocks: list[ReversibleBlock] = list(self.blocks)  # type: ignore[arg-type]
        if inverse:
            blocks.reverse()
        grad = torch.is_grad_enabled()
        source: Any = value
        i, n = 0, len(blocks)
        while i < n:
            if not (grad and blocks[i].mode == "M"):
                step = blocks[i].inverse if inverse else blocks[i]
                source = xs = step(tuple(xs), *args, **kwargs)
                i += 1
                continue
            j = i
            while j < n and blocks[j].mode == "M":
                j += 1
            xs, source = blocks[i].coupling.prepare_input(tuple(xs), source)
            steps = [b.inverse_step() if inverse else b for b in blocks[i:j]]
            if j == n and not pair:
                # The last run concatenates inside the function: one saved copy of the output.
                out = run_reversible(steps, xs, self.split_dim, extra, source, self.overlap_rebuild)
                blocks[j - 1].coupling.mark_output(out)
                return out
            source = run_reversible(steps, xs, None, extra, source, self.overlap_rebuild)
            blocks[j - 1].coupling.mark_output(source)
            xs = source
            i = j
        if pair:
            return tuple(xs)
        out = torch.cat(list(xs), dim=self.split_dim)
        blocks[-1].coupling.mark_output(out)
        return out

    # -- the reversible step over all blocks (for revtrain.core.reverse_step) ------------------

    def step_params(self) -> list[Tensor]:
        seen: set[int] = set()
        out: list[Tensor] = []
        for block in self.blocks:
            for p in block.step_params():  # type: ignore[operator]
                if id(p) not in seen:
                    seen.add(id(p))
                    out.append(p)
        return out

    def step_forward(self, xs: State, extra: ExtraArgs = NO_ARGS) -> tuple[State, Any]:
        records = []
        for block in self.blocks:
            xs, record = block.step_forward(xs, extra)  # type: ignore[operator]
            records.append(record)
        return xs, records

    def step_reverse(
        self,
        ys: State,
        dys: Grads,
        record: Any,
        params: Sequence[Tensor],
        need_input_grad: bool,
        extra: ExtraArgs = NO_ARGS,
    ) -> StepResult:
        index = {id(p): k for k, p in enumerate(params)}
        grads: list[Tensor | None] = [None] * len(params)
        extra_grads: list[Tensor | None] = [None] * len(extra.tensors)
        blocks = list(self.blocks)
        for i in reversed(range(len(blocks))):
            block = blocks[i]
            block_params = block.step_params()  # type: ignore[operator]
            result = block.step_reverse(  # type: ignore[operator]
                ys, dys, record[i] if record is not None else None, block_params, i > 0 or need_input_grad, extra
            )
            for p, g in zip(block_params, result.param_grads):
                k = index[id(p)]
                if g is not None:
                    grads[k] = g if grads[k] is None else grads[k] + g  # type: ignore[operator]
            extra_grads = [add_grads(a, b) for a, b in zip(extra_grads, result.extra_grads)] if result.extra_grads else extra_grads
            ys, dys = result.inputs, result.grad_inputs
        return StepResult(ys, dys, grads, extra_grads)

    def to_state(self, value: Any) -> State:
        return self.blocks[0].to_state(value)  # type: ignore[operator]

    def from_state(self, state: State) -> Any:
        return torch.cat(list(state), dim=self.split_dim)

    def describe(self) -> str:
        return f"ReversibleSequence of {len(self.blocks)} blocks"
