"""Train a zoo model with PETRA for N epochs: the same loop on the simulator or on one rank.

:func:`train` builds everything once (data, model, stages, workers), then per epoch: trains
(warm-up, steady state, drain, flush), evaluates with an ordinary forward in evaluation mode,
gathers one report per stage, writes a checkpoint of every stage and, on the reporting process
(the simulator, or rank 0), one line of ``metrics.jsonl`` and a progress line. At the end rank 0
writes ``summary.json`` with the memory summary per stage.

With ``engine="simulator"`` all stages run in this process. With ``engine="processes"`` this
function is what every rank runs (started by :mod:`revtrain.parallel.launch` or ``torchrun``):
rank ``r`` builds the model from the same seed, keeps stage ``r`` and drops the rest.
"""

from __future__ import annotations

import itertools
import json
import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from revtrain.data import build_dataloaders
from revtrain.memory import format_bytes, process_peak_rss_bytes
from revtrain.models import create_model, model_info
import revtrain.parallel.checkpoint as ckpt
from revtrain.parallel.config import PetraConfig
from revtrain.parallel.distributed import DistributedPipeline, check_backend, init_from_env
from revtrain.parallel.errors import PipelineConfigError
from revtrain.parallel.options import RunOptions, parse_split
from revtrain.parallel.partition import Stage, split_model, stage_shapes
from revtrain.parallel.pipeline import StageTicker
from revtrain.parallel.simulator import Simulator
from revtrain.parallel.timing import time_units
from revtrain.parallel.units import model_units
from revtrain.parallel.worker import StageWorker, plan_segments
from revtrain.tasks import Task, add_sums, task_for
from revtrain.train.optim import LRSchedule

__all__ = ["train", "measured_split", "checked_split", "default_run_dir"]

_COLLECTIVE_TIMEOUT_S = 1800.0


def default_run_dir(options: RunOptions) -> Path:
    """``runs/petra-<model>-<dataset>-J<stages>-<time>`` (a suffix if it exists)."""
    base = Path("runs") / f"petra-{options.model}-{options.dataset}-J{options.stages}-{time.strftime('%Y%m%d-%H%M%S')}"
    path, n = base, 1
    while path.exists():
        n += 1
        path = base.with_name(f"{base.name}-{n}")
    return path


def measured_split(model: torch.nn.Module, num_stages: int, sample: torch.Tensor) -> list[int]:
    """Blocks per stage balanced by each unit's measured time on ``sample`` (a training batch)."""
    units = model_units(model)
    costs = time_units(units, sample, repeats=5, warmup=2)
    stages = split_model(model, num_stages, costs=([c.stage_cost for c in costs], [c.plain_s for c in costs]))
    return [s.num_blocks for s in stages]


def checked_split(options: RunOptions, petra: PetraConfig) -> list[int] | list[str] | None:
    """Check a multi-process run before any process starts: the backend for the device, the
    split on the real model (a clear error now, not in a rank); measure a balanced split once,
    with the threads a stage will have, so that every rank uses the same."""
    device = _device(options)
    check_backend(options.backend, device)
    threads = torch.get_num_threads()
    try:
        s = _setup(options, petra, device, parse_split(options.split))  # sets the stage's threads
    finally:
        torch.set_num_threads(threads)
    for stage in s.stages[:-1]:
        plan_segments(stage, petra.input_buffer)  # refuses input_buffer="none" on a non-reversible stage
    return [st.num_blocks for st in s.stages] if options.split is None else parse_split(options.split)


@dataclass
class _Setup:
    options: RunOptions
    petra: PetraConfig
    device: torch.device
    dtype: torch.dtype
    task: Task
    train_loader: Any
    test_loader: Any
    stages: list[Stage]
    num_batches: int
    schedule: LRSchedule


def _setup(options: RunOptions, petra: PetraConfig, device: torch.device, split: list[int] | list[str] | None) -> _Setup:
    torch.set_num_threads(options.threads)
    dtype = torch.float64 if options.dtype == "float64" else torch.float32
    train_loader, test_loader, info = build_dataloaders(
        options.dataset, batch_size=options.batch_size, eval_batch_size=options.eval_batch_size,
        data_dir=options.data_dir, seed=options.seed, image_size=options.image_size, drop_last=True,
    )
    torch.manual_seed(options.seed)
    model = create_model(options.model, in_channels=info.in_channels, num_classes=info.num_classes)
    model = model.to(device=device, dtype=dtype)
    task = task_for(model_info(options.model).inputs)
    num_batches = len(train_loader) if options.max_batches is None else min(options.max_batches, len(train_loader))
    if split is None and options.balance == "time" and options.stages > 1:
        x, _ = next(iter(train_loader))
        split = measured_split(model, options.stages, x.to(device, dtype))
    stages = split_model(model, options.stages, split)
    sample = next(iter(test_loader))[0][:2].to(device, dtype)
    stage_shapes(stages, sample, model)  # refuses a model whose forward is not its chain of units
    per_epoch = math.ceil(num_batches / petra.accumulation)
    schedule = LRSchedule(total_steps=per_epoch * options.epochs,
                          warmup_steps=round(options.warmup_epochs * per_epoch), kind=options.schedule,
                          milestones=options.milestones, gamma=options.gamma)
    return _Setup(options, petra, device, dtype, task, train_loader, test_loader, stages, num_batches, schedule)


