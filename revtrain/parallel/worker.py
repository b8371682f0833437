"""One PETRA stage: the computation of Algorithm 1 for one worker, without any transport.

A :class:`StageWorker` owns a :class:`~revtrain.parallel.partition.Stage`, its optimizer and its
buffers. An engine (the single-process simulator or one process per stage) calls, per tick,

- ``forward(b, x) -> y`` on a new mini-batch ``b`` (every stage but the last),
- ``backward(b, y~, dy) -> (x~, dx)`` on an older one (every stage but the last),
- ``forward_backward(b, x, target) -> (x, dx)`` on the last stage: loss and backward at once,

and nothing else: the arithmetic is the same whatever moves the tensors between stages.

What a stage keeps between the forward and the backward of a batch (``input_buffer``):

- ``"needed"`` (PETRA): the stage is cut into *segments*, maximal runs of reversible units
  and runs of other units. A reversible segment keeps nothing: its backward rebuilds its input
  from its output with the stage's **current** parameters while building the graph, through
  :func:`revtrain.core.reverse_step` (for a coupling block, RevNet's Algorithm 1). Another
  segment keeps its input, keyed by batch id, and recomputes its forward in backward.
- ``"all"``: the whole stage keeps its input and recomputes (delayed gradients with
  checkpointing). ``"none"``: like ``"needed"`` but refuses a stage with a non-reversible unit.

With ``stash_params`` a stage also keeps a copy of its parameters per batch in flight and runs
the backward with it (PipeDream's weight stashing); PETRA does not.

**Batch-norm running statistics** are updated exactly once per batch, in the stage's backward:
the forward runs with batch statistics and updates nothing; the rebuild of a reversible
segment and the recompute of the others update them (PETRA §4.1: "updated when recomputing the
activations during the backward pass"). The last stage runs forward and backward in one go, so
its forward is that one update.

**Gradients** are summed into ``p.grad`` by every backward; after ``k`` backward passes
(``accumulation``) the sum is divided by ``k`` (the average, as the paper does) and SGD steps.
:meth:`StageWorker.flush` applies a last, partial accumulation (averaged over the passes it
holds) at the end of an epoch, so nothing is pending at evaluation or checkpoint time.

**Dropout** replays exactly: when a stage holds random layers, batch ``b`` of epoch ``e`` on
stage ``s`` draws from a generator seeded from ``(seed, e, b, s)`` (the same in every engine and
process layout); the generator states before each random unit are kept per batch in flight
(a few kilobytes, not activations) and replayed by the rebuild or recompute.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from revtrain.core import reverse_step
from revtrain.core.replay import RngState, no_running_stat_updates
from revtrain.data.loader import derive_seed
from revtrain.parallel.config import PetraConfig
from revtrain.parallel.errors import PipelineConfigError
from revtrain.parallel.partition import Stage
from revtrain.parallel.units import Unit
from revtrain.tasks import Task, add_sums
from revtrain.train.optim import LRSchedule, build_scheduler, param_groups

__all__ = ["Segment", "StageWorker", "plan_segments"]


@dataclass(frozen=True)
class Segment:
    """A run of a stage's units handled alike in backward."""

    units: tuple[Unit, ...]
    rebuild: bool
    """True: rebuilt from its output (keeps nothing); False: keeps its input and recomputes."""


def plan_segments(stage: Stage, input_buffer: str) -> list[Segment]:
    """Cut ``stage`` into segments for ``input_buffer`` (module docstring).

    Raises:
        PipelineConfigError: ``input_buffer="none"`` for a stage (other than the last, which
            needs no buffer) holding a non-reversible unit.
    """
    units = stage.units
    if input_buffer == "all":
        return [Segment(tuple(units), rebuild=False)]
    if input_buffer == "none" and not stage.is_last:
        fixed = [u.name for u in units if not u.reversible]
        if fixed:
            raise PipelineConfigError(
                f"stage {stage.index} holds non-reversible units ({', '.join(fixed[:3])}"
                f"{', ...' if len(fixed) > 3 else ''}), whose inputs cannot be rebuilt: it cannot run "
                "without an input buffer; use --input-buffer needed (input_buffer='needed' in Python: keep only "
                "those inputs)"
            )
    segments: list[Segment] = []
    for u in units:
        if segments and segments[-1].rebuild == u.reversible:
            segments[-1] = Segment((*segments[-1].units, u), u.reversible)
        else:
            segments.append(Segment((u,), u.reversible))
    return segments


