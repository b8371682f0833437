"""Start a run's local ranks through torch's elastic agent, what ``torchrun`` runs.

:func:`launch_ranks` starts ``python -m revtrain.cli <argv>`` on N local processes with
``torch.distributed.launcher.api.elastic_launch`` (a c10d rendezvous on this machine, no
restarts). Every rank is then the same program as one started by ``torchrun --nnodes ...``
by hand: the local path and the multi-node path are one code path.

What the agent does for us: it watches the ranks, and when one fails (an exception, ``kill -9``,
out of memory) it stops the others (SIGTERM, then SIGKILL after ``_SHUTDOWN_S``) and
raises ``ChildFailedError`` with each rank's exit code or signal and, from the error file a
rank writes (its ``TORCHELASTIC_ERROR_FILE``, :mod:`revtrain.parallel.command`), the exception
that ended it. A signal to the launcher (Ctrl-C, SIGTERM) is forwarded once to every rank, which
then saves a checkpoint as a single-process run does. What we add: the message, which names
the rank that failed first, its role in the run (stage or replica) and the cause, and
:func:`die_with_launcher`, which ends a rank whose launcher was killed outright (``kill -9``).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import socket
import sys
import threading
import uuid
from collections.abc import Callable, Iterator, Sequence

from revtrain.parallel.errors import PipelineConfigError, StageFailedError

__all__ = ["launch_ranks", "die_with_launcher", "check_port"]

_PR_SET_PDEATHSIG = 1
_SHUTDOWN_S = 120
"""Seconds the agent gives the ranks to stop after SIGTERM before SIGKILL: a rank stopped by a
signal finishes its step and saves a checkpoint first (a rank whose neighbour died fails at once)."""


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


def launch_ranks(argv: Sequence[str], nprocs: int, *, role: Callable[[int], str], run: str, port: int = 0) -> None:
    """Run ``python -m revtrain.cli <argv>`` on ``nprocs`` local ranks; return when all succeeded.

    Args:
        argv: The ``revtrain`` command line of every rank (``train ...``).
        nprocs: Ranks to start.
        role: What rank ``r`` is in the run, for messages (``stage 1``, ``replica 1 of 2``).
        run: What is stopped on a failure, for messages (``PETRA run``).
        port: Rendezvous port (0: a free one).

    Raises:
        StageFailedError: a rank failed; the others were stopped (names the rank, its role and
            the cause).
        SignalException: the launcher got SIGINT or SIGTERM; every rank got it too.
    """
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    if port:
        check_port(port)
    config = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=nprocs, run_id=f"revtrain-{uuid.uuid4().hex[:12]}",
                          rdzv_backend="c10d", rdzv_endpoint=f"127.0.0.1:{port}", max_restarts=0,
                          monitor_interval=0.1, local_addr="127.0.0.1", shutdown_timeout=_SHUTDOWN_S)
    with _launcher_state_restored(config.signals_to_handle):
        try:
            elastic_launch(config, entrypoint=sys.executable)("-m", "revtrain.cli", *argv)
        except ChildFailedError as err:
            raise StageFailedError(_failure_message(err, role, run)) from None


_AGENT_ENV = "TORCHELASTIC_SIGNALS_TO_HANDLE"


@contextlib.contextmanager
def _launcher_state_restored(signal_names: str) -> Iterator[None]:
    """Give the caller back what the agent changes for good: its handlers of the signals it
    forwards to the ranks (``signal_names``, the launch config's ``signals_to_handle``), and the
    environment variable that names them (a notebook or a test that ran a multi-process run
    in-process keeps its own Ctrl-C)."""
    names = [name.strip() for name in signal_names.split(",")]
    signals = [getattr(signal, name) for name in names if hasattr(signal, name)]
    handlers = [(sig, signal.getsignal(sig)) for sig in signals]
    env = os.environ.get(_AGENT_ENV)
    try:
        yield
    finally:
        if threading.current_thread() is threading.main_thread():
            for sig, handler in handlers:
                if handler is not None:
                    signal.signal(sig, handler)
        if env is None:
            os.environ.pop(_AGENT_ENV, None)
        else:
            os.environ[_AGENT_ENV] = env


def _failure_message(err: object, role: Callable[[int], str], run: str) -> str:
    failures = err.failures  # type: ignore[attr-defined]
    # A rank killed by a signal (not the launcher's SIGTERM) is the cause; its neighbours then
    # fail because it vanished, and may report before the agent sees the killed one.
    killed = sorted(r for r, f in failures.items() if f.exitcode is not None and f.exitcode < 0
                    and f.signal_name() != "SIGTERM")
    first_rank, first = (killed[0], failures[killed[0]]) if killed else err.get_first_failure()  # type: ignore[attr-defined]
    lines = [f"rank {first_rank} ({role(first_rank)}, pid {first.pid}) {_how(first)}; the {run} was stopped"]
    for rank, failure in sorted(failures.items()):
        cause = _cause(failure)
        if rank == first_rank:
            lines.append(f"  rank {rank} ({role(rank)}): failed first" + (f": {cause}" if cause else ""))
        elif failure.signal_name() == "SIGTERM" and not cause:
            lines.append(f"  rank {rank} ({role(rank)}): stopped by the launcher")
        else:
            lines.append(f"  rank {rank} ({role(rank)}): {_how(failure)}" + (f": {cause}" if cause else ""))
    return "\n".join(lines)


def _how(failure: object) -> str:
    code = failure.exitcode  # type: ignore[attr-defined]
    if code is not None and code < 0:
        return f"was killed by {failure.signal_name()}"  # type: ignore[attr-defined]
    return f"exited with code {code}"


def _cause(failure: object) -> str:
    message = failure.message  # type: ignore[attr-defined]
    if isinstance(message, dict):
        message = message.get("message", "")
    if not message or message.startswith("Signal ") or message == "<N/A>":
        return ""
    return str(message).strip().splitlines()[-1]


def die_with_launcher() -> None:
    """Have the kernel kill this rank when its launcher dies (Linux ``PR_SET_PDEATHSIG`` with
    SIGKILL): a launcher killed with ``kill -9`` leaves no rank running unseen. The rank ends at
    once, without a checkpoint: the launcher hosted the run's rendezvous store, so the ranks could
    no longer agree on a save (a stop they tried could wait on its peers until the collective
    timeout). SIGTERM or Ctrl-C to a living launcher is what saves a checkpoint. Elsewhere a no-op."""
    if not sys.platform.startswith("linux"):
        return
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
    except OSError:
        pass
