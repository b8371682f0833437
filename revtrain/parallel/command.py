"""``revtrain train`` on several processes: ``--stages J`` (PETRA), ``--data-parallel N`` (DDP), ``--shard`` (FSDP2).

Every option of a run, these included, is a field of :class:`~revtrain.train.TrainConfig`, the
one run config that ``config.json`` records and that validates them (what PETRA or data
parallelism cannot honour is refused there). :func:`run_parallel` runs the command when its
config asks for several processes (None otherwise: the ordinary run in this process, with the
engine of :func:`single_process_engine`). The run's folder and checkpoint are resolved once
(:func:`~revtrain.train.resolve_run`) before any process starts; every rank is the ordinary
:class:`~revtrain.train.Trainer` with its engine:

- ``--stages J``: a :class:`~revtrain.parallel.petra_engine.PetraEngine`, on ``J`` ranks
  (``J x N`` with ``--data-parallel N``), or in this process with ``--engine simulator``;
- ``--data-parallel N``: a :class:`~revtrain.parallel.replicas.DataParallelEngine`; ``--shard``
  shards it with FSDP2.

Local ranks start through torch's elastic agent (:func:`~revtrain.parallel.launch.launch_ranks`);
under ``torchrun`` this process is one rank: it trains instead of launching (:func:`_run_rank`).
"""

from __future__ import annotations

import os
import signal
import sys
import traceback
from collections.abc import Mapping, Sequence
from typing import Any, NoReturn

from revtrain.parallel.errors import PipelineConfigError, StageFailedError
from revtrain.train.config import TrainConfig

__all__ = ["run_parallel", "single_process_engine", "check_petra_split"]

_COLLECTIVE_TIMEOUT_S = 1800.0
"""PETRA's collectives (the split's measurement on rank 0, evaluation, checkpoints) may take longer
than a tick's wait for a neighbour (``--timeout``)."""


def run_parallel(argv: Sequence[str], given: dict[str, Any], resolved: Any) -> int | None:
    """Run ``revtrain train`` on several processes if its options ask for it; None otherwise.

    Args:
        argv: The command line (``train ...``): what every local rank runs.
        given: The :class:`~revtrain.train.TrainConfig` options given.
        resolved: The resumed run (``--resume``, resolved by the caller, so that its checkpoint
            is read once); None for a new run.

    Returns:
        The exit status (1: a process failed, the message is printed; 128 + a signal that
        stopped the run), or None when the run is one process (PETRA's simulator included).
    """
    from torch.distributed.elastic.multiprocessing.api import SignalException

    torchrun = "TORCHELASTIC_RUN_ID" in os.environ and "WORLD_SIZE" in os.environ
    world = int(os.environ.get("WORLD_SIZE", "1")) if torchrun else 1
    # Every engine validates the run's options as one process does; a resumed run was validated
    # with the options it keeps (its stages and split: its layout is the run's).
    config = resolved.config if resolved is not None else TrainConfig(**given)
    n = config.data_parallel
    if n is None and (config.stages is None or config.engine == "simulator"):
        if world > 1:
            fix = ("use --engine processes" if config.stages is not None else
                   f"add --data-parallel {world} (or --stages {world} for PETRA)")
            raise PipelineConfigError(f"torchrun started {world} processes but this run trains in one: each would "
                                      f"train the whole run into the same folder; {fix}, or start one process")
        return None
    if torchrun:  # this process is one rank: it trains instead of launching
        _run_rank(given, config, resolved)
    stages = config.stages or 1
    if config.stages is not None:
        check_petra_split(config)
    run = "PETRA run" if config.stages is not None else "data-parallel run"
    world = stages * (n or 1)
    if config.stages is None:
        role = (lambda r: f"replica {r} of {world}")
    elif n is None:
        role = (lambda r: f"stage {r}")
    else:
        role = (lambda r: f"stage {r // n}, replica {r % n}")
    try:
        from revtrain.parallel.launch import launch_ranks

        launch_ranks([*argv, *_prepare(given, world, resolved)], world, role=role, run=run, port=config.port)
        return 0
    except StageFailedError as err:
        print(f"revtrain train: {type(err).__name__}: {err}", file=sys.stderr)
        return 1
    except SignalException as stop:  # every rank got the signal too and saved its checkpoint
        print(f"revtrain train: stopped by {stop.sigval.name}; every rank was asked to save a checkpoint",
              file=sys.stderr)
        return 128 + int(stop.sigval)


