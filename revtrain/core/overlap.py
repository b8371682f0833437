"""PaReprop-style overlap: rebuild the block below while this block computes its gradients.

Algorithm 1 in *phases* (:meth:`ReversibleBlock.reverse_phases`): (1) ``G`` forward and ``x2``
rebuilt, (2) ``G``'s backward, ``F`` forward and ``x1`` rebuilt, (3) ``F``'s backward. Phase 1 of
block ``i-1`` needs only block ``i``'s rebuilt input, so it can run while phase 3 of block ``i``
runs (PaReprop, Zhao et al., 2023). On CUDA phase 1 goes to a side stream; on a CPU the side
stream is a no-op, which lets CPU tests prove the reordered schedule gives identical results.
The cost: ``G``'s graph of block ``i-1`` is alive during block ``i``'s ``F`` backward.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Generator, Iterator, Sequence
from typing import Any

import torch
from torch import Tensor

from revtrain.core.step import StepResult

__all__ = ["SideStream", "finish_phases", "reverse_overlapped", "supports_phases"]

_side_streams: dict[torch.device, Any] = {}


def finish_phases(phases: Generator[Any, Any, StepResult]) -> StepResult:
    """Run the last phase of a phased reverse step and return its result."""
    try:
        phases.send(None)
    except StopIteration as stop:
        return stop.value
    raise RuntimeError("a phased reverse step yielded more than twice")


def supports_phases(layers: Sequence[Any]) -> bool:
    """Whether every layer of a run can reverse in phases."""
    return all(callable(getattr(layer, "reverse_phases", None)) for layer in layers)


class SideStream:
    """A second CUDA stream for the rebuild phase; a no-op elsewhere."""

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
    start: Callable[[int, list[Tensor]], Generator[Any, Any, StepResult]],
    as_in_forward: Callable[[int], Any],
    state: list[Tensor],
    grad_state: list[Tensor | None],
    on_result: Callable[[int, StepResult], None],
) -> StepResult:
    """Reverse layers ``n-1 … 0`` with phase 1 of layer ``i-1`` overlapping phase 3 of layer ``i``.

    ``start(i, ys)`` gives layer ``i``'s phases for output state ``ys``; each phase runs under
    ``as_in_forward(i)``; ``on_result`` gets each layer's result, top down. Returns the bottom
    layer's result.
    """
    side = SideStream(state[0].device)
    i = n - 1
    phases = start(i, state)
    with as_in_forward(i):
        next(phases)
        inputs = phases.send(grad_state)
    del state, grad_state
    while True:
        lower = None
        if i > 0:
            with side.side(), as_in_forward(i - 1):  # the rebuild of the layer below ...
                lower = start(i - 1, list(inputs))
                next(lower)
        del inputs
        with as_in_forward(i):  # ... while this layer computes its gradients
            result = finish_phases(phases)
        on_result(i, result)
        if lower is None:
            return result
        side.join()
        grads = list(result.grad_inputs)
        del result
        phases, i = lower, i - 1
        with as_in_forward(i):
            inputs = phases.send(grads)
        del grads
