"""Start J local stage processes and watch them: the local launcher of a PETRA run.

:func:`launch` checks everything that can be checked before any process starts (the split fits
the model, the backend exists, the rendezvous port is free), measures the balanced split once
(so every rank uses the same), writes the run's settings, then starts one
``python -m revtrain.parallel --worker-config <file>`` process per stage with the ``env://``
rendezvous variables that ``torchrun`` would set (``MASTER_ADDR``, ``MASTER_PORT``, ``RANK``,
``WORLD_SIZE``, ``LOCAL_RANK``).

**Watchdog.** The launcher polls its children. When one exits with an error or is killed by a
signal (``kill -9``), the others are given a few seconds to stop on their own (their
neighbours' receives fail), then terminated, then killed; :class:`~revtrain.parallel.errors.StageFailedError`
names the stage that failed first, how (exit code or signal), and what each failed stage wrote
to its error file. A stage that hangs without dying makes its neighbours time out (``timeout``
seconds per tick), which the watchdog then sees the same way. So a run never hangs: it ends
within ``timeout`` plus a few seconds of a failure.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any, NoReturn

import torch

from revtrain.parallel.config import PetraConfig
from revtrain.parallel.distributed import check_backend, exit_rank
from revtrain.parallel.errors import PipelineConfigError, StageFailedError
from revtrain.parallel.options import RunOptions, parse_split
from revtrain.parallel.partition import split_model
from revtrain.parallel.worker import plan_segments

__all__ = ["launch", "start_workers", "watch", "free_port", "check_port", "ERROR_FILE_ENV", "run_rank"]

ERROR_FILE_ENV = "REVTRAIN_ERROR_FILE"
"""Environment variable naming the file a worker writes its error to before exiting."""

_GRACE_S = 3.0
_POLL_S = 0.1


def run_rank(work: Callable[[], object]) -> NoReturn:
    """Run a started rank's ``work``, then end the process with :func:`~revtrain.parallel.distributed.exit_rank`.

    A failure is printed and its traceback written to the file the launcher reads
    (``ERROR_FILE_ENV``), so that its message names the cause; the exit code is 1 (128 + the
    signal for a stop on Ctrl-C or SIGTERM).
    """
    code = 1
    try:
        work()
        code = 0
    except KeyboardInterrupt as stop:
        code = 128 + int(getattr(stop, "signum", signal.SIGINT))
    except BaseException as err:  # noqa: BLE001 - report every failure to the launcher, then fail
        traceback.print_exc()
        error_file = os.environ.get(ERROR_FILE_ENV)
        if error_file:
            with open(error_file, "w") as f:
                f.write(traceback.format_exc())
                f.write(f"{type(err).__name__}: {err}\n")
    finally:
        exit_rank(code)


def free_port() -> int:
    """A TCP port that is free on this machine right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def check_port(port: int) -> None:
    """Raise a clear error when ``port`` cannot be bound on this machine."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError as err:
            raise PipelineConfigError(
                f"rendezvous port {port} is in use ({err.strerror}); pass another --port, or --port 0 "
                "to pick a free one"
            ) from None


def launch(options: RunOptions, petra: PetraConfig, *, log: Callable[[str], None] = print,
           worker_output: Any = None) -> dict[str, Any]:
    """Run ``options`` on ``options.stages`` local processes; returns rank 0's summary.

    Args:
        options: The run; ``engine`` must be ``"processes"``.
        petra: PETRA's options.
        log: Where the launcher's own messages go.
        worker_output: ``stdout``/``stderr`` of the workers (default: inherited, so rank 0's
            progress lines show); e.g. ``subprocess.DEVNULL`` or an open file.

    Raises:
        PipelineConfigError: a setting that cannot work, before any process starts.
        StageFailedError: a stage failed; the others were stopped (see the module docstring).
    """
    from revtrain.parallel.runner import default_run_dir

    device = torch.device("cuda" if options.device == "cuda" or (options.device == "auto" and torch.cuda.is_available()) else "cpu")
    check_backend(options.backend, device)
    if options.port:
        check_port(options.port)
    split = _checked_split(options, petra, device)
    run_dir = Path(options.run_dir) if options.run_dir else default_run_dir(options)
    run_dir.mkdir(parents=True, exist_ok=True)
    port = options.port or free_port()
    worker_options = replace(options, split=",".join(map(str, split)) if split else options.split,
                             run_dir=str(run_dir), port=port)
    config = run_dir / "launch.json"
    config.write_text(json.dumps({"options": worker_options.to_dict(), "petra": vars(petra)}, indent=2))
    errors = run_dir / "errors"
    procs = start_workers(["-m", "revtrain.parallel", "--worker-config", str(config)], options.stages,
                          port=port, threads=options.threads, errors=errors, output=worker_output)
    watch(procs, errors)
    summary_path = run_dir / "summary.json"
    return json.loads(summary_path.read_text()) if summary_path.exists() else {"run_dir": str(run_dir)}


def _checked_split(options: RunOptions, petra: PetraConfig, device: torch.device) -> list[int] | list[str] | None:
    """Validate the split on the real model (a clear error before any process starts); measure a balanced one."""
    from revtrain.data import build_dataloaders
    from revtrain.models import create_model
    from revtrain.parallel.runner import measured_split

    split = parse_split(options.split)
    train_loader, _, info = build_dataloaders(options.dataset, batch_size=options.batch_size, data_dir=options.data_dir,
                                              seed=options.seed, image_size=options.image_size, drop_last=True)
    dtype = torch.float64 if options.dtype == "float64" else torch.float32
    torch.manual_seed(options.seed)
    model = create_model(options.model, in_channels=info.in_channels, num_classes=info.num_classes).to(device, dtype)
    if split is None and options.balance == "time" and options.stages > 1:
        threads = torch.get_num_threads()
        torch.set_num_threads(options.threads)  # time units as the workers will run them
        try:
            x, _ = next(iter(train_loader))
            split = measured_split(model, options.stages, x.to(device, dtype))
        finally:
            torch.set_num_threads(threads)
    for stage in split_model(model, options.stages, split)[:-1]:
        plan_segments(stage, petra.input_buffer)  # refuses input_buffer="none" on a non-reversible stage
    return split


def start_workers(argv: list[str], world: int, *, port: int, threads: int, errors: Path,
                  output: Any = None) -> list[subprocess.Popen]:
    """Start ``world`` local ``python <argv>`` processes with the ``env://`` rendezvous variables
    torchrun would set, ``OMP_NUM_THREADS=threads``, and each its own error file in ``errors``."""
    errors.mkdir(parents=True, exist_ok=True)
    for old in errors.glob("rank*.txt"):
        old.unlink()
    procs = []
    for rank in range(world):
        env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                   WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
                   OMP_NUM_THREADS=str(threads), **{ERROR_FILE_ENV: str(errors / f"rank{rank}.txt")})
        procs.append(subprocess.Popen([sys.executable, *argv], env=env, stdout=output, stderr=output))
    return procs


def watch(procs: list[subprocess.Popen], errors: Path, *, role: str = "stage", run: str = "PETRA run") -> None:
    """Wait for every process; when one fails, stop the others and raise ``StageFailedError``.

    Args:
        procs: The processes, by rank.
        errors: The folder of their error files (``rank<r>.txt``).
        role: What a rank is called in the message ("stage", "rank").
        run: What was stopped ("PETRA run", "data-parallel run").
    """
    try:
        while True:
            codes = [p.poll() for p in procs]
            if all(c == 0 for c in codes):
                return
            failed = [r for r, c in enumerate(codes) if c not in (None, 0)]
            if failed:
                break
            time.sleep(_POLL_S)
        first = _first_failure(procs, failed)
        deadline = time.monotonic() + _GRACE_S
        while time.monotonic() < deadline and any(p.poll() is None for p in procs):
            time.sleep(_POLL_S)
    except KeyboardInterrupt:
        _stop(procs)
        raise
    stopped = _stop(procs)
    raise StageFailedError(_failure_message(procs, first, stopped, errors, role, run))


def _first_failure(procs: list[subprocess.Popen], failed: list[int]) -> int:
    # A stage killed by a signal is the cause; its neighbours then fail because it vanished.
    killed = [r for r in failed if (procs[r].returncode or 0) < 0]
    return (killed or failed)[0]


def _stop(procs: list[subprocess.Popen]) -> list[int]:
    stopped = [r for r, p in enumerate(procs) if p.poll() is None]
    for r in stopped:
        procs[r].terminate()
    deadline = time.monotonic() + _GRACE_S
    for r in stopped:
        try:
            procs[r].wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            procs[r].kill()
            procs[r].wait()
    return stopped


def _how(code: int | None) -> str:
    if code is None:
        return "still running"
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        return f"was killed by {name}"
    return f"exited with code {code}"


def _failure_message(procs: list[subprocess.Popen], first: int, stopped: list[int], errors: Path,
                     role: str = "stage", run: str = "PETRA run") -> str:
    who = (lambda r: f"stage {r} (rank {r}") if role == "stage" else (lambda r: f"rank {r} (")
    lines = [f"{who(first)}{', ' if role == 'stage' else ''}pid {procs[first].pid}) "
             f"{_how(procs[first].returncode)}; the {run} was stopped"]
    for r, p in enumerate(procs):
        note = (errors / f"rank{r}.txt").read_text().strip() if (errors / f"rank{r}.txt").exists() else ""
        if r == first or p.returncode not in (0, None) and r not in stopped:
            state = _how(p.returncode) if r != first else "failed first"
            lines.append(f"  {role} {r}: {state}" + (f": {note.splitlines()[-1]}" if note else ""))
        elif r in stopped:
            lines.append(f"  {role} {r}: stopped by the launcher")
    return "\n".join(lines)
