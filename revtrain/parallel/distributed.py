"""The multi-process PETRA engine: one OS process per stage, on ``torch.distributed``.

Each process runs one stage's :class:`~revtrain.parallel.pipeline.StageTicker`, exactly as the
simulator does, and exchanges its messages with its two neighbours once per tick: one
``torch.distributed.batch_isend_irecv`` call posts the sends of what the previous tick
produced and the receives of what this tick needs, then waits for all of them (gloo on CPU,
NCCL on CUDA). Message shapes are known in advance on both sides (every stage knows every
stage's output shape and every batch's size), so nothing but tensors crosses the wire.

The process group comes from the standard ``env://`` rendezvous (``MASTER_ADDR``,
``MASTER_PORT``, ``RANK``, ``WORLD_SIZE``), which ``torchrun`` and
:mod:`revtrain.parallel.launch` both set. Rank ``r`` runs stage ``r``.

Every wait has a timeout: a neighbour that died or hangs makes this process raise
:class:`~revtrain.parallel.errors.StageFailedError` instead of waiting forever.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import NoReturn

import torch
import torch.distributed as dist
from torch import Tensor

import revtrain.parallel.schedule as schedule
from revtrain.parallel.errors import PipelineConfigError, StageFailedError
from revtrain.parallel.config import PetraConfig
from revtrain.parallel.partition import Stage, stage_shapes
from revtrain.parallel.pipeline import Activation, Gradient, StageTicker
from revtrain.parallel.worker import StageWorker, plan_segments
from revtrain.tasks import Task
from revtrain.train.optim import LRSchedule

__all__ = ["Shapes", "TickTiming", "DistributedPipeline", "init_from_env", "check_backend", "batch_sizes", "exit_rank"]

_ACT, _TARGET, _REBUILT, _GRAD = 0, 1, 2, 3  # message tags


def check_backend(backend: str, device: torch.device) -> str:
    """The backend to use for ``device`` (``"auto"``: NCCL on CUDA, gloo on CPU); refuse what cannot run."""
    if backend == "auto":
        backend = "nccl" if device.type == "cuda" else "gloo"
    if backend == "nccl":
        if not torch.cuda.is_available():
            raise PipelineConfigError(
                "backend 'nccl' needs CUDA GPUs and none is available here; use backend 'gloo' "
                "(CPU) or run on a machine with GPUs"
            )
        if not dist.is_nccl_available():
            raise PipelineConfigError("this PyTorch build has no NCCL; use backend 'gloo'")
        if device.type != "cuda":
            raise PipelineConfigError("backend 'nccl' moves CUDA tensors only; use device 'cuda' or backend 'gloo'")
    elif backend == "gloo":
        if not dist.is_gloo_available():
            raise PipelineConfigError("this PyTorch build has no gloo backend; use 'nccl' on GPUs")
        if device.type == "cuda":
            raise PipelineConfigError("gloo sends CPU tensors only; use backend 'nccl' (or 'auto') with device 'cuda'")
    else:
        raise PipelineConfigError(f"unknown backend {backend!r}; use 'auto', 'gloo' or 'nccl'")
    return backend


def exit_rank(code: int = 0) -> NoReturn:
    """End this rank's process at once: destroy the process group, flush, ``os._exit(code)``.

    DDP's reducer and FSDP2's device mesh keep the gloo process group alive past
    ``destroy_process_group()``; its worker threads then race the interpreter's finalization
    and can abort a rank that finished and saved everything (SIGABRT, "terminate called without
    an active exception"). A rank's files are closed by then, so it leaves without finalizing.
    """
    try:
        if dist.is_initialized():
            dist.destroy_process_group()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):  # a closed or broken pipe: nothing more can be said
                pass
        os._exit(code)


def init_from_env(backend: str, timeout_s: float) -> tuple[int, int]:
    """Join the process group described by the environment (``env://``); return ``(rank, world size)``."""
    missing = [k for k in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE") if k not in os.environ]
    if missing:
        raise PipelineConfigError(
            f"the env:// rendezvous needs {', '.join(missing)} in the environment; start the workers "
            "with torchrun or `revtrain train --stages J` or `--data-parallel N`"
        )
    if not dist.is_initialized():
        dist.init_process_group(backend, init_method="env://", timeout=timedelta(seconds=timeout_s))
    return dist.get_rank(), dist.get_world_size()


def batch_sizes(num_samples: int, batch_size: int, drop_last: bool) -> list[int]:
    """The size of every batch of a loader over ``num_samples``."""
    full, rest = divmod(num_samples, batch_size)
    return [batch_size] * full + ([rest] if rest and not drop_last else [])


@dataclass(frozen=True)
class Shapes:
    """What a stage must know to post its receives: shapes without the batch dimension, dtypes."""

    input: tuple[int, ...]
    """The stage's input (the previous stage's output)."""
    output: tuple[int, ...]
    """The stage's output."""
    dtype: torch.dtype
    """Dtype of activations and gradients."""
    target: tuple[int, ...]
    """Targets of one sample (``()`` for class ids)."""
    target_dtype: torch.dtype
    needs_output: bool
    """Whether this stage's backward needs ``y~`` from the stage above."""
    below_needs_output: bool


@dataclass(frozen=True)
class TickTiming:
    """Where one stage's time went in one training tick (wall seconds unless named CPU)."""

    tick: int
    start_s: float
    """``time.perf_counter()`` at the start of the tick."""
    exchange_s: float
    """Posting this tick's sends and receives and waiting for the receives: communication and
    waiting for a slower neighbour."""
    forward_s: float
    """The forward (the last stage: forward, loss and backward)."""
    backward_s: float
    """The backward with its parameter update."""
    forward_cpu_s: float
    backward_cpu_s: float
    """The computations' CPU time in this thread (below the wall time: the stage waited for a core)."""


class DistributedPipeline:
    """One stage of a PETRA pipeline in this process; the other stages in the other ranks.

    Args:
        ticker: This stage's worker and schedule.
        shapes: Message shapes.
        device: Where messages live (CPU for gloo, this rank's GPU for NCCL).
        timeout_s: Longest wait for a neighbour at any tick.
        stage_ranks: The global rank of each stage, in stage order (default: stage ``s`` on rank
            ``s``); ranks outside the list take no part.
    """

    def __init__(self, ticker: StageTicker, shapes: Shapes, device: torch.device, timeout_s: float,
                 stage_ranks: Sequence[int] | None = None) -> None:
        self.ticker = ticker
        self.shapes = shapes
        self.device = device
        self.timeout = timedelta(seconds=timeout_s)
        self.stage = ticker.worker.stage
        ranks = list(range(self.stage.num_stages)) if stage_ranks is None else list(stage_ranks)
        if len(ranks) != self.stage.num_stages:
            raise PipelineConfigError(f"stage_ranks {ranks} must name one rank for each of the {self.stage.num_stages} stages")
        s = self.stage.index
        self.rank = ranks[s]
        self._below = ranks[s - 1] if s > 0 else None
        self._above = ranks[s + 1] if s + 1 < len(ranks) else None
        self.overlap = device.type == "cpu"
        """Overlap messages with computation (gloo). NCCL keeps the lockstep exchange: its
        point-to-point calls block a stream until matched, and the overlapped order could
        deadlock there."""
        self.tick_timings: list[TickTiming] = []
        """Where the time of every tick of the last training epoch went."""

    @classmethod
    def for_rank(
        cls,
        stages: Sequence[Stage],
        index: int,
        *,
        config: PetraConfig,
        batch_size: int,
        task: Task,
        sample: tuple[Tensor, Tensor],
        schedule: LRSchedule | None = None,
        device: torch.device | None = None,
        timeout_s: float = 60.0,
        stage_ranks: Sequence[int] | None = None,
    ) -> DistributedPipeline:
        """The pipeline of stage ``index`` of ``stages`` (a split every rank made the same way).

        ``sample`` is one ``(inputs, targets)`` batch (on ``device``): it gives every stage's
        message shapes and dtypes. ``stage_ranks`` maps stages to global ranks when stage ``s``
        does not run on rank ``s``.
        """
        stage = stages[index]
        worker = StageWorker(stage, config=config, batch_size=batch_size, schedule=schedule,
                             task=task if stage.is_last else None)
        needs = [not st.is_last and plan_segments(st, config.input_buffer)[-1].rebuild for st in stages]
        ticker = StageTicker(worker, below_needs_output=index > 0 and needs[index - 1])
        x, y = sample
        outs = stage_shapes(stages, x[:1])
        shapes = Shapes(input=tuple(x.shape[1:]) if index == 0 else outs[index - 1], output=outs[index],
                        dtype=x.dtype, target=tuple(y.shape[1:]), target_dtype=y.dtype,
                        needs_output=needs[index], below_needs_output=ticker.below_needs_output)
        return cls(ticker, shapes, device or x.device, timeout_s, stage_ranks)

    @property
    def worker(self) -> StageWorker:
        return self.ticker.worker

    @property
    def tick_starts(self) -> list[float]:
        """``time.perf_counter()`` at the start of every tick of the last training epoch."""
        return [t.start_s for t in self.tick_timings]

    def train_epoch(self, epoch: int, batches: Iterable[tuple[Tensor, Tensor]] | None, sizes: Sequence[int]) -> None:
        """Run this stage's part of one epoch (warm-up, steady state, drain) and flush.

        Args:
            epoch: Epoch index (seeds dropout).
            batches: The data, read by the first stage only (others pass None).
            sizes: The size of every batch of the epoch (all ranks).
        """
        self.stage.train()
        self.worker.start_epoch(epoch)
        data = iter(batches) if batches is not None else None
        self.tick_timings = []
        if self.overlap:
            self._train_overlapped(data, sizes)
        else:
            self._train_lockstep(data, sizes)
        self.worker.flush()

    def start(self, epoch: int) -> None:
        """Open an epoch's pipeline for :meth:`advance`: the stage trains, the epoch seeds dropout."""
        self.stage.train()
        self.worker.start_epoch(epoch)
        self.tick = 0
        self._outputs: tuple[Activation | None, Gradient | None] = (None, None)

    def advance(self, stop: int, sizes: Sequence[int], batches: Iterator[tuple[Tensor, Tensor]] | None) -> None:
        """Run the ticks up to ``stop`` in lockstep over the batches of ``sizes`` (the batches fed so
        far: ticks before ``len(sizes)`` are the same whatever the epoch's length); the first stage
        reads ``batches``. The outputs of the last tick run are sent by the next call's first tick,
        so nothing is pending between calls (collectives may run between them)."""
        n = len(sizes)
        for t in range(self.tick, stop):
            up, down = self._exchange(t, n, sizes, *self._outputs, training=True)
            up = self._read_batch(t, n, batches) or up
            self._outputs = self.ticker.tick(t, n, up, down)
        self.tick = max(self.tick, stop)

    def _train_lockstep(self, data: Iterator[tuple[Tensor, Tensor]] | None, sizes: Sequence[int]) -> None:
        """Every tick: one exchange (last tick's sends, this tick's receives), then compute."""
        n, j = len(sizes), self.stage.num_stages
        up_out: Activation | None = None
        down_out: Gradient | None = None
        for t in range(schedule.num_ticks(n, j)):
            start = time.perf_counter()
            up, down = self._exchange(t, n, sizes, up_out, down_out, training=True)
            exchanged = time.perf_counter()
            up = self._read_batch(t, n, data) or up
            up_out, down_out = self.ticker.tick(t, n, up, down)
            self._record(t, start, exchanged - start)

    def _train_overlapped(self, data: Iterator[tuple[Tensor, Tensor]] | None, sizes: Sequence[int]) -> None:
        """Every tick: wait for the forward's input, forward, send its output at once, wait for
        the backward's input, backward, send. The receives of tick t + 1 are posted at the start
        of tick t, so a message moves while both neighbours compute; the same computations run
        in the same order as in lockstep, only the messages move earlier."""
        n, j = len(sizes), self.stage.num_stages
        ticks = schedule.num_ticks(n, j)
        posted = {0: self._post(*self._receives(0, n, sizes, training=True), 0)} if ticks else {}
        in_flight: list[dist.Work] = []
        for t in range(ticks):
            start = time.perf_counter()
            if t + 1 < ticks:
                posted[t + 1] = self._post(*self._receives(t + 1, n, sizes, training=True), t + 1)
            up, down, up_works, down_works = posted.pop(t)
            self._wait(up_works, t)
            waited = time.perf_counter() - start
            up = self._read_batch(t, n, data) or up
            send_up, send_down = self.ticker.tick_forward(t, n, up)
            clock = time.perf_counter()
            sent = self._start(self._sends(send_up, send_down), t)
            self._wait(down_works, t)
            waited += time.perf_counter() - clock
            send_down = self.ticker.tick_backward(t, n, down)
            clock = time.perf_counter()
            sent += self._start(self._sends(None, send_down), t)
            self._wait(in_flight, t)  # last tick's sends: long done unless a neighbour is stuck
            in_flight = sent
            self._record(t, start, waited + time.perf_counter() - clock)
        self._wait(in_flight, ticks)

    def _read_batch(self, tick: int, n: int, data: Iterator[tuple[Tensor, Tensor]] | None) -> Activation | None:
        """The first stage's data batch for this tick's forward, or None."""
        if not self.stage.is_first:
            return None
        b = schedule.forward_batch(0, tick, n, self.stage.num_stages)
        if b is None:
            return None
        x, y = next(data)  # type: ignore[arg-type]
        return Activation(b, x.to(self.device), y.to(self.device))

    def _record(self, tick: int, start: float, exchange_s: float) -> None:
        c = self.ticker.last_seconds
        self.tick_timings.append(TickTiming(
            tick=tick, start_s=start, exchange_s=exchange_s, forward_s=c.forward_s, backward_s=c.backward_s,
            forward_cpu_s=c.forward_cpu_s, backward_cpu_s=c.backward_cpu_s))

    @torch.no_grad()
    def evaluate(self, task: Task, batches: Iterable[tuple[Tensor, Tensor]] | None, sizes: Sequence[int]) -> dict[str, float]:
        """A pipelined ordinary forward in evaluation mode; the last stage returns the task's sums."""
        n, j = len(sizes), self.stage.num_stages
        was = self.stage.training
        self.stage.eval()
        sums: dict[str, float] = {}
        data = iter(batches) if batches is not None else None
        out: Activation | None = None
        try:
            for t in range(n + j - 1):
                up, _ = self._exchange(t, n, sizes, out, None, training=False)
                if self.stage.is_first and t < n:
                    x, y = next(data)  # type: ignore[arg-type]
                    up = Activation(t, x.to(self.device), y.to(self.device))
                out = self.ticker.eval_tick(t, n, up, task, sums)
        finally:
            self.stage.train(was)
        return sums

    def _exchange(
        self, tick: int, n: int, sizes: Sequence[int], up_out: Activation | None, down_out: Gradient | None,
        *, training: bool,
    ) -> tuple[Activation | None, Gradient | None]:
        """Send what the previous tick produced and receive what this tick needs, in one call."""
        up, down, up_ops, down_ops = self._receives(tick, n, sizes, training=training)
        self._wait(self._start(self._sends(up_out, down_out) + up_ops + down_ops, tick), tick)
        return up, down

    def _sends(self, up_out: Activation | None, down_out: Gradient | None) -> list[dist.P2POp]:
        """The sends of a stage's outputs: activations and targets up, ``(x~, dx)`` down."""
        ops: list[dist.P2POp] = []
        if up_out is not None:
            ops.append(dist.P2POp(dist.isend, up_out.x.contiguous(), self._above, tag=_ACT))
            ops.append(dist.P2POp(dist.isend, up_out.target.contiguous(), self._above, tag=_TARGET))
        if down_out is not None:
            if self.shapes.below_needs_output:
                ops.append(dist.P2POp(dist.isend, down_out.x.contiguous(), self._below, tag=_REBUILT))  # type: ignore[union-attr]
            ops.append(dist.P2POp(dist.isend, down_out.dx.contiguous(), self._below, tag=_GRAD))
        return ops

    def _receives(
        self, tick: int, n: int, sizes: Sequence[int], *, training: bool
    ) -> tuple[Activation | None, Gradient | None, list[dist.P2POp], list[dist.P2POp]]:
        """The messages ``tick`` needs (empty buffers) and the receives that fill them:
        ``(up, down, receives for up, receives for down)``."""
        sh = self.shapes
        up: Activation | None = None
        down: Gradient | None = None
        up_ops: list[dist.P2POp] = []
        down_ops: list[dist.P2POp] = []
        fb, bb = self.ticker.expects(tick, n)
        if not training:
            bb = None
        if fb is not None and not self.stage.is_first:
            x = torch.empty((sizes[fb], *sh.input), dtype=sh.dtype, device=self.device)
            y = torch.empty((sizes[fb], *sh.target), dtype=sh.target_dtype, device=self.device)
            up_ops.append(dist.P2POp(dist.irecv, x, self._below, tag=_ACT))
            up_ops.append(dist.P2POp(dist.irecv, y, self._below, tag=_TARGET))
            up = Activation(fb, x, y)
        if bb is not None:
            shape = (sizes[bb], *sh.output)
            y_rebuilt = torch.empty(shape, dtype=sh.dtype, device=self.device) if sh.needs_output else None
            dy = torch.empty(shape, dtype=sh.dtype, device=self.device)
            if y_rebuilt is not None:
                down_ops.append(dist.P2POp(dist.irecv, y_rebuilt, self._above, tag=_REBUILT))
            down_ops.append(dist.P2POp(dist.irecv, dy, self._above, tag=_GRAD))
            down = Gradient(bb, y_rebuilt, dy)
        return up, down, up_ops, down_ops

    def _post(
        self, up: Activation | None, down: Gradient | None, up_ops: list[dist.P2POp], down_ops: list[dist.P2POp],
        tick: int,
    ) -> tuple[Activation | None, Gradient | None, list[dist.Work], list[dist.Work]]:
        """Start the receives of a tick; its messages fill in the background."""
        return up, down, self._start(up_ops, tick), self._start(down_ops, tick)

    def _start(self, ops: list[dist.P2POp], tick: int) -> list[dist.Work]:
        if not ops:
            return []
        try:
            return list(dist.batch_isend_irecv(ops))
        except Exception as err:  # noqa: BLE001 - any transport failure ends the run clearly
            raise self._lost(tick, err) from err

    def _wait(self, works: list[dist.Work], tick: int) -> None:
        try:
            for req in works:
                req.wait(self.timeout)
        except Exception as err:  # noqa: BLE001 - any transport failure ends the run clearly
            raise self._lost(tick, err) from err

    def _lost(self, tick: int, err: Exception) -> StageFailedError:
        return StageFailedError(
            f"stage {self.stage.index} (rank {self.rank}) lost contact with a neighbour at tick {tick}: {err}. A "
            "neighbouring stage's process died or stopped answering; see its own error"
        )
