"""Data-parallel training runs: the :class:`~revtrain.train.Trainer` on N processes (DDP or FSDP2).

``revtrain train --data-parallel N`` starts N local processes (gloo on CPU, NCCL on CUDA,
``env://`` rendezvous, so ``torchrun --nproc-per-node N -m revtrain.cli train --data-parallel N``
works too). Every process runs :class:`DataParallelTrainer`, the ordinary trainer with three
seams changed:

- **The step.** Every process reads the same batch of ``--batch-size`` samples (the loaders
  are seeded alike, so data order, augmentation and resume positions are the single-process
  run's) and trains on its own slice of it (``tensor_split``: sizes differ by at most one).
  Each slice's mean loss is scaled by ``slice * N / batch`` so that DDP's average of the N
  gradients is the gradient of the whole batch's mean loss: the update equals one process on
  the same batch (up to the order of float additions; batch norm normalises each slice with
  its own statistics, as DDP always does). The loss and the task's sums are all-reduced, so
  the metrics, the progress and the divergence check are the whole batch's on every rank.
- **Evaluation**: each rank evaluates its slice of every test batch; the sums are all-reduced.
- **Files**: rank 0 writes the run folder (``config.json``, ``metrics.jsonl``, the checkpoint,
  ``summary.json``, the memory report) by the trainer's own rules; the other ranks write
  nothing. A checkpoint holds the *whole* model and optimizer state in the single-process
  format (with ``--shard`` the shards are gathered first), so a data-parallel run can be
  resumed with any number of processes, or none.

With ``--shard`` the model is sharded with FSDP2 (``fully_shard`` per reversible block, then
the whole model; :func:`~revtrain.parallel.data_parallel.shard`): every process keeps 1/N of the
parameters, gradients and optimizer state. The step memory report is skipped under ``--shard``
(it would run one process's step alone).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from revtrain.parallel.data_parallel import full_state_dict, replicate, shard
from revtrain.parallel.distributed import check_backend, init_from_env
from revtrain.parallel.errors import PipelineConfigError
from revtrain.parallel.launch import check_port, free_port, reporting_to_launcher, start_workers, watch
from revtrain.train import Trainer
from revtrain.train.checkpoint import non_finite_entries, save_checkpoint
from revtrain.train.divergence import TrainingDivergedError
from revtrain.train.environment import resolve_device
from revtrain.train.optim import build_optimizer, build_scheduler
from revtrain.train.resume import ResolvedRun, resolve_run
from revtrain.train.trainer import Batch

__all__ = ["DataParallelTrainer", "launch_data_parallel", "run_data_parallel_rank", "UNSUPPORTED"]

UNSUPPORTED = {
    "budget": "planning profiles one process; plan first with `revtrain plan` and pass --mode, or train without --data-parallel",
    "plan": "pass the plan's mode with --mode, or train without --data-parallel",
    "grad_angle_every": "the monitor measures one process's step; run it without --data-parallel",
}
"""``revtrain train`` options that a data-parallel run refuses, and what to do instead."""


class _NoMetrics:
    """The metrics file of a rank other than 0: it writes nothing."""

    def write(self, event: str, **fields: Any) -> None:
        pass

    def close(self) -> None:
        pass


class DataParallelTrainer(Trainer):
    """The :class:`~revtrain.train.Trainer` as one of N data-parallel processes (module docstring).

    Args:
        run: The resolved run (the same on every rank).
        sharded: FSDP2 instead of DDP.
        out: Where rank 0's log lines go.
    """

    def __init__(self, run: ResolvedRun, *, sharded: bool = False, out: Any = None) -> None:
        if not dist.is_initialized():
            raise PipelineConfigError("DataParallelTrainer needs an initialised process group (init_from_env)")
        self.rank, self.world, self.sharded = dist.get_rank(), dist.get_world_size(), sharded
        super().__init__(run, out=out)
        self._check_slices()
        if sharded:
            self._shard()
            self.wrapped: torch.nn.Module = self.model
        else:
            self.wrapped = replicate(self.model, self.device if self.device.type == "cuda" else None)
        what = "FSDP2, parameters sharded" if sharded else "DDP"
        self._log(f"data parallel: {self.world} processes ({what}), each on 1/{self.world} of every batch of "
                  f"{self.config.batch_size}")

    # -- set-up ------------------------------------------------------------------------------

    def _open_run(self, run: ResolvedRun) -> None:
        if self.rank == 0:
            super()._open_run(run)
            return
        if run.state is not None:  # the same restore as rank 0, writing nothing
            from revtrain.train.optim import apply_hyperparameters

            self.state.restore(run.state, run.checkpoint)
            apply_hyperparameters(self.optimizer, self.scheduler, self.schedule, lr=self.config.lr,
                                  momentum=self.config.momentum, nesterov=self.config.nesterov,
                                  weight_decay=self.config.weight_decay)
        if run.state is None or run.strategy_changed:
            from revtrain.core import set_modes

            set_modes(self.model, self.config.mode)
        self.metrics = _NoMetrics()  # type: ignore[assignment]

    def _check_slices(self) -> None:
        sizes = {self.config.batch_size}
        rest = self.data_info.train_size % self.config.batch_size
        if rest and self.steps_per_epoch == len(self.train_loader):
            sizes.add(rest)
        small = min(sizes)
        if small < self.world:
            raise PipelineConfigError(
                f"a training batch of {small} samples cannot be shared by {self.world} processes (each needs "
                f"at least one); use --batch-size of at least {self.world}"
                + (f" and one that leaves no last batch below {self.world} ({self.data_info.train_size} samples), "
                   "or --max-steps-per-epoch to skip it" if rest and small == rest else "")
            )

    def _shard(self) -> None:
        """Shard the model (already restored on resume) and move the optimizer onto the shards."""
        opt_state, sched_state = self.optimizer.state_dict(), self.scheduler.state_dict()
        shard(self.model, per_block=True)
        c = self.config
        self.optimizer = build_optimizer(self.model, lr=c.lr, momentum=c.momentum, nesterov=c.nesterov,
                                         weight_decay=c.weight_decay, kind=c.optimizer)
        self.scheduler = build_scheduler(self.optimizer, self.schedule)
        self.optimizer.load_state_dict(_to_shards(opt_state, self.optimizer))  # lr and momentum as they were
        self.scheduler.load_state_dict(sched_state)
        self.state.parts.update(optimizer=self.optimizer, scheduler=self.scheduler)

    # -- the step and evaluation -----------------------------------------------------------------

    def forward_backward(self, batch: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, dict[str, float]]:
        x, y = batch
        total = x.shape[0]
        x = x.tensor_split(self.world)[self.rank].to(self.device, non_blocking=True)
        y = y.tensor_split(self.world)[self.rank].to(self.device, non_blocking=True)
        self.wrapped.train(self.model.training)
        with self._autocast():
            output = self.wrapped(x)
            loss = self.task.loss(output, y)
        # DDP averages the N gradients; weighting each slice's mean by its share of the batch
        # makes that average the gradient of the whole batch's mean loss.
        scaled = loss * (x.shape[0] * self.world / total)
        (self.scaler.scale(scaled) if self.scaler is not None else scaled).backward()
        sums = self.task.batch_sums(output.detach(), y, loss.detach())
        weighted = loss.detach().double().reshape(1) * x.shape[0]
        sums, (loss_sum,) = self._all_sum(sums, [weighted])
        return (loss_sum / total).to(loss.dtype).reshape(()), sums

    def _eval_sums(self, batch: Batch) -> dict[str, float]:
        """This rank's slice of the test batch, its sums added over the ranks."""
        x, y = (t.tensor_split(self.world)[self.rank] for t in batch)
        empty = x.shape[0] == 0
        if empty:  # a sharded model needs every rank in every forward: run one sample, count none
            x, y = batch[0][:1], batch[1][:1]
        x, y = x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)
        with self._autocast():
            output = self.model(x)
        mine = self.task.batch_sums(output, y)
        if empty:
            mine = {k: 0.0 for k in mine}
        return self._all_sum(mine, [])[0]

    def _all_sum(self, sums: Mapping[str, float], tensors: list[torch.Tensor]) -> tuple[dict[str, float], list[torch.Tensor]]:
        """Sum the task's sums (the same keys on every rank) and 1-element tensors over the ranks."""
        keys = sorted(sums)
        flat = torch.tensor([float(sums[k]) for k in keys] + [float(t) for t in tensors], dtype=torch.float64,
                            device=self._collective_device())
        dist.all_reduce(flat)
        values = flat.cpu().tolist()
        return dict(zip(keys, values[: len(keys)])), [torch.tensor(v, dtype=torch.float64) for v in values[len(keys):]]

    def _collective_device(self) -> torch.device:
        return self.device if dist.get_backend() == "nccl" else torch.device("cpu")

    # -- files ---------------------------------------------------------------------------------

    def save_checkpoint(self, path: str | os.PathLike[str] | None = None) -> Path:
        if self._phase == "step":
            raise RuntimeError("cannot checkpoint in the middle of a training step")
        state = self.state.capture(self.config)
        if self.sharded:  # gather the shards: the checkpoint has the single-process format
            state["model"] = {k: v.cpu() for k, v in full_state_dict(self.model).items()}
            state["optimizer"] = _full_optimizer_state(state["optimizer"])
        bad = non_finite_entries(state["model"])
        if bad:  # every rank sees the same weights, so every rank stops here
            raise TrainingDivergedError(
                f"the weights turned NaN or infinite by step {self.step} ({', '.join(bad[:3])}); no checkpoint "
                f"was written, and {self._kept_checkpoint()}. Lower --lr (now {self.config.lr:g}) or "
                "lengthen --warmup-epochs, then start again"
            )
        target = Path(path) if path is not None else self.checkpoint_path
        if self.rank == 0:
            save_checkpoint(state, target)
        dist.barrier()
        return target

    def _summarize(self) -> dict[str, Any]:
        if self.rank != 0:
            return {"rank": self.rank}
        if self.sharded and self.config.memory_report:
            self._log("note: no step memory report under --shard (it would run one process's step alone)")
            self.config = replace(self.config, memory_report=False)
        return super()._summarize()

    def _discard_if_unsaved(self, *, say: bool) -> None:
        if self.rank == 0:
            super()._discard_if_unsaved(say=say)

    def _bar_disabled(self) -> bool:
        return self.rank != 0 or super()._bar_disabled()

    def _log(self, message: str, *, err: bool = False) -> None:
        if self.rank == 0:
            super()._log(message, err=err)
        elif err:
            super()._log(f"[rank {self.rank}] {message}", err=True)


