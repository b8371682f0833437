"""Start ``revtrain train`` as a launcher process and wait until it trains (shared by the tests
that signal a running launcher)."""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def launch_until_training(cmd: Sequence[str], run_dir: Path, start_s: float) -> subprocess.Popen:
    """Start ``cmd`` (this checkout's revtrain, pipes for stdout and stderr) and return it once
    ``run_dir/metrics.jsonl`` holds a step record; fails if it ends or takes over ``start_s``."""
    proc = subprocess.Popen(list(cmd), env=dict(os.environ, PYTHONPATH=str(REPO)), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + start_s
        while '"event": "step"' not in text_of(run_dir / "metrics.jsonl"):  # training is under way
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline, "the run did not start"
            time.sleep(0.2)
    except BaseException:
        if proc.poll() is None:
            proc.kill()
        raise
    return proc


def text_of(path: Path) -> str:
    """The file's text, or '' where it does not exist (yet)."""
    try:
        return path.read_text()
    except OSError:
        return ""
