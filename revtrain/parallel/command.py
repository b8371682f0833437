"""``revtrain train`` on several processes: ``--stages J`` (PETRA), ``--data-parallel N`` (DDP), ``--shard`` (FSDP2).

``--stages`` and PETRA's options are fields of :class:`~revtrain.train.TrainConfig` (the one run
config); how the processes are started is :class:`ParallelConfig`, whose options
``revtrain.cli`` adds to the ``train`` command. :func:`run_parallel` runs the command when it asks
for several processes (None otherwise: the ordinary run in this process, with the engine of
:func:`single_process_engine`). Every run validates its options as one process does
(:class:`~revtrain.train.TrainConfig`: PETRA refuses there what its stages cannot honour) and
resolves its folder and checkpoint once (:func:`~revtrain.train.resolve_run`) before any
process starts; every rank is the ordinary :class:`~revtrain.train.Trainer` with its engine:

- ``--stages J``: a :class:`~revtrain.parallel.petra_engine.PetraEngine`, on ``J`` ranks
  (``J x N`` with ``--data-parallel N``), or in this process with ``--engine simulator``;
- ``--data-parallel N``: a :class:`~revtrain.parallel.replicas.DataParallelEngine`; ``--shard``
  shards it with FSDP2.

Local ranks start through torch's elastic agent (:func:`~revtrain.parallel.launch.launch_ranks`);
under ``torchrun`` this process is one rank: it trains instead of launching.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal, NoReturn

from revtrain.parallel.errors import PipelineConfigError, StageFailedError
from revtrain.train.config import TrainConfig

__all__ = ["ParallelConfig", "run_parallel", "single_process_engine"]


@dataclass(kw_only=True)
class ParallelConfig:
    """How ``revtrain train`` spreads a run over processes (none of these: one process)."""

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
        value = self.data_parallel
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise PipelineConfigError(f"--data-parallel must be an integer >= 1, got {value!r}")
        if self.shard and self.data_parallel is None:
            raise PipelineConfigError("--shard shards over data-parallel processes; add --data-parallel N")
        if not 0 <= self.port < 65536:
            raise PipelineConfigError(f"--port must be in [0, 65535], got {self.port}")
        if not self.timeout > 0:
            raise PipelineConfigError(f"--timeout must be > 0 seconds, got {self.timeout}")


def run_parallel(argv: Sequence[str], train_given: dict[str, Any], parallel_given: dict[str, Any]) -> int | None:
    """Run ``revtrain train`` on several processes if its options ask for it; None otherwise.

    Args:
        argv: The command line (``train ...``): what every local rank runs.
        train_given: The :class:`~revtrain.train.TrainConfig` options given.
        parallel_given: The :class:`ParallelConfig` options given.

    Returns:
        The exit status (1: a process failed, the message is printed; 128 + a signal that
        stopped the run), or None when the run is one process (PETRA's simulator included).
    """
    from torch.distributed.elastic.multiprocessing.api import SignalException

    torchrun = "TORCHELASTIC_RUN_ID" in os.environ and "WORLD_SIZE" in os.environ
    stages = train_given.get("stages")
    if not parallel_given and stages is None:
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
    config = TrainConfig(**train_given)  # every engine validates the run's options as one process does
    if config.stages is not None:
        _check_petra(config, parallel)
        if config.engine == "simulator":
            if torchrun and int(os.environ["WORLD_SIZE"]) > 1:
                raise PipelineConfigError("--engine simulator runs every stage in one process, and torchrun started "
                                          f"{os.environ['WORLD_SIZE']}; use --engine processes, or start one process")
            return None
    if torchrun:  # this process is one rank: it trains instead of launching
        _run_rank(train_given, parallel, config.stages)
    try:
        if config.stages is not None:
            return _run_petra(list(argv), train_given, parallel, config.stages)
        return _run_data_parallel(list(argv), train_given, parallel)
    except StageFailedError as err:
        print(f"revtrain train: {type(err).__name__}: {err}", file=sys.stderr)
        return 1
    except SignalException as stop:  # every rank got the signal too and saved its checkpoint
        print(f"revtrain train: stopped by {stop.sigval.name}; every rank was asked to save a checkpoint",
              file=sys.stderr)
        return 128 + int(stop.sigval)


def single_process_engine(train_given: dict[str, Any]) -> Any:
    """The engine of a run in this process: PETRA's simulator for ``--stages J --engine simulator``,
    else None (the Trainer's own, one process)."""
    if train_given.get("stages") is not None and train_given.get("engine") == "simulator":
        from revtrain.parallel.petra_engine import PetraEngine

        return PetraEngine(simulate=True)
    return None


def _check_petra(config: TrainConfig, parallel: ParallelConfig) -> None:
    """What a PETRA run cannot do with the process options, before anything starts."""
    n = parallel.data_parallel
    if n is None:
        return
    if parallel.shard:
        raise PipelineConfigError("--shard with --stages: the replicas of a PETRA stage all-reduce their "
                                  "gradients, they do not shard them; drop --shard")
    if config.engine == "simulator":
        raise PipelineConfigError("--engine simulator runs one replica of every stage; drop --data-parallel "
                                  "or use --engine processes")
    if config.batch_size % n:
        raise PipelineConfigError(f"--batch-size {config.batch_size} cannot be cut into {n} equal replica slices; "
                                  f"use a multiple of {n}")


def check_petra_split(config: TrainConfig) -> None:
    """Build the model once and cut it as the ranks will (counted, or as --split says), so that
    a split that cannot work fails here with a clear error, before any process starts."""
    from revtrain.data import build_dataloaders
    from revtrain.parallel.partition import split_model
    from revtrain.parallel.petra_engine import parse_split
    from revtrain.parallel.worker import plan_segments
    from revtrain.train.build import build_model, fit_model_to_data, text_window

    loader, _, info = build_dataloaders(config.dataset, batch_size=config.batch_size, data_dir=config.data_dir,
                                        seed=config.seed, augment=config.augment, image_size=config.image_size,
                                        **text_window(config))
    fit = fit_model_to_data(config.model, config.task, info, next(iter(loader))[0])
    stages = split_model(build_model(config.model, fit.overrides), config.stages, parse_split(config.split))
    for stage in stages[:-1]:
        plan_segments(stage, config.input_buffer)  # refuses input_buffer="none" on a non-reversible stage


def _run_rank(train_given: dict[str, Any], parallel: ParallelConfig, stages: int | None) -> NoReturn:
    """One rank of the run (started by the local launcher or torchrun): the Trainer with its engine."""
    from revtrain.parallel.launch import run_rank
    from revtrain.parallel.petra_engine import run_petra_rank
    from revtrain.parallel.replicas import run_data_parallel_rank

    if stages is not None:
        run_rank(lambda: run_petra_rank(train_given, parallel.data_parallel or 1, backend=parallel.backend,
                                        timeout=parallel.timeout))
    run_rank(lambda: run_data_parallel_rank(train_given, parallel.data_parallel, sharded=parallel.shard,
                                            backend=parallel.backend, timeout=parallel.timeout))


def _run_petra(argv: list[str], train_given: dict[str, Any], parallel: ParallelConfig, stages: int) -> int:
    from revtrain.parallel.launch import launch_ranks
    from revtrain.parallel.replicas import prepare_data_parallel

    n = parallel.data_parallel or 1
    check_petra_split(TrainConfig(**train_given))
    extra = prepare_data_parallel(train_given, stages * n, backend=parallel.backend)
    role = (lambda r: f"stage {r}") if n == 1 else (lambda r: f"stage {r // n}, replica {r % n}")
    launch_ranks([*argv, *extra], stages * n, role=role, run="PETRA run", port=parallel.port)
    return 0


def _run_data_parallel(argv: list[str], train_given: dict[str, Any], parallel: ParallelConfig) -> int:
    from revtrain.parallel.launch import launch_ranks
    from revtrain.parallel.replicas import prepare_data_parallel

    world = parallel.data_parallel
    assert world is not None
    extra = prepare_data_parallel(train_given, world, backend=parallel.backend)
    launch_ranks([*argv, *extra], world, role=lambda r: f"replica {r} of {world}", run="data-parallel run",
                 port=parallel.port)
    return 0
