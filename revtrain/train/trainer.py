"""The Trainer: builds data, model, task and optimizer from a resolved run and runs ``fit()``.

The Trainer owns the run (config, folder, epochs, evaluation, metrics, checkpoints,
interrupts, resume, the memory report); an :class:`~revtrain.train.engine.Engine` owns how the
micro-batches of one step become an update and how the processes of a run agree (one process:
:class:`~revtrain.train.engine.LocalEngine`; DDP and FSDP2: :mod:`revtrain.parallel.replicas`;
PETRA's stages: :mod:`revtrain.parallel.petra_engine`). The loop never asks which engine it has.

A step (:meth:`Trainer.train_step`) takes ``accumulation`` micro-batches: the engine's
:meth:`~revtrain.train.engine.Engine.step` runs them (for the gradient engines,
:meth:`Trainer.forward_backward` runs the model and the task's loss and backpropagates each
micro-batch's share of the step's mean loss, so gradients accumulate), the loss is checked for
divergence, then the engine applies the update (:meth:`Trainer.optimizer_step`) and the
schedule, which counts optimizer steps, moves on. What is learnt (loss, metrics, their
formatting, the example batch of the memory report) comes from a :class:`~revtrain.tasks.Task`.

The loop follows :mod:`revtrain.data.loader`: the training loader knows its position, every
other piece of state is in :class:`~revtrain.train.state.TrainingState`, and
:meth:`Trainer.save_checkpoint` writes all of it between two steps, through the engine's
checkpoint store (:mod:`revtrain.train.checkpoint_store`: ``checkpoint.pt``, or one
``torch.distributed.checkpoint`` folder per saved step), so a resumed run (mid-epoch
too) computes exactly what the uninterrupted run would have (bit for bit on CPU; PETRA's engine
drains its pipeline before a checkpoint inside an epoch, so there from an epoch's end).

Ctrl-C or SIGTERM asks the loop to stop after the current step; it then saves a checkpoint,
prints how to resume and raises :class:`TrainingInterrupted`. A second signal aborts at once.
A diverging run (see :mod:`revtrain.train.divergence`) stops with
:class:`~revtrain.train.divergence.TrainingDivergedError` before the bad update; a run that
fails before its first checkpoint leaves no folder behind.
"""

from __future__ import annotations

import copy
import json
import math
import os
import shutil
import signal
import sys
import time
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path
from typing import Any, TextIO

import torch
from tqdm.auto import tqdm

from revtrain.core import get_modes, set_rebuild_checks
from revtrain.data import build_dataloaders
from revtrain.memory import format_bytes
from revtrain.tasks import add_sums
from revtrain.compilation import compile_model
from revtrain.train.build import build_model, fit_model_to_data, text_window
from revtrain.train.checkpoint_folder import run_dir_of
from revtrain.train.config import ConfigError, TrainConfig
from revtrain.train.divergence import TrainingDivergedError, divergence_reason
from revtrain.train.engine import Engine, LocalEngine
from revtrain.train.environment import busy_cpu_note, resolve_device, seed_everything
from revtrain.train.files import atomic_write_text
from revtrain.train.interrupts import StopSignals, TrainingInterrupted
from revtrain.train.loggers import open_sinks, write_curves
from revtrain.train.grad_angle import GradAngleMonitor
from revtrain.train.memory_strategy import apply_memory_strategy
from revtrain.train.metrics import EpochStats, MetricsWriter, live_memory, measure_step_memory
from revtrain.train.optim import (
    LRSchedule,
    apply_hyperparameters,
    build_optimizer,
    build_scheduler,
    optimizer_factory,
)
from revtrain.train.resume import ResolvedRun, resolve_run
from revtrain.train.runs import RunFolder
from revtrain.train.state import Progress, TrainingState

__all__ = ["Trainer"]

Callback = Callable[["Trainer"], None]
"""Called as ``callback(trainer)`` after every optimizer step."""
Batch = tuple[torch.Tensor, torch.Tensor]


_DISCARDED = {
    "removed": "the run folder {} was removed",
    "cleared": "this run's files were removed from {}",
    "restored": "this run's files were removed and the run that --overwrite replaced is back in {}",
}
"""What a run that saved no checkpoint left of its folder (``RunFolder.discard``)."""


