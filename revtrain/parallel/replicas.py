"""Data-parallel training runs: the :class:`~revtrain.train.Trainer` on N processes (DDP or FSDP2).

``revtrain train --data-parallel N`` starts N local processes (gloo on CPU, NCCL on CUDA,
``env://`` rendezvous, so ``torchrun --nproc-per-node N -m revtrain.cli train --data-parallel N``
works too). Every process runs the ordinary :class:`~revtrain.train.Trainer` with a
:class:`DataParallelEngine`, which changes three things:

- **The step.** Every process reads the same batch of ``--batch-size`` samples (the loaders
  are seeded alike, so data order, augmentation and resume positions are the single-process
  run's) and trains on its own slice of it (``tensor_split``: sizes differ by at most one).
  Each slice's mean loss is scaled by ``slice * N / step`` (``step``: the samples of the step's
  ``--accumulation`` micro-batches) so that DDP's average of the N gradients is the gradient of
  the whole step's mean loss; gradients are synchronised on a step's last micro-batch only. The
  update equals one process on the same batches (up to the order of float additions; batch norm normalises each slice with
  its own statistics, as DDP always does). The loss and the task's sums are all-reduced, so
  the metrics, the progress and the divergence check are the whole batch's on every rank.
- **Buffers**: after every update each persistent floating-point buffer becomes its mean over the
  processes (:func:`average_buffers`; buffers held alike stay exactly as they are), instead of
  DDP's broadcast of rank 0's before every forward, so every process evaluates and saves the same batch-norm statistics: the running mean one process would track
  on the whole batch (equal slices), the running variance the mean of the processes' own
  (each slice's variance about its own mean).
- **Evaluation**: each rank evaluates its slice of every test batch; the sums are all-reduced.
- **Files**: rank 0 writes the run folder (``config.json``, ``metrics.jsonl``, ``summary.json``,
  the memory report) by the trainer's own rules. Checkpoints are folders written by
  ``torch.distributed.checkpoint`` (:class:`~revtrain.train.checkpoint_store.FolderStore`,
  ``<run>/checkpoints/step-<step>/``): with ``--shard`` every rank writes its own shards
  (nothing is gathered on one rank); what every rank holds whole (DDP's model and optimizer,
  the buffers) rank 0 writes; rank 0 also writes the rest of the state and the manifest. DCP
  reshards on load, so a data-parallel run resumes with any number of processes, sharded or not, or in one process (``revtrain train --resume`` without
  ``--data-parallel``, ``revtrain.load``).

With ``--shard`` the model is sharded with FSDP2 (``fully_shard`` per reversible block, then
the whole model; :func:`~revtrain.parallel.data_parallel.shard`): every process keeps 1/N of the
parameters, gradients and optimizer state. The step memory report is skipped under ``--shard``
(it would run one process's step alone).
"""

from __future__ import annotations

from collections.abc import Mapping
from contextlib import nullcontext
from typing import Any

import torch
import torch.distributed as dist

from revtrain.parallel.data_parallel import replicate, shard
from revtrain.parallel.errors import PipelineConfigError
from revtrain.train.checkpoint_store import FolderStore
from revtrain.train.engine import Batch, GradientEngine, backward_share, refuse_stages
from revtrain.train.optim import build_optimizer, build_scheduler
from revtrain.train.trainer_view import TrainerView

__all__ = ["DataParallelEngine", "average_buffers"]


