"""Measure what each unit costs in a PETRA stage, to balance the stages.

The planner times reversible blocks in M- against C-mode; a stage split needs something else:
for *every* unit (stem, downsampling units, blocks, head) the time of a no-grad forward, of
PETRA's backward (a reversible unit rebuilds its input from its output while building its
graph, then backpropagates: :func:`revtrain.core.reverse_step`; any other unit recomputes its
forward from a kept input, then backpropagates), and of a plain forward + backward (what the
last stage runs). Each unit runs on its real input, taken from one forward of the whole chain.

On CPU the clock is the process's CPU time: what a unit costs in compute, not how long it
waited for a core that another process held (the balance stays right on a busy machine). On
CUDA it is wall time with the device synchronised.

The model is left as it was: parameters, gradients, batch-norm statistics and the random
generators are restored.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from revtrain.core import reverse_step
from revtrain.parallel.units import Unit

__all__ = ["UnitCost", "time_units"]


@dataclass(frozen=True)
class UnitCost:
    """Median seconds of one unit on the measured batch (CPU time on CPU)."""

    name: str
    forward_s: float
    """Forward without a graph (what a stage's forward runs)."""
    petra_backward_s: float
    """Rebuild or recompute, then backward (what a stage's backward runs)."""
    plain_s: float
    """Forward with a graph plus backward (what the last stage runs)."""

    @property
    def stage_cost(self) -> float:
        """Cost in a stage other than the last: forward plus PETRA backward."""
        return self.forward_s + self.petra_backward_s


def time_units(units: Sequence[Unit], sample: Tensor, *, repeats: int = 3, warmup: int = 1) -> list[UnitCost]:
    """Median forward, PETRA-backward and plain times of every unit on the batch ``sample``."""
    modules = [u.module for u in units]
    snapshot = [{k: v.clone() for k, v in m.state_dict().items()} for m in modules]
    grads = [[(p, p.grad) for p in m.parameters()] for m in modules]
    with torch.random.fork_rng(devices=[]):
        inputs: list[Tensor] = []
        with torch.no_grad():
            x = sample
            for m in modules:
                inputs.append(x)
                x = m(x)
        costs = []
        for unit, x in zip(units, inputs):
            m = unit.module
            with torch.no_grad():
                y = m(x)
            dy = torch.randn_like(y)

            def fwd(m=m, x=x) -> None:
                with torch.no_grad():
                    m(x)

            def plain(m=m, x=x, dy=dy) -> None:
                xr = x.detach().requires_grad_(x.is_floating_point())
                torch.autograd.backward(m(xr), dy)

            if unit.reversible:
                def petra(m=m, y=y, dy=dy) -> None:
                    reverse_step(m, y, dy, update_running_stats=True)
            else:
                petra = plain
            clock = _clock(sample.device)
            costs.append(UnitCost(unit.name, _median(fwd, repeats, warmup, clock),
                                  _median(petra, repeats, warmup, clock), _median(plain, repeats, warmup, clock)))
    for m, state in zip(modules, snapshot):
        m.load_state_dict(state)
    for pairs in grads:
        for p, g in pairs:
            p.grad = g
    return costs


def _clock(device: torch.device) -> Callable[[], float]:
    if device.type != "cuda":
        return time.process_time

    def synced() -> float:
        torch.cuda.synchronize(device)
        return time.perf_counter()

    return synced


def _median(fn: Callable[[], None], repeats: int, warmup: int, clock: Callable[[], float]) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(max(1, repeats)):
        start = clock()
        fn()
        times.append(clock() - start)
    return statistics.median(times)
