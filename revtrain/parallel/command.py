"""``revtrain train`` on several processes: ``--stages J`` (PETRA), ``--data-parallel N`` (DDP), ``--shard`` (FSDP2).

The options are the fields of :class:`ParallelConfig` and of
:class:`~revtrain.parallel.config.PetraConfig` less :data:`SHARED_WITH_TRAIN` (the optimizer
fields ``revtrain train`` already has); ``revtrain.cli`` adds them to the ``train`` command.
:func:`run_parallel` runs the command when one of them is given (None otherwise: an ordinary
run):

Every engine first validates the options as one process does (:class:`~revtrain.train.TrainConfig`).

- ``--stages J`` maps the ``train`` options onto a PETRA run (:class:`~revtrain.parallel.options.RunOptions`),
  checks the split on the real model and starts J ranks (J x N with ``--data-parallel N``)
  through torch's elastic agent (:func:`~revtrain.parallel.launch.launch_ranks`), or runs the
  simulator with ``--engine simulator``. Options PETRA does not have (another optimizer, a
  memory budget, mixed precision, ...) are refused by name before anything runs; so is a run
  folder that holds a run. ``--lr`` given is the peak learning rate; without it PETRA's rule
  applies (``lr_per_256 · batch · k / 256``).
- ``--data-parallel N`` runs the ordinary trainer on N ranks with a
  :class:`~revtrain.parallel.replicas.DataParallelEngine`; ``--shard`` shards it with FSDP2.

Under ``torchrun`` this process is one rank: it trains instead of launching.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from revtrain.parallel.config import PetraConfig
from revtrain.parallel.errors import PipelineConfigError, StageFailedError
from revtrain.train.config import TrainConfig
from revtrain.train.runs import RunExistsError, holds_run

__all__ = ["ParallelConfig", "run_parallel", "petra_run_options", "PETRA_UNSUPPORTED", "SHARED_WITH_TRAIN"]

SHARED_WITH_TRAIN = ("lr", "momentum", "nesterov", "weight_decay", "accumulation")
"""PetraConfig fields that ``revtrain train`` already has (TrainConfig's options feed them)."""

PETRA_UNSUPPORTED = {
    "optimizer": "PETRA uses SGD with Nesterov momentum",
    "grad_clip": "PETRA's stages update separately, so there is no global gradient norm",
    "mode": "PETRA's stages rebuild reversible blocks themselves, whatever their mode",
    "budget": "PETRA's stages keep no activations of reversible blocks",
    "plan": "PETRA's stages keep no activations of reversible blocks",
    "amp": "PETRA runs in float32 (or float64)",
    "compile": "PETRA runs its stages eagerly",
    "task": "PETRA trains the model's own task",
    "context": "PETRA trains image classifiers",
    "augment": "PETRA's loaders use the dataset's default augmentation",
    "checkpoint_every": "PETRA checkpoints every stage after each epoch's flush",
    "log_every": "PETRA writes one metrics line per epoch",
    "memory_report": "PETRA reports each stage's memory in summary.json",
    "divergence_factor": "PETRA has no divergence bound",
    "grad_angle_every": "PETRA's rebuilds use moved parameters by design; --track-reconstruction reports their drift",
    "check_every": "PETRA's rebuilds use moved parameters by design; --track-reconstruction reports their drift",
}
"""``revtrain train`` options a ``--stages`` run refuses, and why."""

_TRAIN_TO_PETRA_RUN = {
    "model": "model", "dataset": "dataset", "data_dir": "data_dir", "image_size": "image_size",
    "epochs": "epochs", "batch_size": "batch_size", "eval_batch_size": "eval_batch_size",
    "max_steps_per_epoch": "max_batches", "warmup_epochs": "warmup_epochs", "schedule": "schedule",
    "milestones": "milestones", "gamma": "gamma", "device": "device", "threads": "threads", "seed": "seed",
    "run_dir": "run_dir", "quiet": "quiet",
}
"""``revtrain train`` options and the PETRA run option each becomes."""


@dataclass(kw_only=True)
class ParallelConfig:
    """How ``revtrain train`` spreads a run over processes (none of these: one process)."""

    stages: int | None = None
    """PETRA: cut the model into J stages trained as a pipeline with delayed gradients, one local process per stage (docs/parallel.md)."""
    split: str | None = None
    """With --stages: blocks per stage (3,3,2) or the names of the blocks opening stages 2..J; default: balanced by measured time."""
    balance: Literal["time", "count"] = "time"
    """With --stages and no --split: balance the stages by measured per-unit time, or by block count."""
    engine: Literal["processes", "simulator"] = "processes"
    """With --stages: one process per stage (torch.distributed), or every stage in this process (same arithmetic)."""
    data_parallel: int | None = None
    """DDP: train on N local processes, each on 1/N of every batch (same updates as one process on the whole batch); with --stages J, N replicas of every stage (J x N processes on a (pp, dp) device mesh)."""
    shard: bool = False
    """With --data-parallel: shard parameters, gradients and optimizer state over the processes (FSDP2)."""
    backend: Literal["auto", "gloo", "nccl"] = "auto"
    """torch.distributed backend: auto picks nccl on CUDA and gloo on CPU."""
    port: int = 0
    """Rendezvous port of the local processes (0: a free one)."""
    timeout: float = 60.0
    """Seconds a process waits for another before the run is ended as failed."""

    def __post_init__(self) -> None:
        for name in ("stages", "data_parallel"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise PipelineConfigError(f"--{name.replace('_', '-')} must be an integer >= 1, got {value!r}")
        if self.stages is not None and self.data_parallel is not None:
            if self.shard:
                raise PipelineConfigError("--shard with --stages: the replicas of a PETRA stage all-reduce their "
                                          "gradients, they do not shard them; drop --shard")
            if self.engine == "simulator":
                raise PipelineConfigError("--engine simulator runs one replica of every stage; drop --data-parallel "
                                          "or use --engine processes")
        if self.shard and self.data_parallel is None:
            raise PipelineConfigError("--shard shards over data-parallel processes; add --data-parallel N")
        if self.stages is None and (self.split is not None or self.engine != "processes"):
            raise PipelineConfigError("--split and --engine are PETRA options; add --stages J")
        if not 0 <= self.port < 65536:
            raise PipelineConfigError(f"--port must be in [0, 65535], got {self.port}")
        if not self.timeout > 0:
            raise PipelineConfigError(f"--timeout must be > 0 seconds, got {self.timeout}")


def run_parallel(argv: Sequence[str], train_given: dict[str, Any], parallel_given: dict[str, Any],
                 petra_given: dict[str, Any]) -> int | None:
    """Run ``revtrain train`` on several processes if its options ask for it; None otherwise.

    Args:
        argv: The command line (``train ...``): what every local rank runs.
        train_given: The :class:`~revtrain.train.TrainConfig` options given.
        parallel_given: The :class:`ParallelConfig` options given.
        petra_given: The :class:`PetraConfig` options given (none of :data:`SHARED_WITH_TRAIN`).

    Returns:
        The exit status (1: a process failed, the message is printed; 128 + a signal that
        stopped the run), or None when no option asked for several processes.
    """
    from torch.distributed.elastic.multiprocessing.api import SignalException

    torchrun = "TORCHELASTIC_RUN_ID" in os.environ and "WORLD_SIZE" in os.environ
    if not parallel_given and not petra_given:
        world = int(os.environ.get("WORLD_SIZE", "1"))
        if torchrun and world > 1:
            raise PipelineConfigError(
                f"torchrun started {world} processes but no parallel option was given: each would train the "
                f"whole run into the same folder; add --data-parallel {world} (or --stages {world} for PETRA), "
                "or start one process"
            )
        return None
    parallel = ParallelConfig(**parallel_given)
    if ":" in str(train_given.get("device", "")):
        raise PipelineConfigError(f"--device {train_given['device']} names one GPU, and each process of "
                                  "--stages/--data-parallel takes the GPU of its local rank; pass --device cuda")
    TrainConfig(**train_given)  # every engine validates the run's options as one process does
    if parallel.stages is None and petra_given:
        names = ", ".join("--" + k.replace("_", "-") for k in petra_given)
        raise PipelineConfigError(f"{names}: PETRA options; add --stages J")
    try:
        if parallel.stages is not None:
            return _run_petra(list(argv), train_given, parallel, petra_given, torchrun)
        return _run_data_parallel(list(argv), train_given, parallel, torchrun)
    except StageFailedError as err:
        print(f"revtrain train: {type(err).__name__}: {err}", file=sys.stderr)
        return 1
    except SignalException as stop:  # every rank got the signal too and saved its checkpoint
        print(f"revtrain train: stopped by {stop.sigval.name}; every rank was asked to save a checkpoint",
              file=sys.stderr)
        return 128 + int(stop.sigval)


def petra_run_options(train_given: dict[str, Any], parallel: ParallelConfig, petra_given: dict[str, Any]) -> tuple[Any, PetraConfig]:
    """The PETRA run (:class:`RunOptions`, :class:`PetraConfig`) for ``revtrain train`` options.

    Raises:
        PipelineConfigError: an option PETRA does not have, or a value that cannot work.
    """
    from revtrain.parallel.options import RunOptions

    known = {*_TRAIN_TO_PETRA_RUN, *SHARED_WITH_TRAIN, "resume", "overwrite"}
    refused = [k for k in train_given if k not in known]
    if refused:
        reasons = "; ".join(f"--{k.replace('_', '-')}: {PETRA_UNSUPPORTED.get(k, 'a single-process option')}"
                            for k in refused)
        raise PipelineConfigError(f"not available with --stages (PETRA): {reasons}. Drop them, or train "
                                  "without --stages")
    run = {_TRAIN_TO_PETRA_RUN[k]: v for k, v in train_given.items() if k in _TRAIN_TO_PETRA_RUN}
    resume = train_given.get("resume")
    if resume is not None:
        if resume == "auto":
            if "run_dir" not in run:
                raise PipelineConfigError("--resume auto with --stages needs --run-dir: the folder of the PETRA run")
        elif os.path.isdir(resume):
            if run.setdefault("run_dir", resume) != resume:
                raise PipelineConfigError(f"--resume {resume} and --run-dir {run['run_dir']} name two runs; give one")
        else:
            raise PipelineConfigError(f"--resume {resume}: a PETRA run is resumed from its folder (it holds one "
                                      "checkpoint per stage); pass the run folder")
        run["resume"] = True
    elif run.get("run_dir"):  # a new run never replaces a folder's files unasked (revtrain.train.runs)
        from revtrain.train.runs import refuse_occupied

        overwrite = bool(train_given.get("overwrite"))
        if not overwrite and _holds_a_run(Path(run["run_dir"])):
            raise RunExistsError(
                f"--run-dir {run['run_dir']} already holds a run; nothing was changed. Continue it with --resume "
                f"{run['run_dir']}, pass --overwrite to replace it by a new run, or pass another --run-dir"
            )
        refuse_occupied(run["run_dir"], overwrite=overwrite)
    options = RunOptions(**run, stages=parallel.stages, replicas=parallel.data_parallel or 1, split=parallel.split,
                         balance=parallel.balance,
                         engine=parallel.engine, backend=parallel.backend, port=parallel.port,
                         timeout=parallel.timeout)
    petra = PetraConfig(**petra_given, **{k: train_given[k] for k in SHARED_WITH_TRAIN if k in train_given})
    return options, petra


def _holds_a_run(folder: Path) -> bool:
    """A single-process or data-parallel run (its checkpoint), or a PETRA run (its manifest)."""
    return holds_run(folder) or (folder / "checkpoints" / "latest.json").is_file()


def _run_petra(argv: list[str], train_given: dict[str, Any], parallel: ParallelConfig,
               petra_given: dict[str, Any], torchrun: bool) -> int:
    from dataclasses import replace

    from revtrain.parallel.launch import launch_ranks, run_rank
    from revtrain.parallel.runner import checked_split, default_run_dir, train

    options, petra = petra_run_options(train_given, parallel, petra_given)
    if torchrun:  # this process is one stage
        run_rank(lambda: train(replace(options, engine="processes"), petra))
    if options.engine == "simulator":
        train(options, petra)
        return 0
    split = checked_split(options, petra)  # a clear error before any process starts; measured once
    run_dir = options.run_dir or str(default_run_dir(options))
    extra = ["--run-dir", run_dir] + (["--split", ",".join(map(str, split))] if split else [])
    n = options.replicas
    role = (lambda r: f"stage {r}") if n == 1 else (lambda r: f"stage {r // n}, replica {r % n}")
    launch_ranks([*argv, *extra], options.stages * n, role=role, run="PETRA run", port=options.port)
    return 0


def _run_data_parallel(argv: list[str], train_given: dict[str, Any], parallel: ParallelConfig, torchrun: bool) -> int:
    from revtrain.parallel.launch import launch_ranks, run_rank
    from revtrain.parallel.replicas import prepare_data_parallel, run_data_parallel_rank

    world = parallel.data_parallel
    assert world is not None
    if torchrun:  # this process is one rank
        run_rank(lambda: run_data_parallel_rank(train_given, world, sharded=parallel.shard,
                                                backend=parallel.backend, timeout=parallel.timeout))
    extra = prepare_data_parallel(train_given, world, backend=parallel.backend)
    launch_ranks([*argv, *extra], world, role=lambda r: f"replica {r} of {world}", run="data-parallel run",
                 port=parallel.port)
    return 0