class StageWorker:
    """The state and the three computations of one PETRA stage (module docstring).

    Args:
        stage: The stage to run.
        config: PETRA's options.
        batch_size: Samples per mini-batch (for the learning-rate rule).
        schedule: Learning-rate multiplier per parameter update; None keeps it constant.
        task: Loss and metrics; needed by the last stage.
    """

    def __init__(
        self,
        stage: Stage,
        *,
        config: PetraConfig,
        batch_size: int,
        schedule: LRSchedule | None = None,
        task: Task | None = None,
    ) -> None:
        if stage.is_last and task is None:
            raise PipelineConfigError("the last stage computes the loss: give the worker a task")
        self.stage = stage
        self.config = config
        self.task = task
        self.segments = plan_segments(stage, config.input_buffer)
        self.params = [p for p in stage.parameters() if p.requires_grad]
        self.lr = config.peak_lr(batch_size)
        self.optimizer = torch.optim.SGD(
            param_groups(stage, config.weight_decay) or [{"params": []}],
            lr=self.lr, momentum=config.momentum, nesterov=config.nesterov,
        )
        self.scheduler = build_scheduler(self.optimizer, schedule) if schedule else None
        self.random = any(isinstance(m, nn.modules.dropout._DropoutNd) for m in stage.modules())
        self.epoch = 0
        self.pending = 0
        """Backward passes summed in ``p.grad`` since the last update."""
        self.updates = 0
        """Parameter updates so far."""
        self.input_buffer: dict[int, list[tuple[Tensor, RngState | None]]] = {}
        """Per batch in flight: the kept input (and generator state) of each keeping segment."""
        self.param_stash: dict[int, list[Tensor]] = {}
        """Per batch in flight: the parameters its forward used (only with ``stash_params``)."""
        self.records: dict[int, dict[int, Any]] = {}
        """Per batch in flight: the rebuild records (generator states) of random reversible units."""
        self.train_sums: dict[str, float] = {}
        """The task's sums over the epoch's training batches (last stage)."""
        self.reconstruction_errors: list[float] = []
        """Diagnostic: per backward, the largest relative rebuild error of a reversible segment."""
        self._forward_inputs: dict[int, list[Tensor]] = {}
        self._in_flight: set[int] = set()
        self.replica_group: Any = None
        """The process group of this stage's data-parallel replicas (J stages x N replicas):
        their summed gradients are averaged over it before each update; None: one replica."""

    # -- what the engine needs to know ----------------------------------------------------------

    @property
    def needs_output(self) -> bool:
        """Whether the backward needs ``y~`` (the stage's output rebuilt by the stage above)."""
        return not self.stage.is_last and self.segments[-1].rebuild

    @property
    def in_flight(self) -> int:
        """Batches whose forward ran and whose backward did not yet."""
        return len(self._in_flight)

    @property
    def stored_inputs(self) -> int:
        """Batches for which an input is kept."""
        return len(self.input_buffer)

    @property
    def stashed_versions(self) -> int:
        """Parameter versions kept."""
        return len(self.param_stash)

    def buffer_bytes(self) -> int:
        """Bytes of the kept inputs and stashed parameters."""
        kept = sum(x.untyped_storage().nbytes() for items in self.input_buffer.values() for x, _ in items)
        stash = sum(p.numel() * p.element_size() for ps in self.param_stash.values() for p in ps)
        return kept + stash

    def start_epoch(self, epoch: int) -> None:
        """Set the epoch (it seeds dropout) and clear the epoch's sums."""
        self.epoch = epoch
        self.train_sums = {}
        self.reconstruction_errors = []

    # -- the three computations ------------------------------------------------------------------

    def forward(self, batch: int, x: Tensor) -> Tensor:
        """Forward of mini-batch ``batch`` with the current parameters, keeping what backward needs."""
        if self.stage.is_last:
            raise RuntimeError("the last stage runs forward_backward, not forward")
        kept: list[tuple[Tensor, RngState | None]] = []
        records: dict[int, Any] = {}
        seen: list[Tensor] = []
        h = x
        i = 0
        with torch.no_grad(), no_running_stat_updates(self.stage), self._seeded(batch):
            for seg in self.segments:
                if not seg.rebuild:
                    kept.append((h, RngState.capture(h.device) if self.random else None))
                elif self.config.track_reconstruction:
                    seen.append(h)
                for unit in seg.units:
                    if seg.rebuild and self.random:
                        state, records[i] = unit.module.step_forward(unit.module.to_state(h))  # type: ignore[operator]
                        h = unit.module.from_state(state)  # type: ignore[operator]
                    else:
                        h = unit.module(h)
                    i += 1
        if kept:
            self.input_buffer[batch] = kept
        if records:
            self.records[batch] = records
        if seen:
            self._forward_inputs[batch] = seen
        if self.config.stash_params:
            self.param_stash[batch] = [p.detach().clone() for p in self.params]
        self._in_flight.add(batch)
        return h

    def backward(self, batch: int, y: Tensor | None, dy: Tensor) -> tuple[Tensor, Tensor | None]:
        """Backward of ``batch`` from the stage above's ``(y~, dy)``; returns ``(x~, dx)``.

        ``y`` is needed only when :attr:`needs_output`. ``dx`` is None on the first stage.
        Parameter gradients are summed into ``p.grad``; every ``k``-th call updates.
        """
        if batch not in self._in_flight:
            raise RuntimeError(f"stage {self.stage.index}: backward of batch {batch}, whose forward did not run")
        kept = self.input_buffer.pop(batch, [])
        records = self.records.pop(batch, {})
        seen = self._forward_inputs.pop(batch, [])
        errors = []
        i = sum(len(seg.units) for seg in self.segments)
        with self._stashed_params(self.param_stash.pop(batch, None)):
            for n, seg in reversed(list(enumerate(self.segments))):
                if seg.rebuild:
                    if y is None:
                        raise RuntimeError(f"stage {self.stage.index} rebuilds its output's input but got no output")
                    for unit in reversed(seg.units):
                        i -= 1
                        y, dy = reverse_step(unit.module, y, dy, record=records.get(i), update_running_stats=True)  # type: ignore[arg-type]
                    if seen:
                        errors.append(_relative_error(y, seen.pop()))
                else:
                    i -= len(seg.units)
                    x, rng = kept.pop()
                    need = not (self.stage.is_first and n == 0)
                    xr = x.detach().requires_grad_(need)
                    with torch.enable_grad(), rng.replay() if rng is not None else contextlib.nullcontext():
                        out = xr
                        for unit in seg.units:
                            out = unit.module(out)
                    torch.autograd.backward(out, dy)
                    y, dy = x, (xr.grad if need else None)
        if errors:
            self.reconstruction_errors.append(max(errors))
        self._in_flight.discard(batch)
        self._after_backward()
        return y, dy  # type: ignore[return-value]

    def forward_backward(self, batch: int, x: Tensor, target: Tensor) -> tuple[Tensor, Tensor | None]:
        """The last stage: forward, loss and backward of ``batch`` at once; returns ``(x, dx)``."""
        if not self.stage.is_last:
            raise RuntimeError("only the last stage runs forward_backward")
        assert self.task is not None
        need = not self.stage.is_first
        xr = x.detach().requires_grad_(need)
        with torch.enable_grad(), self._seeded(batch):
            out = self.stage(xr)
            loss = self.task.loss(out, target)
        loss.backward()
        add_sums(self.train_sums, self.task.batch_sums(out.detach(), target, loss.detach()))
        self._after_backward()
        return x, (xr.grad if need else None)

    def flush(self) -> None:
        """Apply a pending partial accumulation (averaged over its passes); check nothing is in flight."""
        if self._in_flight or self.input_buffer or self.param_stash or self.records:
            raise RuntimeError(
                f"stage {self.stage.index}: flush with batches still in flight ({sorted(self._in_flight)}); "
                "drain the pipeline first"
            )
        if self.pending:
            self._update(self.pending)

    # -- state for checkpoints ------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to continue exactly (take it after :meth:`flush`)."""
        return {
            "stage_index": self.stage.index,
            "units": self.stage.unit_state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict() if self.scheduler else None,
            "updates": self.updates,
            "pending": self.pending,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state["stage_index"] != self.stage.index:
            raise PipelineConfigError(
                f"checkpoint of stage {state['stage_index']} loaded into stage {self.stage.index}"
            )
        self.stage.load_unit_state_dict(state["units"])
        self.optimizer.load_state_dict(state["optimizer"])
        if self.scheduler and state["scheduler"] is not None:
            self.scheduler.load_state_dict(state["scheduler"])
        self.updates = state["updates"]
        self.pending = state["pending"]

    # -- internals --------------------------------------------------------------------------------

    def _after_backward(self) -> None:
        self.pending += 1
        if self.pending == self.config.accumulation:
            self._update(self.pending)

    def _update(self, passes: int) -> None:
        with torch.no_grad():
            if self.replica_group is not None:  # every replica updates at the same backward
                import torch.distributed as dist

                passes *= dist.get_world_size(self.replica_group)
                for p in self.params:
                    if p.grad is not None:
                        dist.all_reduce(p.grad, group=self.replica_group)
            for p in self.params:
                if p.grad is not None:
                    p.grad.div_(passes)
        self.optimizer.step()
        if self.scheduler is not None:
            self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.pending = 0
        self.updates += 1

    def _seeded(self, batch: int) -> contextlib.AbstractContextManager[Any]:
        if not self.random:
            return contextlib.nullcontext()
        return _seeded_generators(derive_seed(self.config.dropout_seed, self.epoch, batch, self.stage.index),
                                  _device_of(self.stage))

    @contextlib.contextmanager
    def _stashed_params(self, stash: list[Tensor] | None) -> Iterator[None]:
        # The backward runs with the parameters of the batch's forward; the update and the
        # next forwards see the current ones again.
        if stash is None:
            yield
            return
        current = [p.data for p in self.params]
        for p, v in zip(self.params, stash):
            p.data = v
        try:
            yield
        finally:
            for p, v in zip(self.params, current):
                p.data = v


@contextlib.contextmanager
def _seeded_generators(seed: int, device: torch.device) -> Iterator[None]:
    devices = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices, device_type=device.type if devices else "cuda"):
        torch.manual_seed(seed)
        yield


def _device_of(module: nn.Module) -> torch.device:
    for t in module.parameters():
        return t.device
    return torch.device("cpu")


def _relative_error(rebuilt: Tensor, original: Tensor) -> float:
    num = torch.linalg.vector_norm((rebuilt - original).double())
    den = torch.linalg.vector_norm(original.double()).clamp_min(1e-30)
    return float(num / den)
