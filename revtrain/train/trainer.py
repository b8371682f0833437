"""The Trainer: builds data, model and optimizer from a :class:`TrainConfig` and runs ``fit()``.

The loop follows :mod:`revtrain.data.loader`: the training loader knows its position, every
other piece of state lives in the trainer, and :meth:`Trainer.save_checkpoint` writes all of it
between two steps, so a resumed run (mid-epoch too) computes exactly what the uninterrupted run
would have (bit for bit on CPU with the same seed).

Ctrl-C asks the loop to stop after the current step; it then saves a checkpoint, prints how to
resume and re-raises ``KeyboardInterrupt``. A second Ctrl-C aborts at once without saving.
"""

from __future__ import annotations

import copy
import json
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from pathlib import Path
from typing import Any, TextIO

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from revtrain.core import get_modes, set_modes
from revtrain.data import build_dataloaders
from revtrain.memory import format_bytes
from revtrain.models import create_model
from revtrain.train.checkpoint import (
    CHECKPOINT_NAME,
    IncompatibleCheckpointError,
    capture_rng_state,
    check_model_state,
    load_checkpoint,
    restore_rng_state,
    save_checkpoint,
)
from revtrain.train.config import ConfigError, TrainConfig
from revtrain.train.environment import busy_cpu_note, resolve_device, seed_everything
from revtrain.train.metrics import EpochStats, MetricsWriter, live_memory, measure_step_memory
from revtrain.train.memory_strategy import apply_memory_strategy
from revtrain.train.optim import LRSchedule, build_optimizer, build_scheduler
from revtrain.train.runs import RUNS_ROOT, find_resume_checkpoint, new_run_dir

__all__ = ["Trainer"]

Callback = Callable[["Trainer"], None]
"""Called as ``callback(trainer)`` after every optimizer step."""