class DataParallelEngine(GradientEngine):
    """The :class:`~revtrain.train.engine.Engine` of one of N data-parallel processes (module docstring).

    Args:
        sharded: FSDP2 instead of DDP.
    """

    def __init__(self, *, sharded: bool = False) -> None:
        if not dist.is_initialized():
            raise PipelineConfigError("DataParallelEngine needs an initialised process group (init_from_env)")
        self.rank, self.world, self.sharded = dist.get_rank(), dist.get_world_size(), sharded
        self.writes_files = self.rank == 0
        self.measures_memory = not sharded  # the report would run one process's step alone
        self.wrapped: torch.nn.Module | None = None
        self.model: torch.nn.Module | None = None

    def describe(self) -> str:
        what = "FSDP2, parameters sharded" if self.sharded else "DDP"
        return f"data parallel over {self.world} processes ({what}), each on 1/{self.world} of every batch"

    def attach(self, trainer: TrainerView) -> None:
        refuse_stages(trainer)
        self._check_slices(trainer)
        self.model = trainer.model
        if self.sharded:
            self._shard(trainer)
            self.wrapped = trainer.model
        else:  # buffers are averaged after each step instead of broadcast from rank 0 (average_buffers)
            self.wrapped = replicate(trainer.model, trainer.device if trainer.device.type == "cuda" else None,
                                     sync_buffers=False)

    def _check_slices(self, trainer: TrainerView) -> None:
        c, info = trainer.config, trainer.data_info
        sizes = {c.batch_size}
        rest = info.train_size % c.batch_size
        if rest and trainer.batches_per_epoch == len(trainer.train_loader):
            sizes.add(rest)
        small = min(sizes)
        if small < self.world:
            raise PipelineConfigError(
                f"a training batch of {small} samples cannot be shared by {self.world} processes (each needs "
                f"at least one); use --batch-size of at least {self.world}"
                + (f" and one that leaves no last batch below {self.world} ({info.train_size} samples), "
                   "or --max-steps-per-epoch to skip it" if rest and small == rest else "")
            )

    def _shard(self, trainer: TrainerView) -> None:
        """Shard the model (already restored on resume) and move the optimizer onto the shards."""
        opt_state, sched_state = trainer.optimizer.state_dict(), trainer.scheduler.state_dict()
        shard(trainer.model, per_block=True)
        c = trainer.config
        trainer.optimizer = build_optimizer(trainer.model, lr=c.lr, momentum=c.momentum, nesterov=c.nesterov,
                                            weight_decay=c.weight_decay, kind=c.optimizer)
        trainer.scheduler = build_scheduler(trainer.optimizer, trainer.schedule)
        trainer.optimizer.load_state_dict(_to_shards(opt_state, trainer.optimizer))  # lr and momentum as they were
        trainer.scheduler.load_state_dict(sched_state)
        trainer.state.parts.update(optimizer=trainer.optimizer, scheduler=trainer.scheduler)

    # -- the step and evaluation -----------------------------------------------------------------

    def forward_backward(self, trainer: TrainerView, batch: Batch, total: int, *,
                         last: bool) -> tuple[torch.Tensor, dict[str, float]]:
        assert self.wrapped is not None
        x, y = trainer.on_device(tuple(t.tensor_split(self.world)[self.rank] for t in batch))  # type: ignore[arg-type]
        self.wrapped.train(trainer.model.training)
        # DDP and FSDP2 average the N gradients; weighting each slice's mean by N times its share
        # of the step makes that average the gradient of the whole step's mean loss. Gradients
        # are synchronised on the step's last micro-batch only.
        if self.sharded:
            self.wrapped.set_requires_gradient_sync(last)  # type: ignore[operator]
            sync: Any = nullcontext()
        else:
            sync = nullcontext() if last else self.wrapped.no_sync()  # type: ignore[operator]
        with sync:
            share, sums = backward_share(trainer, self.wrapped, x, y, x.shape[0] * self.world / total)
        return share / self.world, sums

    def apply(self, trainer: TrainerView) -> None:
        super().apply(trainer)
        assert self.model is not None
        average_buffers(self.model)

    def all_sum(self, sums: Mapping[str, float], loss: torch.Tensor) -> tuple[dict[str, float], float]:
        summed, (value,) = self._all_sum(sums, [float(loss)])
        return summed, value

    def eval_sums(self, trainer: TrainerView, batch: Batch) -> dict[str, float]:
        """This rank's slice of the test batch, its sums added over the ranks."""
        x, y = (t.tensor_split(self.world)[self.rank] for t in batch)
        empty = x.shape[0] == 0
        if empty:  # a sharded model needs every rank in every forward: run one sample, count none
            x, y = batch[0][:1], batch[1][:1]
        x, y = trainer.on_device((x, y))
        with trainer.autocast():
            output = trainer.model(x)
        mine = trainer.task.batch_sums(output, y)
        if empty:
            mine = {k: 0.0 for k in mine}
        return self._all_sum(mine, [])[0]

    def agree_stop(self, signum: int | None) -> int | None:
        flag = torch.tensor([signum or 0], dtype=torch.int64, device=self._collective_device())
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return int(flag) or None

    def _all_sum(self, sums: Mapping[str, float], values: list[float]) -> tuple[dict[str, float], list[float]]:
        """Sum the task's sums (the same keys on every rank) and plain numbers over the ranks."""
        keys = sorted(sums)
        flat = torch.tensor([float(sums[k]) for k in keys] + values, dtype=torch.float64,
                            device=self._collective_device())
        dist.all_reduce(flat)
        out = flat.cpu().tolist()
        return dict(zip(keys, out[: len(keys)])), out[len(keys):]

    def _collective_device(self) -> torch.device:
        return torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")

    # -- files ---------------------------------------------------------------------------------

    def checkpoint_store(self, trainer: TrainerView) -> FolderStore:
        return FolderStore(trainer)

    def saved(self) -> None:
        dist.barrier()