def single_process_engine(config: TrainConfig) -> Any:
    """The engine of a resolved run in this process: PETRA's simulator for ``--stages J --engine
    simulator``, else None (the Trainer's own, one process). A run whose checkpoint holds PETRA's
    stages is refused here, before its folder is touched, unless it is given its stages again."""
    if config.stages is None:
        return None
    if config.engine != "simulator":
        raise PipelineConfigError(f"this run trains {config.stages} PETRA stages (its checkpoint holds one state per "
                                  f"stage); pass --stages {config.stages} --engine simulator to train them in this "
                                  f"process, or --stages {config.stages} for one process per stage")
    from revtrain.parallel.petra_engine import PetraEngine

    return PetraEngine(simulate=True)


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


def _prepare(given: Mapping[str, Any], world: int, run: Any = None) -> list[str]:
    """Resolve the run before any process starts (unless ``run`` is the resolved run already);
    returns the options every rank adds.

    The run folder and the checkpoint (:func:`~revtrain.train.resolve_run`: a folder holding
    another run, a checkpoint that does not fit), the backend for the device. The ranks get the
    folder (and the checkpoint) resolved here, and ``--threads`` sharing the cores when not given.
    """
    from revtrain.parallel.distributed import check_backend
    from revtrain.train.environment import resolve_device
    from revtrain.train.resume import resolve_run

    if run is None:
        run = resolve_run(dict(given))
    check_backend(run.config.backend, resolve_device(run.config.device))
    extra = ["--run-dir", str(run.run_dir)]
    if run.checkpoint is not None:
        extra += ["--resume", str(run.checkpoint)]
    if not given.get("threads"):
        extra += ["--threads", str(max(1, (os.cpu_count() or 1) // world))]
    return extra


def _run_rank(given: Mapping[str, Any], config: TrainConfig, resolved: Any = None) -> NoReturn:
    """One rank of the run (started by the local launcher or torchrun): join the group, resolve the
    run (rank 0 picks the folder and the checkpoint), train with the run's engine, then end the
    process (:func:`~revtrain.parallel.distributed.exit_rank`). ``config`` is the run's (a resumed
    run's, its stages included), which picks the engine; ``resolved``: the resumed run this process
    resolved already (its checkpoint is not read again when rank 0 picks the same).

    A failure is printed and recorded in the agent's error file (``TORCHELASTIC_ERROR_FILE``,
    what ``@record`` writes), so that the launcher's message names the cause; the exit code is 1
    (128 + the signal after a stop on Ctrl-C or SIGTERM, once the checkpoint is saved).
    """
    import torch
    import torch.distributed as dist
    from torch.distributed.elastic.multiprocessing.errors import get_error_handler

    from revtrain.parallel.distributed import check_backend, exit_rank, init_from_env
    from revtrain.parallel.launch import die_with_launcher
    from revtrain.parallel.petra_engine import PetraEngine
    from revtrain.parallel.replicas import DataParallelEngine
    from revtrain.train import Trainer
    from revtrain.train.environment import resolve_device
    from revtrain.train.resume import resolve_run

    die_with_launcher()
    code = 1
    try:
        device = resolve_device(config.device)
        if device.type == "cuda":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)) % torch.cuda.device_count())
        petra = config.stages is not None
        timeout = max(config.timeout, _COLLECTIVE_TIMEOUT_S) if petra else config.timeout
        rank, size = init_from_env(check_backend(config.backend, device), timeout)
        want = (config.stages or 1) * (config.data_parallel or 1)
        if size != want:
            raise PipelineConfigError(f"{size} processes joined a run of {want} (stages x --data-parallel); start "
                                      f"{want} processes, or pass the options that fit {size}")
        box: list[Any] = [None]
        if rank == 0:  # one folder and one checkpoint for every rank
            run = resolved if resolved is not None else resolve_run(dict(given))
            box = [{"run_dir": str(run.run_dir), "resume": str(run.checkpoint) if run.checkpoint else None}]
        dist.broadcast_object_list(box, src=0)
        mine = {k: v for k, v in given.items() if k != "resume"} | {"run_dir": box[0]["run_dir"]}
        if box[0]["resume"] is not None:
            mine["resume"] = box[0]["resume"]
        same = resolved is not None and box[0] == {"run_dir": str(resolved.run_dir), "resume": str(resolved.checkpoint)}
        run = (resolved if same else resolve_run(mine)) if rank != 0 else run
        dist.barrier()
        engine: Any = (PetraEngine(simulate=False, replicas=config.data_parallel or 1, timeout=config.timeout)
                       if petra else DataParallelEngine(sharded=config.shard))
        Trainer(run, engine=engine).fit()
        code = 0
    except KeyboardInterrupt as stop:
        code = 128 + int(getattr(stop, "signum", signal.SIGINT))
    except BaseException as err:  # noqa: BLE001 - report every failure to the launcher, then fail
        traceback.print_exc()
        if os.environ.get("TORCHELASTIC_ERROR_FILE"):
            get_error_handler().record_exception(err)
    finally:
        exit_rank(code)
