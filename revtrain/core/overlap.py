"""PaReprop-style overlap: rebuild the block below while this block computes its gradients.

Algorithm 1 runs unchanged (:meth:`ReversibleBlock.step_reverse`); the overlap hooks into it at
two points. Step 1 of block ``i-1`` (``G`` forward, ``x2`` rebuilt: :meth:`~ReversibleBlock.
rebuild_top`) needs only block ``i``'s rebuilt input, so ``on_input`` starts it as soon as block
``i`` has rebuilt its input, while block ``i`` goes on with ``F``'s backward (PaReprop, Zhao et
al., 2023); block ``i-1`` then takes it as ``top``. On CUDA step 1 goes to a side stream; on a CPU
the side stream is a no-op, which lets CPU tests prove the reordered schedule gives identical
results. The cost: ``G``'s graph of block ``i-1`` is alive during block ``i``'s ``F`` backward.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import Tensor

from revtrain.core.step import State, StepResult

__all__ = ["SideStream", "reverse_overlapped", "supports_overlap"]

_side_streams: dict[torch.device, Any] = {}


def supports_overlap(layers: Sequence[Any]) -> bool:
    """Whether every layer of a run can have its step 1 done ahead (coupling blocks can)."""
    return all(callable(getattr(layer, "rebuild_top", None)) for layer in layers)


class SideStream:
    """A second CUDA stream for the rebuild ahead; a no-op elsewhere."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        if self.cuda:
            self.main = torch.cuda.current_stream(device)
            stream = _side_streams.get(device)
            if stream is None:
                stream = _side_streams[device] = torch.cuda.Stream(device)
            self.stream = stream

    @contextlib.contextmanager
    def side(self) -> Iterator[None]:
        """Run the body on the side stream, after everything queued on the main stream."""
        if not self.cuda:
            yield
            return
        self.stream.wait_stream(self.main)
        with torch.cuda.stream(self.stream):
            yield

    def join(self) -> None:
        """Make the main stream wait for the side stream's work."""
        if self.cuda:
            self.main.wait_stream(self.stream)


def reverse_overlapped(
    n: int,
    step: Callable[..., StepResult],
    rebuild_top: Callable[[int, State], Any],
    as_in_forward: Callable[[int], Any],
    state: list[Tensor],
    grad_state: list[Tensor | None],
    on_result: Callable[[int, StepResult], None],
) -> tuple[list[Tensor], list[Tensor | None]]:
    """Reverse layers ``n-1 … 0``, step 1 of layer ``i-1`` overlapping the end of layer ``i``.

    ``step(i, ys, dys, top=..., on_input=...)`` is layer ``i``'s reverse step with the two hooks;
    ``rebuild_top(i, ys)`` its step 1 alone; each runs under ``as_in_forward(i)``; ``on_result``
    gets each layer's result, top down. Returns the bottom layer's input state and gradient.
    """
    side = SideStream(state[0].device)
    top = None
    for i in reversed(range(n)):
        ahead: list[Any] = []

        def on_input(xs: State, below: int = i - 1) -> None:
            if below >= 0:  # the rebuild of the layer below ...
                with side.side(), as_in_forward(below):
                    ahead.append(rebuild_top(below, xs))

        with as_in_forward(i):  # ... while this layer computes its gradients
            result = step(i, state, grad_state, top=top, on_input=on_input)
        top = None
        on_result(i, result)
        side.join()
        state, grad_state = list(result.inputs), list(result.grad_inputs)
        del result
        top = ahead.pop() if ahead else None
    return state, grad_state
