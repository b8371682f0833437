"""Checkpoint retention: keep the checkpoints of the last ``k`` evaluations and the best one.

``checkpoint.pt`` is always the latest state (what ``--resume`` continues). With
``--keep-checkpoints K`` the run also keeps, in ``<run>/checkpoints/``, ``step-<step>.pt`` for each
of the last ``K`` evaluated epochs and ``best.pt``, the checkpoint of the epoch with the best test
value of the task's headline metric (accuracy: highest; bits per byte: lowest; the earliest on a
tie), like timm's ``--checkpoint-hist`` and Lightning's ``save_top_k``. Kept files are hard links
to the checkpoint written (copies where the file system has no links), so keeping costs no
writing; ``revtrain.load`` and ``--resume`` take any of them.
"""

from __future__ import annotations

import os
import re
import shutil
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from revtrain.train.files import atomic_write

__all__ = ["CheckpointRetention"]

_STEP_FILE = re.compile(r"step-(\d+)\.pt$")


class CheckpointRetention:
    """Keep the last ``keep`` evaluated checkpoints and the best one in ``folder``.

    Args:
        folder: Where the kept checkpoints go (``<run>/checkpoints``).
        keep: How many of the latest evaluated checkpoints to keep (>= 1).
        metric: The epoch record's key to rank by (``"test_acc"``).
        higher_is_better: Whether a larger ``metric`` is better.
    """

    def __init__(self, folder: str | os.PathLike[str], keep: int, metric: str, higher_is_better: bool) -> None:
        if keep < 1:
            raise ValueError(f"keep must be >= 1, got {keep}")
        self.folder, self.keep, self.metric, self.higher = Path(folder), keep, metric, higher_is_better

    def after_save(self, checkpoint: Path, step: int, history: Sequence[Mapping[str, Any]]) -> list[Path]:
        """Called after each save of ``checkpoint`` at ``step``; acts when that step was just evaluated
        (the last record of ``history``). Returns the kept files (empty when it did not act)."""
        if not history or history[-1].get("step") != step:
            return []
        self.folder.mkdir(parents=True, exist_ok=True)
        snapshot = self.folder / f"step-{step:08d}.pt"
        _link(checkpoint, snapshot)
        best = self.best(history)
        if best is not None and best.get("step") == step:
            _link(checkpoint, self.folder / "best.pt")
        keep_steps = {int(r["step"]) for r in history[-self.keep:]}
        for path in self.folder.glob("step-*.pt"):
            match = _STEP_FILE.match(path.name)
            if match and int(match.group(1)) not in keep_steps:
                path.unlink()
        return sorted(self.folder.glob("*.pt"))

    def best(self, history: Sequence[Mapping[str, Any]]) -> Mapping[str, Any] | None:
        """The epoch record with the best metric (the earliest of equals), or None if none has it."""
        scored = [r for r in history if isinstance(r.get(self.metric), (int, float))]
        if not scored:
            return None
        sign = -1 if self.higher else 1
        return min(scored, key=lambda r: (sign * r[self.metric], r["step"]))


def _link(source: Path, target: Path) -> None:
    """``target`` becomes the same file as ``source``: a hard link, or an atomic copy."""
    tmp = target.with_name(f".{target.name}.{os.getpid()}.link.tmp")
    try:
        tmp.unlink(missing_ok=True)
        os.link(source, tmp)
        os.replace(tmp, target)
        tmp.unlink(missing_ok=True)  # rename does nothing when both names are links of one file already
    except OSError:
        tmp.unlink(missing_ok=True)
        with source.open("rb") as f:
            atomic_write(target, lambda out: shutil.copyfileobj(f, out), what="checkpoint")
