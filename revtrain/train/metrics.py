"""What a run records: a JSON-lines metrics file, cheap live memory readings, and the measured
memory of one training step in the run's modes against plain backprop.
"""

from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from revtrain.memory import process_peak_rss_bytes
from revtrain.tasks import add_sums
from revtrain.train.files import NO_SPACE, DiskFullError, atomic_write_text

__all__ = ["MetricsWriter", "EpochStats", "live_memory", "StepMemory", "measure_step_memory"]


class MetricsWriter:
    """Append one JSON object per line to ``path``; every record has ``event`` and ``time``.

    Events written by the trainer: ``"step"`` (every ``log_every`` steps), ``"epoch"`` (after
    each evaluation), ``"plan"``, ``"resume"``, ``"interrupt"``, ``"diverged"`` and ``"summary"``.

    Args:
        path: The ``metrics.jsonl`` file; created with its folder if missing.
        resume_step: When continuing a run from a checkpoint at this step, keep the file but
            first drop the records a crash left behind after that step (and any ``"summary"``),
            so it reads as one uninterrupted run. None (a new run) starts an empty file.
        redo_epoch: Also drop the ``"epoch"`` record of this epoch (its evaluation is redone).
        sinks: Also hand every record to these (:mod:`revtrain.train.loggers`); each first gets
            the records kept from before (a resumed run).
    """

    def __init__(
        self, path: str | os.PathLike[str], *, resume_step: int | None = None, redo_epoch: int | None = None,
        sinks: Sequence[Any] = (),
    ) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if resume_step is not None and self.path.exists():
            self._truncate(resume_step, redo_epoch)
        self._file = self.path.open("w" if resume_step is None else "a", encoding="utf-8")
        self.sinks = list(sinks)  # copies of each record: CSV, TensorBoard (revtrain.train.loggers)
        kept = [json.loads(line) for line in self.path.read_text(encoding="utf-8").splitlines()] \
            if resume_step is not None and self.sinks else []
        for sink in self.sinks:
            sink.begin(kept)

    def write(self, event: str, **fields: Any) -> None:
        """Write one record and flush it (a crash loses at most the line being written)."""
        record = {"event": event, "time": round(time.time(), 3), **fields}
        try:
            line = json.dumps(record, default=_jsonable)
            self._file.write(line + "\n")
            self._file.flush()
            for sink in self.sinks:
                sink.write(json.loads(line))  # the record as metrics.jsonl holds it
        except OSError as err:
            if err.errno not in NO_SPACE:
                raise
            raise DiskFullError(f"no space left on device while appending to {self.path}; the last "
                                "checkpoint is kept; free some space, then resume") from None

    def close(self) -> None:
        self._file.close()
        for sink in self.sinks:
            sink.close()
        self.sinks = []

    def _truncate(self, step: int, redo_epoch: int | None) -> None:
        kept = []
        for line in self.path.read_text(encoding="utf-8").splitlines():
            try:
                record = json.loads(line)
            except json.JSONDecodeError:  # a line cut off by a crash
                continue
            after = record.get("step", 0) > step
            redone = record.get("event") == "epoch" and record.get("epoch") == redo_epoch
            if not (after or redone or record.get("event") == "summary"):
                kept.append(line + "\n")
        atomic_write_text(self.path, "".join(kept), what="metrics file")


class EpochStats:
    """Running sums of the current epoch's training; saved in checkpoints for mid-epoch resume.

    ``sums`` are the task's additive batch sums (:meth:`revtrain.tasks.Task.batch_sums`, always
    with ``"loss_sum"`` and ``"count"``); the task turns them into metrics. ``samples`` and
    ``seconds`` give the throughput.
    """

    def __init__(self, sums: Mapping[str, float] | None = None, samples: int = 0, seconds: float = 0.0):
        self.sums: dict[str, float] = dict(sums or {})
        self.samples, self.seconds = samples, seconds

    def add(self, sums: Mapping[str, float], samples: int, seconds: float) -> None:
        add_sums(self.sums, sums)
        self.samples += samples
        self.seconds += seconds

    @property
    def throughput(self) -> float:
        """Training samples per second so far this epoch (data, forward, backward, update)."""
        return self.samples / self.seconds if self.seconds else 0.0

    def to_dict(self) -> dict[str, Any]:
        return {"sums": dict(self.sums), "samples": self.samples, "seconds": self.seconds}


