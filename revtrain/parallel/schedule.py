"""PETRA's tick schedule: which mini-batch each stage runs forward and backward at each tick.

Time is counted in ticks. At tick ``t`` every stage runs one forward and one backward (when it
has them), then all stages exchange messages once: stage ``s`` sends its output to ``s + 1``
and its rebuilt input with its input gradient to ``s - 1``. So with J stages (0-based ``s``):

- stage ``s`` runs the **forward** of batch ``b`` at tick ``b + s``;
- the last stage runs loss and backward in the same tick as its forward, ``b + J - 1``;
- stage ``s`` runs the **backward** of batch ``b`` at tick ``b + 2(J - 1) - s``, that is
  ``2(J - 1 - s)`` ticks after its forward (SPEC §5, the authors' simulator).

An epoch of ``N`` batches takes ``N + 2(J - 1)`` ticks: the first ``2(J - 1)`` fill the pipeline
(warm-up), the last ones empty it (drain); in between every stage is busy with a forward and a
backward at every tick. Within a tick a stage runs its forward first, then its backward, both
with the parameters it holds at the start of the tick; an update (every ``k``-th backward)
happens after the backward (the paper's equations (5)).
"""

from __future__ import annotations

__all__ = [
    "forward_tick",
    "backward_tick",
    "delay",
    "num_ticks",
    "forward_batch",
    "backward_batch",
    "in_flight_after",
]


def forward_tick(stage: int, batch: int, num_stages: int) -> int:
    """Tick at which ``stage`` runs the forward of ``batch``."""
    return batch + stage


def backward_tick(stage: int, batch: int, num_stages: int) -> int:
    """Tick at which ``stage`` runs the backward of ``batch`` (the last stage: with its forward)."""
    return batch + 2 * (num_stages - 1) - stage


def delay(stage: int, num_stages: int) -> int:
    """Ticks between a stage's forward and backward of the same batch: ``2(J - 1 - s)``."""
    return 2 * (num_stages - 1 - stage)


def num_ticks(num_batches: int, num_stages: int) -> int:
    """Ticks of an epoch of ``num_batches``, warm-up and drain included."""
    return num_batches + 2 * (num_stages - 1) if num_batches else 0


def forward_batch(stage: int, tick: int, num_batches: int, num_stages: int) -> int | None:
    """The batch whose forward ``stage`` runs at ``tick``, or None."""
    b = tick - stage
    return b if 0 <= b < num_batches else None


def backward_batch(stage: int, tick: int, num_batches: int, num_stages: int) -> int | None:
    """The batch whose backward ``stage`` runs at ``tick``, or None."""
    b = tick - 2 * (num_stages - 1) + stage
    return b if 0 <= b < num_batches else None


def in_flight_after(stage: int, tick: int, num_batches: int, num_stages: int) -> int:
    """Batches that ``stage`` has run forward but not backward at the end of ``tick``."""
    started = min(num_batches, max(0, tick - stage + 1))
    finished = min(num_batches, max(0, tick - 2 * (num_stages - 1) + stage + 1))
    return started - finished
