"""The single-process PETRA engine: every stage, tick by tick, in one process.

This is what the authors' code does (``AsynchronousSequential``) and the oracle the
multi-process engine is tested against: per stage, the same :class:`~revtrain.parallel.pipeline.StageTicker`
calls in the same order, with messages handed over in memory instead of sent.

Example::

    stages = split_model(model, 3)
    sim = Simulator(stages, config=PetraConfig(accumulation=2), batch_size=64, task=Classification())
    for epoch in range(epochs):
        result = sim.train_epoch(epoch, train_batches)
        test = sim.evaluate(test_batches)
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass

from torch import Tensor

import revtrain.parallel.schedule as schedule
from revtrain.parallel.config import PetraConfig
from revtrain.parallel.partition import Stage
from revtrain.parallel.pipeline import Activation, Event, Gradient, StageTicker
from revtrain.parallel.worker import StageWorker
from revtrain.tasks import Task
from revtrain.train.optim import LRSchedule

__all__ = ["EpochResult", "Simulator", "build_workers"]

Batches = Iterable[tuple[Tensor, Tensor]]


@dataclass
class EpochResult:
    """What one training epoch of a pipeline reports."""

    train_sums: dict[str, float]
    """The task's sums over the epoch's batches, as the last stage computed them."""
    num_batches: int
    ticks: int
    reconstruction_error: list[float | None]
    """Per stage, the mean relative rebuild error of its reversible segments (None when not tracked)."""
    updates: list[int]
    """Per stage, parameter updates so far."""


def build_workers(
    stages: Sequence[Stage], *, config: PetraConfig, batch_size: int, task: Task,
    schedule: LRSchedule | None = None,
) -> list[StageTicker]:
    """One worker (wrapped in its schedule) per stage."""
    workers = [
        StageWorker(st, config=config, batch_size=batch_size, schedule=schedule,
                    task=task if st.is_last else None)
        for st in stages
    ]
    return [StageTicker(w, below_needs_output=i > 0 and workers[i - 1].needs_output)
            for i, w in enumerate(workers)]


class Simulator:
    """All stages of a PETRA pipeline in one process (module docstring).

    Args:
        stages: The stages, in order (:func:`~revtrain.parallel.partition.split_model`).
        config: PETRA's options.
        batch_size: Samples per mini-batch (for the learning-rate rule).
        task: Loss and metrics.
        schedule: Learning-rate multiplier per parameter update; None keeps it constant.
    """

    def __init__(
        self, stages: Sequence[Stage], *, config: PetraConfig, batch_size: int, task: Task,
        schedule: LRSchedule | None = None,
    ) -> None:
        self.stages = list(stages)
        self.task = task
        self.tickers = build_workers(stages, config=config, batch_size=batch_size, task=task, schedule=schedule)

    @property
    def workers(self) -> list[StageWorker]:
        return [t.worker for t in self.tickers]

    @property
    def events(self) -> list[Event]:
        """Every forward and backward run so far, in order."""
        return sorted((e for t in self.tickers for e in t.events), key=lambda e: (e.tick, e.stage))

    def train_epoch(
        self,
        epoch: int,
        batches: Batches,
        num_batches: int | None = None,
        on_tick: Callable[[int, Simulator], None] | None = None,
    ) -> EpochResult:
        """Run one epoch: warm-up, steady state, drain, then flush every stage.

        Args:
            epoch: Epoch index (seeds dropout).
            batches: ``(inputs, targets)`` mini-batches, read as the first stage needs them.
            num_batches: How many to read (default ``len(batches)``).
            on_tick: Called after every tick with ``(tick, self)`` (tests, traces).
        """
        n = len(batches) if num_batches is None else num_batches  # type: ignore[arg-type]
        self.start(epoch)
        ticks = schedule.num_ticks(n, len(self.tickers))
        self.advance(ticks, n, iter(batches), on_tick)
        for w in self.workers:
            w.flush()
        return EpochResult(
            train_sums=dict(self.workers[-1].train_sums),
            num_batches=n,
            ticks=ticks,
            reconstruction_error=[statistics.fmean(w.reconstruction_errors) if w.reconstruction_errors else None
                                  for w in self.workers],
            updates=[w.updates for w in self.workers],
        )

    def start(self, epoch: int) -> None:
        """Open an epoch's pipeline: the stages train, the epoch seeds dropout, the clock is at tick 0."""
        for st, w in zip(self.stages, self.workers):
            st.train()
            w.start_epoch(epoch)
        self.tick = 0
        self._ups: dict[int, Activation] = {}
        self._downs: dict[int, Gradient] = {}

    def advance(self, stop: int, num_batches: int, batches: Iterator[tuple[Tensor, Tensor]],
                on_tick: Callable[[int, Simulator], None] | None = None) -> None:
        """Run the ticks up to ``stop`` of a pipeline over ``num_batches`` batches, reading the
        next batch from ``batches`` whenever the first stage needs one.

        Ticks before ``num_batches`` are the same whatever the epoch's length, so an engine may
        announce the batches as they come and drain with the count it fed.
        """
        j = len(self.tickers)
        for t in range(self.tick, stop):
            b = schedule.forward_batch(0, t, num_batches, j)
            if b is not None:
                try:
                    x, y = next(batches)
                except StopIteration:
                    raise ValueError(f"the batches ran out after {b} of the {num_batches} announced") from None
                self._ups[0] = Activation(b, x, y)
            ups: dict[int, Activation] = {}
            downs: dict[int, Gradient] = {}
            for s, ticker in enumerate(self.tickers):
                up, down = ticker.tick(t, num_batches, self._ups.pop(s, None), self._downs.pop(s, None))
                if up is not None:
                    ups[s + 1] = up
                if down is not None:
                    downs[s - 1] = down
            self._ups, self._downs = ups, downs
            if on_tick is not None:
                on_tick(t, self)
        self.tick = max(self.tick, stop)

    def evaluate(self, batches: Batches) -> dict[str, float]:
        """The task's sums over ``batches`` from an ordinary forward in evaluation mode."""
        modes = [st.training for st in self.stages]
        sums: dict[str, float] = {}
        batches = list(batches)
        n, j = len(batches), len(self.tickers)
        try:
            for st in self.stages:
                st.eval()
            ups: dict[int, Activation] = {}
            for t in range(n + j - 1):
                if t < n:
                    ups[0] = Activation(t, *batches[t])
                new: dict[int, Activation] = {}
                for s, ticker in enumerate(self.tickers):
                    out = ticker.eval_tick(t, n, ups.pop(s, None), self.task, sums)
                    if out is not None:
                        new[s + 1] = out
                ups = new
        finally:
            for st, m in zip(self.stages, modes):
                st.train(m)
        return sums