class Trainer:
    """Train one model on one dataset as a resolved run says.

    Args:
        run: A :class:`~revtrain.train.resume.ResolvedRun` (what ``revtrain train`` passes), or
            a complete :class:`TrainConfig`, resolved here (with ``resume`` set, the checkpoint
            must fit it).
        model: Your own model object to train instead of building ``config.model``, which then
            only names it in the run's records (``Trainer(TrainConfig(model="my-net"), model=net)``);
            it must take the dataset's inputs as they are. Resume such a run with the same
            architecture given again.
        callbacks: Called as ``callback(trainer)`` after every optimizer step, when the
            trainer's state is consistent (a callback may read ``trainer.step``, save, or raise).
        out: Where log lines go (default: standard output).
        engine: How a step happens (default: :class:`~revtrain.train.engine.LocalEngine`,
            this process alone).
    """

    def __init__(self, run: TrainConfig | ResolvedRun, *, model: torch.nn.Module | None = None,
                 callbacks: Sequence[Callback] = (), out: TextIO | None = None, engine: Engine | None = None):
        self.engine: Engine = engine if engine is not None else LocalEngine()
        self.callbacks = list(callbacks)
        self.out = out if out is not None else sys.stdout
        run = run if isinstance(run, ResolvedRun) else resolve_run(run)
        config = self.config = run.config
        for note in run.notes:
            self._log(note)
        self.device = resolve_device(config.device)
        if config.amp == "fp16" and self.device.type != "cuda":
            raise ConfigError(f"--amp fp16 needs CUDA (its gradient scaler) and this run is on {self.device}; "
                              "use --amp bf16 on the CPU, or --device cuda")
        if self.device.type == "cuda" and self.device.index is not None:
            torch.cuda.set_device(self.device)  # what allocates or measures without a device uses this GPU
        if config.threads is not None:
            torch.set_num_threads(config.threads)
        seed_everything(config.seed)
        self.train_loader, self.test_loader, self.data_info = build_dataloaders(
            config.dataset, batch_size=config.batch_size, eval_batch_size=config.eval_batch_size,
            data_dir=config.data_dir, seed=config.seed, num_workers=config.num_workers,
            augment=config.augment, image_size=config.image_size, pin_memory=self.device.type == "cuda",
            **text_window(config),
        )
        fit = fit_model_to_data(config.model, config.task, self.data_info, self.first_batch()[0])
        self.task, self.input_spec = fit.task, fit.spec
        self.model = (model if model is not None else build_model(config.model, fit.overrides)).to(self.device)
        if config.check_every is not None:  # before planning: profiles see the check's cost
            set_rebuild_checks(self.model, config.check_every)
        self.compiled = compile_model(self.model) if config.compile else []
        self.grad_angles = self._grad_angle_monitor()
        self.optimizer = build_optimizer(self.model, lr=config.lr, momentum=config.momentum,
                                         nesterov=config.nesterov, weight_decay=config.weight_decay,
                                         kind=config.optimizer)
        batches, k = len(self.train_loader), config.accumulation
        self.batches_per_epoch = min(batches, (config.max_steps_per_epoch or batches) * k)
        """Micro-batches read per epoch (``accumulation`` per optimizer step; the last step may have fewer)."""
        self.steps_per_epoch = -(-self.batches_per_epoch // k)
        self.schedule = LRSchedule(
            total_steps=config.epochs * self.steps_per_epoch,
            warmup_steps=round(config.warmup_epochs * self.steps_per_epoch),
            kind=config.schedule, milestones=config.milestones, gamma=config.gamma,
        )
        self.scheduler = build_scheduler(self.optimizer, self.schedule)
        self.scaler = torch.amp.GradScaler("cuda") if config.amp == "fp16" else None
        self.progress = Progress()
        self.state = TrainingState(
            model=self.model, model_name=config.model, data_info=self.data_info, task_name=self.task.name,
            parts={"optimizer": self.optimizer, "scheduler": self.scheduler, "scaler": self.scaler,
                   "train_loader": self.train_loader, "progress": self.progress},
        )
        self.run_dir = run.run_dir
        self.folder = RunFolder(run.run_dir)
        self.checkpoint_path = self.folder.checkpoint_path
        self.checkpoints = self.engine.checkpoint_store(self)
        self.plan: Any = None
        self.last_loss = float("nan")
        self._memory: tuple[int | None, str] = (None, "")
        self._phase = "idle"  # "step" while an update is half-done: nothing may be saved then
        self._stop = StopSignals(log=lambda line: self._log(line, err=True))
        self._this_process = EpochStats()  # this process's training: samples and seconds
        self._process_peak: tuple[int, str] = (0, "")
        self._steps_at_start = 0
        self.metrics: MetricsWriter | None = None
        if self.engine.writes_files:
            self.folder.open(log=self._log)
        self.num_params = sum(p.numel() for p in self.model.parameters())
        """Parameters of the whole model (an engine may keep only a part of them in this process)."""
        self.resumed_state = run.state
        """The checkpoint resumed from (read by the engine's ``attach``; None afterwards)."""
        try:
            self._open_run(run)
            self.engine.attach(self)
            if run.state is not None:  # a checkpoint folder's model and optimizer load into the attached ones
                self.state.restore_tensors(run.state, run.checkpoint)
            self.resumed_state = None
        except BaseException:
            self._discard_if_unsaved(say=False)  # the user never saw this folder
            raise

    def _open_run(self, run: ResolvedRun) -> None:
        if run.state is None and self.config.overwrite and self.engine.writes_files:  # --overwrite: the old run's files go first
            self.folder.replace_run(keep=(self.config.plan,) if self.config.plan else (), log=self._log,
                                    writes_plan=self.config.plan is not None or self.config.budget is not None)
        if run.state is not None:
            self.state.restore(run.state, run.checkpoint)  # restores the block modes the run had
            apply_hyperparameters(self.optimizer, self.scheduler, self.schedule, lr=self.config.lr,
                                  momentum=self.config.momentum, nesterov=self.config.nesterov,
                                  weight_decay=self.config.weight_decay)
            self._log(f"resumed from {run.checkpoint}: epoch {self.train_loader.epoch + 1}, batch "
                      f"{self.train_loader.next_batch}, step {self.step}")
        if run.state is None or run.strategy_changed:
            self.plan = apply_memory_strategy(self.model, self.config, first_batch=self.first_batch,
                                              device=self.device, run_dir=self.run_dir, log=self._log,
                                              loss_fn=self.task.loss)
        if not self.engine.writes_files:
            self.metrics = _NoMetrics()
            return
        atomic_write_text(self.run_dir / "config.json", json.dumps(self.config.to_dict(), indent=2) + "\n")
        resumed = run.state is not None
        if resumed:
            _carry_history(run_dir_of(run.checkpoint), self.run_dir)
        self.metrics = MetricsWriter(self.run_dir / "metrics.jsonl", resume_step=self.step if resumed else None,
                                     redo_epoch=self.progress.pending_eval,
                                     sinks=open_sinks(self.run_dir, tensorboard=self.config.tensorboard,
                                                      resume_step=self.step if resumed else None))
        if resumed:
            self.metrics.write("resume", step=self.step, epoch=self.train_loader.epoch,
                               checkpoint=str(run.checkpoint), process=self.progress.processes + 1)
        if self.plan is not None:
            self.metrics.write("plan", step=self.step, summary=self.plan.summary())

    @property
    def step(self) -> int:
        """Optimizer steps taken so far (over all epochs and processes)."""
        return self.progress.step

    @property
    def history(self) -> list[dict[str, Any]]:
        """One record per evaluated epoch (the ``"epoch"`` lines of metrics.jsonl)."""
        return self.progress.history

    # ------------------------------------------------------------------ the loop

    def fit(self) -> dict[str, Any]:
        """Train to ``config.epochs``, evaluating after each epoch; returns the summary.

        Raises:
            TrainingInterrupted: after Ctrl-C or SIGTERM, once the checkpoint is saved.
            KeyboardInterrupt: a second signal, or a callback raising it (saved if between steps).
            TrainingDivergedError: the loss or the weights went non-finite or past the bound.
        """
        self.progress.start_process()
        self._steps_at_start = self.step
        self._log(self._header())
        note = busy_cpu_note(self.device)
        if note:
            self._log(note, err=True)
        try:
            with self._stop.installed():
                try:
                    while True:
                        if self.progress.pending_eval is not None:
                            self._finish_epoch()
                        if self.train_loader.epoch >= self.config.epochs:
                            break
                        self._train_epoch()
                    self.progress.stop_process()
                    self.save_checkpoint()  # the final one: it holds the whole process's wall time
                except KeyboardInterrupt as stop:
                    self._on_interrupt(stop)
                    raise
            return self._summarize()
        except BaseException:
            self._discard_if_unsaved(say=True)
            raise

    def _train_epoch(self) -> None:
        epoch, limit, k = self.train_loader.epoch, self.batches_per_epoch, self.config.accumulation
        if self.train_loader.next_batch >= limit:  # resumed with max_steps_per_epoch = the steps taken
            self.train_loader.set_epoch(epoch + 1)
            self.progress.pending_eval = epoch
            return
        self.model.train()
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        bar = tqdm(total=self.steps_per_epoch, initial=self.train_loader.next_batch // k, unit="step", leave=False,
                   desc=f"epoch {epoch + 1}/{self.config.epochs}", disable=self._bar_disabled(),
                   dynamic_ncols=True, file=sys.stderr)
        tick = time.perf_counter()
        group: list[Batch] = []
        try:
            self._phase = "step"
            for batch in self.train_loader:
                group.append(batch)
                done = self.train_loader.next_batch >= limit
                if len(group) < k and not done:
                    continue
                if self.grad_angles is not None and self.grad_angles.due(self.step + 1):
                    self._measure_grad_angles(group[0], epoch)
                    tick = time.perf_counter()  # the monitor is not training time
                loss, sums = self.train_step(*group)
                now = time.perf_counter()
                self._record_step(loss, sums, sum(self.task.samples(b[1]) for b in group), now - tick)
                tick, group = now, []
                if done:  # mark the epoch finished before anything can save the state
                    self.train_loader.set_epoch(epoch + 1)
                    self.progress.pending_eval = epoch
                self._phase = "idle"
                self._after_step(bar, epoch)
                if done:
                    break
                self._phase = "step"
                tick = time.perf_counter()  # callbacks and checkpoints are not training time
        finally:  # on an exception the phase stays as it was: _on_interrupt needs it
            bar.close()

    # ------------------------------------------------------------------ the step seam

    def train_step(self, *batches: Batch) -> tuple[float, dict[str, float]]:
        """One optimizer step on ``accumulation`` micro-batches (their gradients averaged, each
        weighted by its samples, as one batch of all of them): returns the step's mean loss and
        the task's sums over every micro-batch and process (NaN and the sums of what finished,
        when the engine's pipeline finished no micro-batch in this step).

        Raises:
            TrainingDivergedError: the loss diverged; the update was not applied.
        """
        loss, sums = self.engine.step(self, batches)
        sums, value = self.engine.all_sum(sums, loss)
        if value is not None:  # None: no micro-batch finished its loss in this step (a filling pipeline)
            self._check_divergence(value)
        self.engine.apply(self)
        return (float("nan") if value is None else value), sums

    def forward_backward(self, batch: Batch, *, total: int | None = None,
                         last: bool = True) -> tuple[torch.Tensor, dict[str, float]]:
        """Forward ``batch``, compute the task's loss and backpropagate (gradients accumulate).

        Args:
            batch: ``(inputs, targets)``.
            total: Samples of the whole step this batch is part of (default: this batch's):
                the batch backpropagates ``len(batch) / total`` of its mean loss.
            last: The step's last micro-batch (an engine may synchronise gradients now).

        Returns:
            This batch's share of the step's loss (detached; the batch's mean loss when it is
            the whole step) and the task's additive sums of the part of the batch this process
            ran (:meth:`~revtrain.tasks.Task.batch_sums`).
        """
        return self.engine.forward_backward(self, batch, len(batch[1]) if total is None else total, last=last)

    def optimizer_step(self) -> None:
        """Apply the accumulated gradients, advance the learning-rate schedule and the step count."""
        if self.config.grad_clip is not None:
            if self.scaler is not None:
                self.scaler.unscale_(self.optimizer)
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.config.grad_clip)
        if self.scaler is not None:
            self.scaler.step(self.optimizer)
            self.scaler.update()
        else:
            self.optimizer.step()
        self.advance_schedule()

    def advance_schedule(self) -> None:
        """Count one optimizer step: the learning-rate schedule and the step count move on."""
        self.scheduler.step()
        self.progress.step += 1

    @property
    def epoch_done(self) -> bool:
        """Whether the training loader has given the current epoch's last micro-batch."""
        return self.train_loader.next_batch >= self.batches_per_epoch

    def _check_divergence(self, loss: float) -> None:
        reason = divergence_reason(loss, self.progress.reference_loss, self.config.divergence_factor)
        if reason is None:
            if self.progress.reference_loss is None:
                self.progress.reference_loss = loss
            return
        step, epoch = self.step + 1, self.train_loader.epoch
        if self.metrics is not None:
            self.metrics.write("diverged", step=step, epoch=epoch, loss=loss, reason=reason)
        raise TrainingDivergedError(
            f"training diverged at step {step} (epoch {epoch + 1}): {reason}; this batch's update was not "
            f"applied, and {self._kept_checkpoint()}. Lower --lr (now {self.config.lr:g}) or lengthen "
            "--warmup-epochs, then start again"
        )

    # ------------------------------------------------------------------ gradient angle monitor

    def _grad_angle_monitor(self) -> GradAngleMonitor | None:
        if not self.config.grad_angle_every:
            return None
        try:
            return GradAngleMonitor(self.config.grad_angle_every, self.model, self.task.loss,
                                    context=self._autocast)
        except ValueError as err:
            raise ConfigError(str(err)) from None

    def _measure_grad_angles(self, batch: Batch, epoch: int) -> None:
        """Stored- vs rebuilt-activation gradients on the batch of the coming update (RevNet §5.2)."""
        assert self.grad_angles is not None and self.metrics is not None
        x, y = self._on_device(batch)
        result = self.grad_angles.measure((x, y))
        self.metrics.write("grad_angle", step=self.step + 1, epoch=epoch, **result.to_record())

    # ------------------------------------------------------------------ records

    def _record_step(self, loss: float, sums: dict[str, float], samples: int, seconds: float) -> None:
        self.last_loss = loss
        self.progress.epoch.add(sums, samples, seconds)
        self._this_process.add({}, samples, seconds)
        self.progress.train_time_s += seconds
        self.progress.samples_seen += samples
        self._memory = live_memory(self.device)
        self.progress.note_memory(self._memory)
        if self._memory[0] is not None and self._memory[0] > self._process_peak[0]:
            self._process_peak = (self._memory[0], self._memory[1])

    def _after_step(self, bar: Any, epoch: int) -> None:
        stats, lr = self.progress.epoch, self.optimizer.param_groups[0]["lr"]
        running = self.task.summarize(stats.sums)
        mem_bytes, mem_kind = self._memory
        if self.step % self.config.log_every == 0:
            assert self.metrics is not None
            self.metrics.write("step", step=self.step, epoch=epoch,
                               loss=None if math.isnan(self.last_loss) else self.last_loss,
                               **{k: v for k, v in running.items() if k != "loss"}, lr=lr,
                               samples_per_s=stats.throughput, memory_bytes=mem_bytes, memory_kind=mem_kind)
        if not bar.disable:
            bar.set_postfix_str(f"{self.task.format({**running, 'loss': self.last_loss})} lr {lr:.3g} "
                                f"{stats.throughput:.0f} samples/s {mem_kind} {format_bytes(mem_bytes or 0)}",
                                refresh=False)
            bar.update(1)
        if self.config.checkpoint_every and self.step % self.config.checkpoint_every == 0:
            self.save_checkpoint()
        for callback in self.callbacks:
            callback(self)
        self._check_stop()

    def _check_stop(self) -> None:
        """Stop here if any process of the run was asked to (every process then stops at this point)."""
        self._stop.check_agreed(self.engine.agree_stop)

    def _finish_epoch(self) -> None:
        epoch = self.progress.pending_eval
        assert epoch is not None and self.metrics is not None
        self._phase = "eval"
        test = self.evaluate()
        stats = self.progress.epoch
        train = self.task.summarize(stats.sums)
        mem_bytes, mem_kind = self._process_peak
        record = {
            "epoch": epoch, "step": self.step, **{f"train_{k}": v for k, v in train.items()},
            **{f"test_{k}": v for k, v in test.items()}, "lr": self.optimizer.param_groups[0]["lr"],
            "samples_per_s": stats.throughput, "epoch_train_time_s": stats.seconds,
            "memory_bytes": mem_bytes, "memory_kind": mem_kind,
        }
        self.progress.history.append(record)
        self.metrics.write("epoch", **record)
        self._log(
            f"epoch {epoch + 1:>{len(str(self.config.epochs))}}/{self.config.epochs}  "
            f"train {self.task.format(train)}  test {self.task.format(test)}  lr {record['lr']:.3g}  "
            f"{stats.throughput:.0f} samples/s  {mem_kind} {format_bytes(mem_bytes)}  {stats.seconds:.1f}s"
        )
        self.progress.pending_eval = None
        self.progress.epoch = EpochStats()
        if self.train_loader.epoch < self.config.epochs:  # after the last epoch, fit() saves
            self.save_checkpoint()
        self._phase = "idle"

    @torch.no_grad()
    def evaluate(self) -> dict[str, float]:
        """The task's metrics on the test split (changes no training state)."""
        was_training = self.model.training
        self.model.eval()
        self.test_loader.set_epoch(0)
        sums: dict[str, float] = {}
        try:
            for batch in self.test_loader:
                add_sums(sums, self._eval_sums(batch))
                self._check_stop()
        finally:
            self.model.train(was_training)
        return self.task.summarize(sums)

    def _eval_sums(self, batch: Batch) -> dict[str, float]:
        """The task's sums over one test batch (what :meth:`evaluate` adds up)."""
        return self.engine.eval_sums(self, batch)

    # ------------------------------------------------------------------ checkpoints

    def save_checkpoint(self, path: str | os.PathLike[str] | None = None) -> Path:
        """Write the training state atomically; returns the path.

        The engine first settles what is in flight; by default the state goes where the engine's
        checkpoint store puts it: ``<run_dir>/checkpoint.pt`` for one process and for PETRA (the
        stages gathered on rank 0), ``<run_dir>/checkpoints/step-<step>/`` for a data-parallel run.

        Raises:
            TrainingDivergedError: the weights hold NaN or infinity; the previous checkpoint is kept.
            DiskFullError: no space left; the previous checkpoint is kept.
        """
        if self._phase == "step":
            raise RuntimeError("cannot checkpoint in the middle of a training step")
        self.engine.settle(self)
        state, bad = self.checkpoints.prepare(self.state.capture(self.config))
        if bad:  # every process sees the same weights, so every process stops here
            raise TrainingDivergedError(
                f"the weights turned NaN or infinite by step {self.step} ({', '.join(bad[:3])}); no checkpoint "
                f"was written, and {self._kept_checkpoint()}. Lower --lr (now {self.config.lr:g}) or "
                "lengthen --warmup-epochs, then start again"
            )
        saved = self.checkpoints.save(state, path)
        if self.engine.writes_files:
            self.folder.release_replaced()  # the run --overwrite set aside is replaced now
        return saved

    def _kept_checkpoint(self) -> str:
        latest = self.checkpoints.latest()
        if latest is not None:
            return f"the last checkpoint, {latest}, is kept"
        return "no checkpoint had been saved yet"

    def _on_interrupt(self, stop: KeyboardInterrupt) -> None:
        if self._phase == "step":
            latest = self.checkpoints.latest()
            where = f"{latest} is untouched" if latest is not None else "none was saved"
            self._log(f"aborted inside a training step at step {self.step}: no checkpoint written "
                      f"(the last one, {where})", err=True)
            return
        path = self.save_checkpoint()
        by = signal.Signals(stop.signum).name if isinstance(stop, TrainingInterrupted) else "SIGINT"
        assert self.metrics is not None
        self.metrics.write("interrupt", step=self.step, checkpoint=str(path), signal=by)
        cause = "terminated (SIGTERM)" if by == "SIGTERM" else "interrupted"
        self._log(f"{cause} at step {self.step} (epoch {self.train_loader.epoch + 1}, batch "
                  f"{self.train_loader.next_batch}); checkpoint saved to {path}\n"
                  f"resume with: revtrain train --resume {path}", err=True)

    def _discard_if_unsaved(self, *, say: bool) -> None:
        """A run that fails before its first checkpoint leaves nothing to resume: remove its files."""
        if self.metrics is not None:
            self.metrics.close()
        outcome = self.folder.discard() if self.engine.writes_files else None
        if outcome is not None and (say or outcome == "restored"):  # the user was told it was set aside
            self._log(f"no checkpoint was saved, so {_DISCARDED[outcome].format(self.run_dir)}", err=True)

    # ------------------------------------------------------------------ modes and summary

    def first_batch(self) -> Batch:
        """Batch 0 of epoch 0 of the training loader, without moving the loader."""
        probe = copy.copy(self.train_loader)
        probe.set_epoch(0)
        return next(iter(probe))

    def _summarize(self) -> dict[str, Any]:
        extra, extra_lines = self.engine.report(self)  # every process: it may gather
        if not self.engine.writes_files:
            return {}
        p, this = self.progress, self._this_process
        last = p.history[-1] if p.history else {}
        names = list(self.task.summarize({}))
        this_process = {
            "steps": p.step - self._steps_at_start, "wall_time_s": round(p.process_wall_time_s, 3),
            "train_time_s": round(this.seconds, 3), "samples_per_s": this.throughput or None,
            "train_peak_memory_bytes": self._process_peak[0] or None,
            "train_peak_memory_kind": self._process_peak[1] or None,
        }
        summary: dict[str, Any] = {
            "model": self.config.model, "dataset": self.config.dataset, "task": self.task.name,
            "headline": self.task.headline, "device": str(self.device), "epochs": self.config.epochs,
            "steps": p.step,
            **{f"test_{k}": last.get(f"test_{k}") for k in names},
            **{f"train_{k}": last.get(f"train_{k}") for k in names},
            "wall_time_s": round(p.wall_time_s, 3), "train_time_s": round(p.train_time_s, 3),
            "samples_per_s": p.samples_seen / p.train_time_s if p.train_time_s else None,
            "train_peak_memory_bytes": p.peak_memory[0], "train_peak_memory_kind": p.peak_memory[1],
            "processes": p.processes, "this_process": this_process, "run_dir": str(self.run_dir),
        }
        resumed = f"; this process: {this_process['steps']} steps in {p.process_wall_time_s:.1f}s" \
            if p.processes > 1 else ""
        test = {k: summary[f"test_{k}"] for k in names}
        lines = [
            f"done: {self.config.model} on {self.config.dataset}, {p.step} steps in {p.wall_time_s:.1f}s "
            f"({summary['samples_per_s'] or 0:.0f} samples/s training){resumed}",
            f"test {self.task.format(test)}" if last else "test: not evaluated yet",
        ]
        if self.config.memory_report and self.engine.measures_memory:
            batch = self.task.example_batch(self.input_spec, min(self.config.batch_size, self.data_info.train_size),
                                            seed=self.config.seed)
            report = measure_step_memory(self.model, batch, get_modes(self.model), self.device, self._autocast,
                                         loss_fn=self.task.loss, make_optimizer=optimizer_factory(self.config))
            summary.update(report.to_dict())
            blocks = len(report.modes)
            modes = (f"{summary['blocks_in_M']} M / {summary['blocks_in_C']} C of {blocks} reversible blocks"
                     if blocks else "no reversible blocks")
            lines.append(
                f"step memory (batch {report.batch_size}, {modes}): {format_bytes(report.run_bytes)}; "
                f"plain backprop needs {format_bytes(report.plain_bytes)} ({report.ratio:.2f}x)"
            )
        summary.update(extra)
        lines += extra_lines
        angle_line = self.grad_angles.summary_line() if self.grad_angles is not None else None
        if angle_line is not None:
            lines.append(angle_line)
        latest = self.checkpoints.latest()
        saved = latest.relative_to(self.run_dir) if latest is not None else "no checkpoint"
        lines.append(f"run folder: {self.run_dir} (summary.json, metrics.jsonl, {saved})")
        atomic_write_text(self.run_dir / "summary.json", json.dumps(summary, indent=2) + "\n")
        assert self.metrics is not None
        self.metrics.write("summary", **summary)
        self.metrics.close()
        if self.grad_angles is not None:
            plot = self.grad_angles.plot(self.run_dir / "metrics.jsonl", self.run_dir)
            if plot is not None:
                lines.append(f"gradient angles over training: {plot}")
        curves = write_curves(self.run_dir / "metrics.jsonl", self.run_dir / "curves.png")
        if curves is not None:
            lines.append(f"loss and {self.task.headline} curves: {curves} (steps.csv, epochs.csv beside it)")
        self._log("\n".join(lines))
        return summary

    def _header(self) -> str:
        info, modes = self.data_info, get_modes(self.model)
        counts = f"{sum(m == 'M' for m in modes.values())} M / {sum(m == 'C' for m in modes.values())} C"
        params = self.num_params
        return (
            f"revtrain: {self.config.model} ({params / 1e6:.2f}M params, "
            f"{f'{len(modes)} reversible blocks: {counts}' if modes else 'no reversible blocks'}) on "
            f"{info.name} ({info.train_size} train / {info.test_size} test, "
            f"{'x'.join(map(str, info.input_shape))}), {self.device}"
            f"{f', amp {self.config.amp}' if self.config.amp else ''}"
            f"{f', compiled ({len(self.compiled)} modules)' if self.compiled else ''}{self._check_note(modes)}; "
            f"{self.config.epochs} epochs x {self.steps_per_epoch} steps of {self._step_size()}{self._engine_note()}; "
            f"run folder {self.run_dir}"
        )

    # ------------------------------------------------------------------ helpers

    def _check_note(self, modes: dict[str, str]) -> str:
        """The rebuild check's policy in the header, where one was asked for other than every step
        and some block is in M-mode (C-mode blocks rebuild nothing)."""
        every = self.config.check_every
        if every is None or every == 1 or "M" not in modes.values():
            return ""
        return ", rebuild check off" if every == 0 else f", rebuild check every {every} steps"

    def _step_size(self) -> str:
        k, b = self.config.accumulation, self.config.batch_size
        return f"{b}" if k == 1 else f"{k} x {b} (accumulated)"

    def _engine_note(self) -> str:
        note = self.engine.describe()
        return f", {note}" if note else ""

    def autocast(self) -> AbstractContextManager[Any]:
        """The run's autocast context (a no-op without ``amp``)."""
        return self._autocast()

    def on_device(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        """``(inputs, targets)`` moved to the run's device."""
        return self._on_device(batch)

    def _autocast(self) -> AbstractContextManager[Any]:
        if self.config.amp is None:
            return nullcontext()
        dtype = torch.bfloat16 if self.config.amp == "bf16" else torch.float16
        return torch.autocast(self.device.type, dtype=dtype)

    def _on_device(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        """``(inputs, targets)`` moved to the run's device."""
        x, y = batch
        return x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)

    def _bar_disabled(self) -> bool:
        return self.config.quiet or not sys.stderr.isatty() or not self.engine.writes_files

    def _log(self, message: str, *, err: bool = False) -> None:
        if self.engine.writes_files:  # one process speaks for the run; a failing one raises
            tqdm.write(message, file=sys.stderr if err else self.out)


def _carry_history(home: Path, run_dir: Path) -> None:
    """A run resumed into another folder (a branch) starts there with the records of the run it
    continues, so its metrics, CSV files and curves cover the whole run, not only the new part
    (``MetricsWriter`` then drops what came after the checkpoint)."""
    source, target = home / "metrics.jsonl", run_dir / "metrics.jsonl"
    if source.is_file() and not target.exists() and home.resolve() != run_dir.resolve():
        run_dir.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(source, target)


class _NoMetrics:
    """The metrics file of a process that does not write the run folder: it writes nothing."""

    def write(self, event: str, **fields: Any) -> None:
        pass

    def close(self) -> None:
        pass
