"""What one stage does at one tick, whatever carries its messages.

:class:`StageTicker` wraps a :class:`~revtrain.parallel.worker.StageWorker` with the schedule
(:mod:`revtrain.parallel.schedule`): given the tick and the messages that arrived for it, it
runs the stage's forward and backward of that tick and returns the messages to send. The
single-process simulator routes those messages between stages in memory; the distributed
engine sends them with ``torch.distributed``. Both call the same code in the same order per
stage, so their arithmetic is identical.

Messages:

- :class:`Activation` ``(batch, x, target)`` goes up from stage ``s`` to ``s + 1``; the target
  travels with the activations so that only the first stage reads the data.
- :class:`Gradient` ``(batch, x~, dx)`` goes down from ``s`` to ``s - 1``; ``x~`` (the stage's
  input, rebuilt or kept) only when the stage below rebuilds from its output.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
from torch import Tensor

import revtrain.parallel.schedule as schedule
from revtrain.parallel.worker import StageWorker
from revtrain.tasks import Task, add_sums

__all__ = ["Activation", "Gradient", "StageTicker", "Event", "ComputeSeconds"]


@dataclass
class Activation:
    """Stage ``s``'s output for batch ``batch``, with the batch's targets."""

    batch: int
    x: Tensor
    target: Tensor


@dataclass
class Gradient:
    """Stage ``s``'s rebuilt input (when the stage below needs it) and input gradient."""

    batch: int
    x: Tensor | None
    dx: Tensor


@dataclass(frozen=True)
class Event:
    """One computation of the schedule, for tests and traces."""

    tick: int
    stage: int
    kind: str
    """``"F"`` forward, ``"B"`` backward, ``"FB"`` the last stage's forward + loss + backward."""
    batch: int


@dataclass
class ComputeSeconds:
    """What the computations of one tick took on one stage (for throughput breakdowns).

    Wall time is ``time.perf_counter``; CPU time is this thread's (``time.thread_time``), so a
    wall time above the CPU time means the stage waited for a core (or for memory).
    """

    forward_s: float = 0.0
    """Wall seconds of the forward (the last stage: forward, loss and backward)."""
    backward_s: float = 0.0
    """Wall seconds of the backward, parameter update included."""
    forward_cpu_s: float = 0.0
    backward_cpu_s: float = 0.0


@dataclass
class StageTicker:
    """One stage's part of the schedule.

    Args:
        worker: The stage's worker.
        below_needs_output: Whether the stage below rebuilds from its output, i.e. needs ``x~``.
    """

    worker: StageWorker
    below_needs_output: bool
    events: list[Event] = field(default_factory=list)
    peak_buffer_bytes: int = 0
    """Most bytes of kept inputs and stashed parameters held at once (right after a forward)."""
    last_seconds: ComputeSeconds = field(default_factory=ComputeSeconds)
    """What the computations of the latest :meth:`tick` took."""

    @property
    def index(self) -> int:
        return self.worker.stage.index

    @property
    def num_stages(self) -> int:
        return self.worker.stage.num_stages

    def expects(self, tick: int, num_batches: int) -> tuple[int | None, int | None]:
        """``(forward batch, backward batch)`` this stage runs at ``tick`` (None: nothing)."""
        s, j = self.index, self.num_stages
        fb = schedule.forward_batch(s, tick, num_batches, j)
        bb = None if s == j - 1 else schedule.backward_batch(s, tick, num_batches, j)
        return fb, bb

    def tick(
        self,
        tick: int,
        num_batches: int,
        up: Activation | None,
        down: Gradient | None,
    ) -> tuple[Activation | None, Gradient | None]:
        """Run this tick's forward and backward; return ``(message up, message down)``.

        ``up`` is the activation for this tick's forward (on the first stage: the data batch),
        ``down`` the gradient for this tick's backward.
        """
        send_up, send_down = self.tick_forward(tick, num_batches, up)
        sent_down = self.tick_backward(tick, num_batches, down)
        return send_up, sent_down if sent_down is not None else send_down

    def tick_forward(
        self, tick: int, num_batches: int, up: Activation | None
    ) -> tuple[Activation | None, Gradient | None]:
        """The first half of :meth:`tick`: the forward (the last stage: forward, loss and backward).

        Returns ``(message up, message down)``; only the last stage has a message down here.
        An engine may send them before it runs :meth:`tick_backward` (nothing in the backward
        changes them).
        """
        worker, s = self.worker, self.index
        fb, _ = self.expects(tick, num_batches)
        send_up: Activation | None = None
        send_down: Gradient | None = None
        wall, cpu = time.perf_counter(), time.thread_time()
        if fb is not None:
            if up is None or up.batch != fb:
                raise RuntimeError(f"stage {s} tick {tick}: expected the activations of batch {fb}, got {_batch(up)}")
            if worker.stage.is_last:
                x, dx = worker.forward_backward(fb, up.x, up.target)
                self.events.append(Event(tick, s, "FB", fb))
                if not worker.stage.is_first:
                    send_down = Gradient(fb, x if self.below_needs_output else None, dx)  # type: ignore[arg-type]
            else:
                y = worker.forward(fb, up.x)
                self.events.append(Event(tick, s, "F", fb))
                self.peak_buffer_bytes = max(self.peak_buffer_bytes, worker.buffer_bytes())
                send_up = Activation(fb, y, up.target)
        self.last_seconds = ComputeSeconds(forward_s=time.perf_counter() - wall, forward_cpu_s=time.thread_time() - cpu)
        return send_up, send_down

    def tick_backward(self, tick: int, num_batches: int, down: Gradient | None) -> Gradient | None:
        """The second half of :meth:`tick`: the backward (and update); returns the message down."""
        worker, s = self.worker, self.index
        _, bb = self.expects(tick, num_batches)
        send_down: Gradient | None = None
        wall, cpu = time.perf_counter(), time.thread_time()
        if bb is not None:
            if down is None or down.batch != bb:
                raise RuntimeError(f"stage {s} tick {tick}: expected the gradient of batch {bb}, got {_batch(down)}")
            x, dx = worker.backward(bb, down.x, down.dx)
            self.events.append(Event(tick, s, "B", bb))
            if not worker.stage.is_first:
                send_down = Gradient(bb, x if self.below_needs_output else None, dx)  # type: ignore[arg-type]
        self.last_seconds.backward_s = time.perf_counter() - wall
        self.last_seconds.backward_cpu_s = time.thread_time() - cpu
        return send_down

    @torch.no_grad()
    def eval_tick(self, tick: int, num_batches: int, up: Activation | None, task: Task,
                  sums: dict[str, float]) -> Activation | None:
        """Evaluation: an ordinary forward (evaluation mode, no buffers) of this tick's batch.

        The last stage adds the task's sums of its batch into ``sums``.
        """
        b = schedule.forward_batch(self.index, tick, num_batches, self.num_stages)
        if b is None:
            return None
        if up is None or up.batch != b:
            raise RuntimeError(f"stage {self.index} eval tick {tick}: expected batch {b}, got {_batch(up)}")
        out = self.worker.stage(up.x)
        if self.worker.stage.is_last:
            add_sums(sums, task.batch_sums(out, up.target))
            return None
        return Activation(b, out, up.target)


def _batch(message: Activation | Gradient | None) -> str:
    return "nothing" if message is None else f"batch {message.batch}"