def average_buffers(model: torch.nn.Module) -> None:
    """Every persistent floating-point buffer of ``model`` becomes its mean over the processes of
    the default group; buffers that every process holds alike stay exactly as they are (any
    number of processes, any dtype). Non-persistent buffers (constants such as rotary
    frequencies, which no checkpoint holds) are left alone.

    Batch norm's running statistics are linear in each micro-batch's statistics, so the running
    mean becomes the one a single process tracks on the whole batch (equal slices), the running
    variance the mean of the processes' own.
    """
    buffers = _persistent_float_buffers(model)
    if not buffers:
        return
    # The mean is rank 0's value plus the mean of the deviations from it, in float64: buffers held
    # alike deviate by exactly 0 (a plain sum of N equal float64 values, divided by N, is not exact).
    flat = torch.cat([b.detach().reshape(-1).to(torch.float64) for b in buffers])
    ref = flat.clone()
    dist.broadcast(ref, src=0)
    flat -= ref
    dist.all_reduce(flat)
    flat /= dist.get_world_size()
    flat += ref
    for b, value in zip(buffers, flat.split([b.numel() for b in buffers]), strict=True):
        b.copy_(value.view_as(b))


def _persistent_float_buffers(model: torch.nn.Module) -> list[torch.Tensor]:
    """The floating-point buffers a state dict holds, each once, in a fixed order."""
    out: list[torch.Tensor] = []
    seen: set[int] = set()
    for module in model.modules():
        for name, b in module._buffers.items():
            if (b is None or not b.is_floating_point() or name in module._non_persistent_buffers_set
                    or id(b) in seen):
                continue
            seen.add(id(b))
            out.append(b)
    return out


def _to_shards(state: dict[str, Any], optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """A whole optimizer state dict, its per-parameter tensors cut like the (sharded) parameters."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    params = [p for group in optimizer.param_groups for p in group["params"]]
    out = {}
    for i, s in state["state"].items():
        p = params[int(i)]
        out[i] = {k: distribute_tensor(v.to(p.device), p.device_mesh, p.placements)
                  if isinstance(p, DTensor) and isinstance(v, torch.Tensor) and v.shape == p.shape else v
                  for k, v in s.items()}
    return {"state": out, "param_groups": state["param_groups"]}
