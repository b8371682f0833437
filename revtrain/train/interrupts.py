"""Stopping a run on a signal: Ctrl-C (SIGINT) and SIGTERM (what schedulers and containers send).

The first signal only *requests* a stop: the loop finishes the current step, saves a checkpoint
and raises :class:`TrainingInterrupted`. A second signal raises ``KeyboardInterrupt`` at once
(an abort: nothing is saved inside a half-done step).
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

__all__ = ["StopSignals", "TrainingInterrupted"]

_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class TrainingInterrupted(KeyboardInterrupt):
    """Training stopped on a signal (Ctrl-C, SIGTERM) after saving a checkpoint."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum
        """The signal that asked to stop (``signal.SIGINT`` or ``signal.SIGTERM``)."""


class StopSignals:
    """Turn SIGINT and SIGTERM into a stop request that the training loop checks between steps.

    Args:
        log: Called with a line when a stop is requested.
    """

    def __init__(self, log: Callable[[str], None]) -> None:
        self.log = log
        self.signum: int | None = None
        """The signal that requested a stop, or None."""

    def check(self) -> None:
        """Raise :class:`TrainingInterrupted` if a stop was requested."""
        if self.signum is not None:
            raise TrainingInterrupted(self.signum)

    def check_agreed(self, agree: Callable[[int | None], int | None]) -> None:
        """Raise :class:`TrainingInterrupted` if any process of the run requested a stop.

        Args:
            agree: The engine's ``agree_stop``: this process's request in, the run's out (the
                same on every process, so that every process stops at this point or none does).

        A signal that lands while the processes agree is kept for the next agreement: the
        request read before the agreement is not written back over it.
        """
        signum = agree(self.signum)
        if signum is not None:
            self.signum = signum
            raise TrainingInterrupted(signum)

    @contextmanager
    def installed(self) -> Iterator[None]:
        """Handle the signals inside the block (main thread only); the previous handlers come back after."""
        self.signum = None
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        previous = {s: signal.signal(s, self._request) for s in _SIGNALS}
        try:
            yield
        finally:
            for s, handler in previous.items():
                signal.signal(s, handler)

    def _request(self, signum: int, frame: Any) -> None:
        if self.signum is not None:
            raise KeyboardInterrupt
        self.signum = signum
        name = "Ctrl-C" if signum == signal.SIGINT else signal.Signals(signum).name
        self.log(f"\n{name}: stopping after this step to save a checkpoint (a second {name} aborts at once)")