class Trainer:
    """Train one model on one dataset as a :class:`TrainConfig` says.

    Args:
        config: The run's settings. With ``config.resume`` set, state is loaded from that
            checkpoint (``"auto"``: the newest of this model and dataset) and must fit the config.
        callbacks: Called as ``callback(trainer)`` after every optimizer step, when the
            trainer's state is consistent (a callback may read ``trainer.step``, save, or raise).
        out: Where log lines go (default: standard output).
    """

    def __init__(self, config: TrainConfig, *, callbacks: Sequence[Callback] = (), out: TextIO | None = None):
        self.callbacks = list(callbacks)
        self.out = out if out is not None else sys.stdout
        self.device = resolve_device(config.device)
        if config.amp is not None and self.device.type != "cuda":
            raise ConfigError(f"--amp {config.amp} works on CUDA only and this run is on {self.device}; "
                              "drop --amp or use --device cuda")
        if config.threads is not None:
            torch.set_num_threads(config.threads)
        seed_everything(config.seed)
        self.train_loader, self.test_loader, self.data_info = build_dataloaders(
            config.dataset, batch_size=config.batch_size, eval_batch_size=config.eval_batch_size,
            data_dir=config.data_dir, seed=config.seed,
            augment=config.augment, image_size=config.image_size, pin_memory=self.device.type == "cuda",
        )
        info = self.data_info
        self.model = create_model(config.model, num_classes=info.num_classes, in_channels=info.in_channels)
        self.model.to(self.device)
        self.optimizer = build_optimizer(self.model, lr=config.lr, momentum=config.momentum,
                                         nesterov=config.nesterov, weight_decay=config.weight_decay)
        batches = len(self.train_loader)
        self.steps_per_epoch = min(batches, config.max_steps_per_epoch or batches)
        self.schedule = LRSchedule(
            total_steps=config.epochs * self.steps_per_epoch,
            warmup_steps=round(config.warmup_epochs * self.steps_per_epoch),
            kind=config.schedule, milestones=config.milestones, gamma=config.gamma,
        )
        self.scheduler = build_scheduler(self.optimizer, self.schedule)
        self.scaler = torch.amp.GradScaler("cuda") if config.amp == "fp16" else None

        resume = find_resume_checkpoint(config.resume, config.to_dict()) if config.resume else None
        if config.resume == "auto" and resume is None:
            self._log(f"--resume auto: no checkpoint of {config.model} on {config.dataset} under "
                      f"{config.run_dir or RUNS_ROOT}; starting a new run")
        if config.run_dir:
            run_dir = Path(config.run_dir)
        else:
            run_dir = resume.parent if resume else new_run_dir(config)
        self.config = config.replace(run_dir=str(run_dir), resume=str(resume) if resume else None)
        self.run_dir = run_dir
        self.checkpoint_path = run_dir / CHECKPOINT_NAME

        self.step = 0
        """Optimizer steps taken so far (over all epochs)."""
        self.pending_eval: int | None = None
        """An epoch whose training is done but whose evaluation is not (yet) recorded."""
        self.history: list[dict[str, Any]] = []
        """One record per evaluated epoch (the ``"epoch"`` lines of metrics.jsonl)."""
        self.train_time_s = 0.0
        self.samples_seen = 0
        self.last_loss = float("nan")
        self.plan: Any = None
        self._epoch = EpochStats()
        self._peak_memory: tuple[int, str] = (0, "")
        self._memory: tuple[int | None, str] = (None, "")
        self._phase = "idle"  # "step" while an update is half-done: nothing may be saved then
        self._stop_requested = False

        run_dir.mkdir(parents=True, exist_ok=True)
        if resume is not None:
            self._load(resume)  # restores the modes the run had
        else:
            self.plan = apply_memory_strategy(self.model, self.config, first_batch=self.first_batch,
                                              device=self.device, run_dir=run_dir, log=self._log)
        (run_dir / "config.json").write_text(json.dumps(self.config.to_dict(), indent=2) + "\n")
        self.metrics = MetricsWriter(run_dir / "metrics.jsonl", resume_step=self.step if resume else None,
                                     redo_epoch=self.pending_eval)
        if resume is not None:
            self.metrics.write("resume", step=self.step, epoch=self.train_loader.epoch,
                               checkpoint=str(resume))
        if self.plan is not None:
            self.metrics.write("plan", step=self.step, summary=self.plan.summary())

    # ------------------------------------------------------------------ the loop

    def fit(self) -> dict[str, Any]:
        """Train to ``config.epochs``, evaluating after each epoch; returns the summary.

        Raises:
            KeyboardInterrupt: after Ctrl-C (or a callback raising it), once the checkpoint is saved.
        """
        start = time.perf_counter()
        self._stop_requested = False
        self._log(self._header())
        note = busy_cpu_note(self.device)
        if note:
            self._log(note, err=True)
        with self._stop_on_sigint():
            try:
                while True:
                    if self.pending_eval is not None:
                        self._finish_epoch()
                    if self.train_loader.epoch >= self.config.epochs:
                        break
                    self._train_epoch()
            except KeyboardInterrupt:
                self._on_interrupt()
                raise
        return self._summarize(time.perf_counter() - start)

    def _train_epoch(self) -> None:
        epoch, limit = self.train_loader.epoch, self.steps_per_epoch
        if self.train_loader.next_batch >= limit:  # resumed with a smaller max_steps_per_epoch
            self.train_loader.set_epoch(epoch + 1)
            self.pending_eval = epoch
            return
        self.model.train()
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        bar = tqdm(total=limit, initial=self.train_loader.next_batch, unit="step", leave=False,
                   desc=f"epoch {epoch + 1}/{self.config.epochs}", disable=self._bar_disabled(),
                   dynamic_ncols=True, file=sys.stderr)
        tick = time.perf_counter()
        try:
            self._phase = "step"
            for x, y in self.train_loader:
                loss, correct = self._train_step(x, y)
                now = time.perf_counter()
                self._record_step(loss, correct, int(y.shape[0]), now - tick)
                tick = now
                done = self.train_loader.next_batch >= limit
                if done:  # mark the epoch finished before anything can save the state
                    self.train_loader.set_epoch(epoch + 1)
                    self.pending_eval = epoch
                self._phase = "idle"
                self._after_step(bar, epoch)
                if done:
                    break
                self._phase = "step"
                tick = time.perf_counter()  # callbacks and checkpoints are not training time
        finally:  # on an exception the phase stays as it was: _on_interrupt needs it
            bar.close()

    def _train_step(self, x: torch.Tensor, y: torch.Tensor) -> tuple[float, int]:
        x = x.to(self.device, non_blocking=True)
        y = y.to(self.device, non_blocking=True)
        self.optimizer.zero_grad(set_to_none=True)
        with self._autocast():
            logits = self.model(x)
            loss = F.cross_entropy(logits, y)
        if self.scaler is not None:
            self.scaler.scale(loss).backward()
            self.scaler.step(self.optimizer)
            self.scaler.update()
        else:
            loss.backward()
            self.optimizer.step()
        self.scheduler.step()
        self.step += 1
        return loss.item(), int((logits.argmax(1) == y).sum().item())

    def _record_step(self, loss: float, correct: int, n: int, seconds: float) -> None:
        self.last_loss = loss
        self._epoch.add(loss * n, correct, n, seconds)
        self.train_time_s += seconds
        self.samples_seen += n
        self._memory = live_memory(self.device)
        if self._memory[0] is not None and self._memory[0] > self._peak_memory[0]:
            self._peak_memory = (self._memory[0], self._memory[1])

    def _after_step(self, bar: Any, epoch: int) -> None:
        stats, lr = self._epoch, self.optimizer.param_groups[0]["lr"]
        mem_bytes, mem_kind = self._memory
        if self.step % self.config.log_every == 0:
            self.metrics.write("step", step=self.step, epoch=epoch, loss=self.last_loss, acc=stats.accuracy,
                               lr=lr, samples_per_s=stats.throughput, memory_bytes=mem_bytes,
                               memory_kind=mem_kind)
        if not bar.disable:
            bar.set_postfix_str(f"loss {self.last_loss:.3f} acc {stats.accuracy:.1%} lr {lr:.3g} "
                                f"{stats.throughput:.0f} samples/s {mem_kind} {format_bytes(mem_bytes or 0)}",
                                refresh=False)
            bar.update(1)
        if self.config.checkpoint_every and self.step % self.config.checkpoint_every == 0:
            self.save_checkpoint()
        for callback in self.callbacks:
            callback(self)
        if self._stop_requested:
            raise KeyboardInterrupt

    def _finish_epoch(self) -> None:
        epoch = self.pending_eval
        assert epoch is not None
        self._phase = "eval"
        test_loss, test_acc = self.evaluate()
        stats = self._epoch
        mem_bytes, mem_kind = self._peak_memory
        record = {
            "epoch": epoch, "step": self.step, "train_loss": stats.loss, "train_acc": stats.accuracy,
            "test_loss": test_loss, "test_acc": test_acc, "lr": self.optimizer.param_groups[0]["lr"],
            "samples_per_s": stats.throughput, "epoch_train_time_s": stats.seconds,
            "memory_bytes": mem_bytes, "memory_kind": mem_kind,
        }
        self.history.append(record)
        self.metrics.write("epoch", **record)
        self._log(
            f"epoch {epoch + 1:>{len(str(self.config.epochs))}}/{self.config.epochs}  "
            f"train loss {stats.loss:.4f} acc {stats.accuracy:6.2%}  test loss {test_loss:.4f} "
            f"acc {test_acc:6.2%}  lr {record['lr']:.3g}  {stats.throughput:.0f} samples/s  "
            f"{mem_kind} {format_bytes(mem_bytes)}  {stats.seconds:.1f}s"
        )
        self.pending_eval = None
        self._epoch = EpochStats()
        self.save_checkpoint()
        self._phase = "idle"

    @torch.no_grad()
    def evaluate(self) -> tuple[float, float]:
        """Mean cross-entropy and top-1 accuracy on the test split (changes no training state)."""
        was_training = self.model.training
        self.model.eval()
        self.test_loader.set_epoch(0)
        loss_sum, correct, count = 0.0, 0, 0
        try:
            for x, y in self.test_loader:
                x, y = x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)
                with self._autocast():
                    logits = self.model(x)
                loss_sum += F.cross_entropy(logits.float(), y, reduction="sum").item()
                correct += int((logits.argmax(1) == y).sum().item())
                count += int(y.shape[0])
                if self._stop_requested:
                    raise KeyboardInterrupt
        finally:
            self.model.train(was_training)
        return loss_sum / max(count, 1), correct / max(count, 1)

    # ------------------------------------------------------------------ checkpoints

    def state_dict(self) -> dict[str, Any]:
        """Everything an exact resume needs (the checkpoint's content)."""
        return {
            "model_name": self.config.model,
            "model": self.model.state_dict(),
            "modes": get_modes(self.model),
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "scaler": self.scaler.state_dict() if self.scaler is not None else None,
            "rng": capture_rng_state(),
            "train_loader": self.train_loader.state_dict(),
            "step": self.step,
            "pending_eval": self.pending_eval,
            "epoch_stats": self._epoch.to_dict(),
            "history": self.history,
            "train_time_s": self.train_time_s,
            "samples_seen": self.samples_seen,
            "config": self.config.to_dict(),
            "data": self.data_info.to_dict(),
        }

    def save_checkpoint(self, path: str | Path | None = None) -> Path:
        """Write :meth:`state_dict` atomically (default: ``<run_dir>/checkpoint.pt``)."""
        if self._phase == "step":
            raise RuntimeError("cannot checkpoint in the middle of a training step")
        return save_checkpoint(self.state_dict(), path or self.checkpoint_path)

    def _load(self, path: Path) -> None:
        state = load_checkpoint(path)
        check_model_state(path, state, self.config.model, self.model)
        saved_data = state.get("data", {})
        if saved_data.get("name") not in (None, self.data_info.name):
            raise IncompatibleCheckpointError(
                f"checkpoint {path} was trained on {saved_data['name']!r}, this run loads "
                f"{self.data_info.name!r}; pass --dataset {saved_data['name']} to resume it"
            )
        try:
            self.model.load_state_dict(state["model"])
            set_modes(self.model, state["modes"])
            self.optimizer.load_state_dict(state["optimizer"])
            self.scheduler.load_state_dict(state["scheduler"])
            if self.scaler is not None and state.get("scaler"):
                self.scaler.load_state_dict(state["scaler"])
            self.train_loader.load_state_dict(state["train_loader"])
        except (ValueError, KeyError, RuntimeError) as err:
            raise IncompatibleCheckpointError(
                f"checkpoint {path} does not fit this run: {err}. Resume with the options of the "
                "run that wrote it (its config.json), or start a fresh run without --resume"
            ) from None
        self.step = int(state["step"])
        self.pending_eval = state["pending_eval"]
        self._epoch = EpochStats(**state["epoch_stats"])
        self.history = list(state["history"])
        self.train_time_s = float(state["train_time_s"])
        self.samples_seen = int(state["samples_seen"])
        self._apply_hyperparameters()
        restore_rng_state(state["rng"])
        self._log(f"resumed from {path}: epoch {self.train_loader.epoch + 1}, batch "
                  f"{self.train_loader.next_batch}, step {self.step}")

    def _apply_hyperparameters(self) -> None:
        """Put the config's optimizer settings over the loaded ones (identical unless overridden)."""
        factor = self.schedule.factor(self.scheduler.last_epoch)
        self.scheduler.base_lrs = [self.config.lr] * len(self.optimizer.param_groups)
        for group in self.optimizer.param_groups:
            group.update(initial_lr=self.config.lr, lr=self.config.lr * factor, momentum=self.config.momentum,
                         nesterov=self.config.nesterov,
                         weight_decay=self.config.weight_decay if group.get("name") == "decay" else 0.0)

    def _on_interrupt(self) -> None:
        if self._phase == "step":
            exists = self.checkpoint_path.exists()
            where = f"{self.checkpoint_path} is untouched" if exists else "none was saved"
            self._log(f"aborted inside a training step at step {self.step}: no checkpoint written "
                      f"(the last one, {where})", err=True)
            return
        path = self.save_checkpoint()
        self.metrics.write("interrupt", step=self.step, checkpoint=str(path))
        self._log(f"interrupted at step {self.step} (epoch {self.train_loader.epoch + 1}, batch "
                  f"{self.train_loader.next_batch}); checkpoint saved to {path}\n"
                  f"resume with: revtrain train --resume {path}", err=True)

    # ------------------------------------------------------------------ modes and summary

    def first_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Batch 0 of epoch 0 of the training loader, without moving the loader."""
        probe = copy.copy(self.train_loader)
        probe.set_epoch(0)
        return next(iter(probe))

    def _summarize(self, wall_s: float) -> dict[str, Any]:
        last = self.history[-1] if self.history else {}
        summary: dict[str, Any] = {
            "model": self.config.model, "dataset": self.config.dataset, "device": str(self.device),
            "epochs": self.config.epochs, "steps": self.step,
            "test_acc": last.get("test_acc"), "test_loss": last.get("test_loss"),
            "train_acc": last.get("train_acc"), "wall_time_s": round(wall_s, 3),
            "train_time_s": round(self.train_time_s, 3),
            "samples_per_s": self.samples_seen / self.train_time_s if self.train_time_s else None,
            "train_peak_memory_bytes": self._peak_memory[0], "train_peak_memory_kind": self._peak_memory[1],
            "run_dir": str(self.run_dir),
        }
        lines = [
            f"done: {self.config.model} on {self.config.dataset}, {self.step} steps in {wall_s:.1f}s "
            f"({summary['samples_per_s'] or 0:.0f} samples/s training)",
            f"test accuracy {summary['test_acc'] or 0:.2%} (loss {summary['test_loss'] or 0:.4f})",
        ]
        if self.config.memory_report:
            report = measure_step_memory(self.model, self.first_batch(), get_modes(self.model),
                                         self.device, self._autocast)
            summary.update(report.to_dict())
            blocks = len(report.modes)
            modes = (f"{summary['blocks_in_M']} M / {summary['blocks_in_C']} C of {blocks} reversible blocks"
                     if blocks else "no reversible blocks")
            lines.append(
                f"step memory (batch {report.batch_size}, {modes}): {format_bytes(report.run_bytes)}; "
                f"plain backprop needs {format_bytes(report.plain_bytes)} ({report.ratio:.2f}x)"
            )
        lines.append(f"run folder: {self.run_dir} (summary.json, metrics.jsonl, checkpoint.pt)")
        (self.run_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
        self.metrics.write("summary", **summary)
        self.metrics.close()
        self._log("\n".join(lines))
        return summary

    def _header(self) -> str:
        info, modes = self.data_info, get_modes(self.model)
        counts = f"{sum(m == 'M' for m in modes.values())} M / {sum(m == 'C' for m in modes.values())} C"
        params = sum(p.numel() for p in self.model.parameters())
        return (
            f"revtrain: {self.config.model} ({params / 1e6:.2f}M params, "
            f"{f'{len(modes)} reversible blocks: {counts}' if modes else 'no reversible blocks'}) on "
            f"{info.name} ({info.train_size} train / {info.test_size} test, "
            f"{'x'.join(map(str, info.input_shape))}), {self.device}"
            f"{f', amp {self.config.amp}' if self.config.amp else ''}; {self.config.epochs} epochs x "
            f"{self.steps_per_epoch} steps of {self.config.batch_size}; run folder {self.run_dir}"
        )

    # ------------------------------------------------------------------ helpers

    def _autocast(self) -> AbstractContextManager[Any]:
        if self.config.amp is None:
            return nullcontext()
        dtype = torch.bfloat16 if self.config.amp == "bf16" else torch.float16
        return torch.autocast(self.device.type, dtype=dtype)

    def _bar_disabled(self) -> bool:
        return self.config.quiet or not sys.stderr.isatty()

    def _log(self, message: str, *, err: bool = False) -> None:
        tqdm.write(message, file=sys.stderr if err else self.out)

    @contextmanager
    def _stop_on_sigint(self) -> Iterator[None]:
        """First Ctrl-C: stop after this step (and save). Second: abort at once."""
        if threading.current_thread() is not threading.main_thread():
            yield
            return

        def request_stop(signum: int, frame: Any) -> None:
            if self._stop_requested:
                raise KeyboardInterrupt
            self._stop_requested = True
            self._log("\nstopping after this step to save a checkpoint (Ctrl-C again to abort now)", err=True)

        previous = signal.signal(signal.SIGINT, request_stop)
        try:
            yield
        finally:
            signal.signal(signal.SIGINT, previous)