def _device(options: RunOptions) -> torch.device:
    if options.device == "cpu" or (options.device == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise PipelineConfigError("device 'cuda' was asked for but CUDA is not available; use --device cpu")
    local = int(os.environ.get("LOCAL_RANK", 0))
    return torch.device("cuda", local % torch.cuda.device_count())


def train(options: RunOptions, petra: PetraConfig, *, log: Callable[[str], None] = print) -> dict[str, Any]:
    """Run the training of ``options`` (module docstring); returns the summary (on every process)."""
    device = _device(options)
    split = parse_split(options.split)
    if options.engine == "simulator":
        return _train_simulated(options, petra, device, split, log)
    return _train_rank(options, petra, device, split, log)


# -- the simulator -------------------------------------------------------------------------------


def _train_simulated(options: RunOptions, petra: PetraConfig, device: torch.device, split: Any,
                     log: Callable[[str], None]) -> dict[str, Any]:
    s = _setup(options, petra, device, split)
    sim = Simulator(s.stages, config=petra, batch_size=options.batch_size, task=s.task, schedule=s.schedule)
    run_dir = Path(options.run_dir) if options.run_dir else default_run_dir(options)
    start = _resume(run_dir, s, sim.workers) if options.resume else 0
    run_dir.mkdir(parents=True, exist_ok=True)
    _write_config(run_dir, options, petra)
    reports: list[dict[str, Any]] = []
    for epoch in range(start, options.epochs):
        s.train_loader.set_epoch(epoch)
        begin = time.perf_counter()
        result = sim.train_epoch(epoch, itertools.islice(s.train_loader, s.num_batches), s.num_batches)
        seconds = time.perf_counter() - begin
        s.test_loader.set_epoch(0)
        test = sim.evaluate(s.test_loader)
        reports = [_stage_report(t, result.train_sums if t.worker.stage.is_last else None,
                                 test if t.worker.stage.is_last else None) for t in sim.tickers]
        for w in sim.workers:
            _save_stage(run_dir, w, epoch + 1, s.train_loader)
        ckpt.write_manifest(run_dir / "checkpoints", epoch + 1, len(s.stages))
        for i in range(len(s.stages)):
            ckpt.prune(run_dir / "checkpoints", i, epoch + 1)
        _report_epoch(run_dir, options, s, epoch, seconds, reports, log)
    return _finish(run_dir, options, petra, s, reports, log)


# -- one rank of the multi-process engine --------------------------------------------------------


def _train_rank(options: RunOptions, petra: PetraConfig, device: torch.device, split: Any,
                log: Callable[[str], None]) -> dict[str, Any]:
    backend = check_backend(options.backend, device)
    # Ticks wait --timeout for a neighbour (explicitly, per exchange); collectives (the split's
    # measurement on rank 0, epoch reports, checkpoints) may legitimately take longer.
    rank, world = init_from_env(backend, max(options.timeout, _COLLECTIVE_TIMEOUT_S))
    try:
        stages, replicas = options.stages, options.replicas
        if world != stages * replicas:
            raise PipelineConfigError(
                f"{world} processes for {stages} stages x {replicas} replicas: PETRA runs one process per stage "
                f"and replica; start {stages * replicas} processes or pass --stages {world // replicas}"
            )
        index, replica = divmod(rank, replicas)  # the (pp, dp) mesh, row-major: stage, then replica
        group = _replica_group(device, stages, replicas)
        if split is None and options.balance == "time" and world > 1:
            split = _broadcast(rank, lambda: _split_on_rank0(options, petra, device))
        run_dir = Path(_broadcast(rank, lambda: str(options.run_dir or default_run_dir(options))))
        s = _setup(options, petra, device, split)
        sample = next(iter(s.test_loader))
        pipe = DistributedPipeline.for_rank(
            s.stages, index, config=petra, batch_size=options.batch_size, task=s.task,
            sample=(sample[0].to(device, s.dtype), sample[1].to(device)), schedule=s.schedule,
            device=device, timeout_s=options.timeout, stage_ranks=[j * replicas + replica for j in range(stages)])
        worker, ticker, stage = pipe.worker, pipe.ticker, pipe.stage
        worker.replica_group = group
        s.stages = [stage]  # this process keeps its own stage only; the rest of the model is freed
        start = _resume(run_dir, s, [worker]) if options.resume else 0
        if rank == 0:
            run_dir.mkdir(parents=True, exist_ok=True)
            _write_config(run_dir, options, petra)
        train_sizes = [options.batch_size // replicas] * s.num_batches  # this replica's slice of each batch
        test_sizes = _sizes(s.test_loader)
        reports: list[dict[str, Any]] = []
        for epoch in range(start, options.epochs):
            s.train_loader.set_epoch(epoch)
            data = _slices(itertools.islice(s.train_loader, s.num_batches), replica, replicas) if stage.is_first else None
            dist.barrier()
            begin = time.perf_counter()
            pipe.train_epoch(epoch, data, train_sizes)
            seconds = time.perf_counter() - begin
            s.test_loader.set_epoch(0)
            test = pipe.evaluate(s.task, s.test_loader if stage.is_first else None, test_sizes)  # every replica: all
            mine = _stage_report(ticker, worker.train_sums if stage.is_last else None, test if stage.is_last else None)
            mine["peak_rss_bytes"] = process_peak_rss_bytes()
            mine["epoch_seconds"] = seconds
            gathered = [None] * world  # type: ignore[list-item]
            dist.all_gather_object(gathered, mine)
            reports = _per_stage(gathered, stages, replicas)
            seconds = max(r["epoch_seconds"] for r in gathered)  # the slowest stage is the wall time
            if replica == 0:  # the replicas of a stage hold the same state
                _save_stage(run_dir, worker, epoch + 1, s.train_loader)
            dist.barrier()
            if rank == 0:
                ckpt.write_manifest(run_dir / "checkpoints", epoch + 1, stages)
            dist.barrier()
            if replica == 0:
                ckpt.prune(run_dir / "checkpoints", index, epoch + 1)
            if rank == 0:
                _report_epoch(run_dir, options, s, epoch, seconds, reports, log)
        summary = _finish(run_dir, options, petra, s, reports, log) if rank == 0 else {}
        dist.barrier()
        return summary
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _replica_group(device: torch.device, stages: int, replicas: int) -> Any:
    """The process group of this rank's stage replicas on a 2-D ``(pp, dp)`` device mesh; None for one replica."""
    if replicas == 1:
        return None
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(device.type, (stages, replicas), mesh_dim_names=("pp", "dp"))
    return mesh.get_group("dp")


def _slices(batches: Any, replica: int, replicas: int) -> Any:
    """This replica's equal slice of every batch."""
    for x, y in batches:
        yield x.tensor_split(replicas)[replica], y.tensor_split(replicas)[replica]


def _per_stage(gathered: list[dict[str, Any]], stages: int, replicas: int) -> list[dict[str, Any]]:
    """One report per stage from every rank's: the training sums added over the replicas."""
    out = []
    for j in range(stages):
        group = gathered[j * replicas:(j + 1) * replicas]
        report = dict(group[0])
        if report["train_sums"] is not None:
            sums: dict[str, float] = {}
            for r in group:
                add_sums(sums, r["train_sums"])
            report["train_sums"] = sums
        report["peak_rss_bytes"] = max(r["peak_rss_bytes"] for r in group)
        out.append(report)
    return out


def _split_on_rank0(options: RunOptions, petra: PetraConfig, device: torch.device) -> list[int]:
    s = _setup(options, petra, device, None)
    return [st.num_blocks for st in s.stages]


def _broadcast(rank: int, make: Callable[[], Any]) -> Any:
    box = [make() if rank == 0 else None]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _sizes(loader: Any) -> list[int]:
    n, b = len(loader.dataset), loader.batch_size
    return [min(b, n - i * b) for i in range(len(loader))]


# -- reports, checkpoints, summary ---------------------------------------------------------------


def _stage_report(ticker: StageTicker, train_sums: dict | None, test_sums: dict | None) -> dict[str, Any]:
    w = ticker.worker
    params = sum(p.numel() * p.element_size() for p in w.params)
    opt = sum(t.numel() * t.element_size() for st in w.optimizer.state.values() for t in st.values()
              if isinstance(t, torch.Tensor))
    errs = w.reconstruction_errors
    return {
        "stage": w.stage.index,
        "first_unit": w.stage.units[0].name,
        "last_unit": w.stage.units[-1].name,
        "reversible": w.stage.reversible,
        "kept_segments": sum(not seg.rebuild for seg in w.segments) if not w.stage.is_last else 0,
        "updates": w.updates,
        "lr": w.optimizer.param_groups[0]["lr"],
        "reconstruction_error": sum(errs) / len(errs) if errs else None,
        "param_bytes": params,
        "optimizer_bytes": opt,
        "peak_buffer_bytes": ticker.peak_buffer_bytes,
        "train_sums": train_sums,
        "test_sums": test_sums,
    }


def _save_stage(run_dir: Path, worker: StageWorker, epoch: int, loader: Any) -> None:
    state = {"worker": worker.state_dict()}
    if worker.stage.is_first:
        state["loader"] = loader.state_dict()
    ckpt.save_stage(run_dir / "checkpoints", worker.stage.index, epoch, state)


def _resume(run_dir: Path, s: _Setup, workers: list[StageWorker]) -> int:
    epoch = 0
    for w in workers:
        state = ckpt.load_stage(run_dir / "checkpoints", w.stage.index, w.stage.num_stages)
        if state is None:
            raise PipelineConfigError(f"--resume: no complete checkpoint in {run_dir / 'checkpoints'}")
        w.load_state_dict(state["worker"])
        epoch = state["epoch"]
    return epoch


def _write_config(run_dir: Path, options: RunOptions, petra: PetraConfig) -> None:
    data = {"options": options.to_dict(), "petra": vars(petra).copy()}
    (run_dir / "config.json").write_text(json.dumps(data, indent=2, default=str))


def _report_epoch(run_dir: Path, options: RunOptions, s: _Setup, epoch: int, seconds: float,
                  reports: list[dict[str, Any]], log: Callable[[str], None]) -> None:
    last = reports[-1]
    train = s.task.summarize(last["train_sums"] or {})
    test = s.task.summarize(last["test_sums"] or {})
    samples = s.num_batches * options.batch_size
    line = {
        "epoch": epoch + 1,
        "train_loss": train["loss"], f"train_{s.task.headline}": train[s.task.headline],
        "test_loss": test["loss"], f"test_{s.task.headline}": test[s.task.headline],
        "epoch_seconds": seconds,
        "samples_per_s": samples / seconds if seconds > 0 else None,
        "lr": reports[0]["lr"],
        "reconstruction_error": [r["reconstruction_error"] for r in reports],
        "updates": [r["updates"] for r in reports],
    }
    with open(run_dir / "metrics.jsonl", "a") as f:
        f.write(json.dumps(line) + "\n")
    if not options.quiet:
        log(f"epoch {epoch + 1}/{options.epochs}  train {s.task.format(train)}  test {s.task.format(test)}  "
            f"{seconds:.1f}s ({line['samples_per_s']:.0f} samples/s)")


def _finish(run_dir: Path, options: RunOptions, petra: PetraConfig, s: _Setup, reports: list[dict[str, Any]],
            log: Callable[[str], None]) -> dict[str, Any]:
    test = s.task.summarize(reports[-1]["test_sums"] or {}) if reports else {}
    memory = [{k: r[k] for k in ("stage", "first_unit", "last_unit", "reversible", "param_bytes",
                                 "optimizer_bytes", "peak_buffer_bytes") if k in r}
              | {"peak_rss_bytes": r.get("peak_rss_bytes")} for r in reports]
    summary = {"run_dir": str(run_dir), "model": options.model, "dataset": options.dataset,
               "stages": options.stages, "engine": options.engine, "epochs": options.epochs,
               "test": test, "memory": memory}
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    log(f"done: {options.model} on {options.dataset}, PETRA with {options.stages} stages"
        f"{f' x {options.replicas} replicas' if options.replicas > 1 else ''} ({options.engine}); "
        f"test {s.task.format(test) if test else 'n/a'}")
    for m in memory:
        rss = f", peak RSS {format_bytes(m['peak_rss_bytes'])}" if m.get("peak_rss_bytes") else ""
        log(f"  stage {m['stage']} ({m['first_unit']} .. {m['last_unit']}): parameters "
            f"{format_bytes(m['param_bytes'])}, optimizer {format_bytes(m['optimizer_bytes'])}, kept inputs "
            f"{format_bytes(m['peak_buffer_bytes'])} at most{rss}")
    log(f"run folder: {run_dir}")
    return summary