def _jsonable(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.tolist()
    if isinstance(value, Path):
        return str(value)
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    raise TypeError(f"cannot write {type(value).__name__} to metrics")


def live_memory(device: torch.device) -> tuple[int | None, str]:
    """A memory reading cheap enough for every step: ``(bytes, what it measures)``.

    CUDA: the allocator's peak of tensor bytes since the last reset (the trainer resets it each
    epoch). CPU: the process's resident set size now (``/proc/self/statm``; peak RSS elsewhere).
    """
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device), "peak tensors"
    try:
        with open("/proc/self/statm", "rb") as f:
            resident_pages = int(f.read().split()[1])
        return resident_pages * os.sysconf("SC_PAGE_SIZE"), "rss"
    except (OSError, ValueError, IndexError, AttributeError):
        return process_peak_rss_bytes(), "peak rss"


class StepMemory:
    """Peak bytes of one training step (forward + backward) of a model, by mode assignment."""

    def __init__(self, run_bytes: int, plain_bytes: int, batch_size: int, modes: Mapping[str, str],
                 method: str) -> None:
        self.run_bytes = run_bytes
        """Peak of the step in the run's modes."""
        self.plain_bytes = plain_bytes
        """Peak of the same step with every reversible block in C-mode (plain backprop)."""
        self.batch_size = batch_size
        self.modes = dict(modes)
        self.method = method
        """How bytes were counted (``"cpu-dispatch"`` or ``"cuda-allocator"``)."""

    @property
    def ratio(self) -> float:
        """``plain_bytes / run_bytes``: how many times less memory the run's modes need."""
        return self.plain_bytes / self.run_bytes if self.run_bytes else float("nan")

    def to_dict(self) -> dict[str, Any]:
        counts = {m: sum(v == m for v in self.modes.values()) for m in ("M", "C")}
        return {
            "step_peak_bytes": self.run_bytes,
            "plain_backprop_peak_bytes": self.plain_bytes,
            "plain_over_run": round(self.ratio, 4) if self.run_bytes else None,
            "memory_batch_size": self.batch_size,
            "blocks_in_M": counts["M"],
            "blocks_in_C": counts["C"],
            "memory_method": self.method,
        }


def measure_step_memory(
    model: nn.Module,
    batch: tuple[torch.Tensor, torch.Tensor],
    modes: Mapping[str, str],
    device: torch.device,
    autocast: Callable[[], AbstractContextManager[Any]],
    *,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = F.cross_entropy,
    make_optimizer: Callable[[Any], torch.optim.Optimizer] | None = None,
) -> StepMemory:
    """Measure the step memory of one training step on ``batch`` in ``modes``, and with every
    block in C-mode and every plain layer keeping its activations (plain backprop).

    Step memory has one definition, the planner's (:mod:`revtrain.planner.measure`), and is what
    ``revtrain plan`` and the benchmarks print too: the peak tensor bytes of forward, loss,
    backward and an SGD-with-momentum step, including what is live when the step starts (the
    parameters, buffers, optimizer state and the batch), after one warm-up step that creates the
    optimizer state (``make_optimizer(params)``: the run's optimizer; default SGD with momentum).
    The model is measured in place and put back as it was (weights, batch-norm
    statistics, gradients, modes and the random generators), so the run's results do not depend
    on whether this was called.
    """
    from revtrain.core import reversible_blocks
    from revtrain.planner.measure import measure_steps  # the planner's measurement, not a copy
    from revtrain.planner.recompute import plain_layers
    from revtrain.planner.setup import prepare

    # Plain backprop: every block in C-mode and every plain layer keeping its activations (a
    # plan may recompute or offload some).
    plain = {**{name: "C" for name, _ in reversible_blocks(model)}, **{name: "keep" for name, _ in plain_layers(model)}}
    with prepare(model, batch, device=device, repeats=0, warmup=1, autocast=autocast, loss_fn=loss_fn,
                 make_optimizer=make_optimizer) as setup:
        steps = measure_steps(setup, {"run": dict(modes) or None, "plain": plain or "C"})
        batch_size = setup.batch_size
    run, plain_step = steps["run"], steps["plain"]
    return StepMemory(run.peak_bytes, plain_step.peak_bytes, batch_size, modes, run.method)