def _full_optimizer_state(state: dict[str, Any]) -> dict[str, Any]:
    """An optimizer state dict with every sharded tensor gathered (a collective: every rank calls it)."""
    full = {i: {k: _whole(v) for k, v in s.items()} for i, s in sorted(state["state"].items())}
    return {"state": full, "param_groups": state["param_groups"]}


def _whole(value: Any) -> Any:
    return value.full_tensor().cpu() if hasattr(value, "full_tensor") else value


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


# -- launching ---------------------------------------------------------------------------------


def launch_data_parallel(given: Mapping[str, Any], world: int, *, sharded: bool = False, backend: str = "auto",
                         port: int = 0, timeout: float = 60.0, worker_output: Any = None) -> Path:
    """Train the run of ``given`` (``revtrain train`` options) on ``world`` local processes.

    Everything that can be checked is checked here, before any process starts: the options
    and the run folder (:func:`~revtrain.train.resolve_run`: a folder holding another run, a
    checkpoint that does not fit), the backend for the device, the rendezvous port.

    Returns:
        The run folder.

    Raises:
        StageFailedError: a process failed; the others were stopped (names the rank and the cause).
    """
    _refuse_unsupported(given)
    run = resolve_run(dict(given))
    device = resolve_device(run.config.device)
    check_backend(backend, device)
    if port:
        check_port(port)
    worker_given = {**given, "run_dir": str(run.run_dir),
                    "threads": given.get("threads") or max(1, (os.cpu_count() or 1) // world)}
    if run.checkpoint is not None:
        worker_given["resume"] = str(run.checkpoint)
    with tempfile.TemporaryDirectory(prefix="revtrain-dp-") as scratch:
        config = Path(scratch) / "launch.json"
        config.write_text(json.dumps({"given": worker_given, "world": world, "sharded": sharded,
                                      "backend": backend, "timeout": timeout}, default=list))
        procs = start_workers(["-m", "revtrain.parallel.replicas", "--worker-config", str(config)], world,
                              port=port or free_port(), threads=worker_given["threads"],
                              errors=Path(scratch) / "errors", output=worker_output)
        watch(procs, Path(scratch) / "errors", role="rank", run="data-parallel run")
    return run.run_dir


def run_data_parallel_rank(given: Mapping[str, Any], world: int | None = None, *, sharded: bool = False,
                           backend: str = "auto", timeout: float = 60.0) -> dict[str, Any]:
    """What every process runs (started by :func:`launch_data_parallel` or torchrun): join the
    group, resolve the run (rank 0 picks the folder and the checkpoint), train."""
    _refuse_unsupported(given)
    device = resolve_device(given.get("device", "auto"))
    if device.type == "cuda":
        local = int(os.environ.get("LOCAL_RANK", 0)) % torch.cuda.device_count()
        torch.cuda.set_device(local)
    rank, size = init_from_env(check_backend(backend, device), timeout)
    try:
        if world is not None and size != world:
            raise PipelineConfigError(f"{size} processes joined for --data-parallel {world}; start {world} "
                                      f"processes or pass --data-parallel {size}")
        box = [None]
        if rank == 0:  # one folder and one checkpoint for every rank
            run = resolve_run(dict(given))
            box = [{"run_dir": str(run.run_dir), "resume": str(run.checkpoint) if run.checkpoint else None}]
        dist.broadcast_object_list(box, src=0)
        mine = {**given, **{k: v for k, v in box[0].items() if v is not None}}  # type: ignore[union-attr]
        if box[0]["resume"] is None:  # type: ignore[index]
            mine.pop("resume", None)
        run = resolve_run(mine) if rank != 0 else run
        dist.barrier()
        trainer = DataParallelTrainer(run, sharded=sharded)
        return trainer.fit()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _refuse_unsupported(given: Mapping[str, Any]) -> None:
    for name, fix in UNSUPPORTED.items():
        if given.get(name) not in (None, 0):
            raise PipelineConfigError(f"--{name} is not available with --data-parallel: {fix}")


def _main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m revtrain.parallel.replicas")
    parser.add_argument("--worker-config", required=True)
    args = parser.parse_args(argv)
    with reporting_to_launcher():
        data = json.loads(Path(args.worker_config).read_text())
        given = dict(data["given"])
        if "milestones" in given:
            given["milestones"] = tuple(given["milestones"])
        run_data_parallel_rank(given, data["world"], sharded=data["sharded"], backend=data["backend"],
                               timeout=data["timeout"])
    return 0


if __name__ == "__main__":
    sys.exit(_main())
