"""Run folders: where runs live, which run is the latest, and a folder's life cycle.

A run folder holds ``config.json``, ``metrics.jsonl``, ``checkpoint.pt``, ``summary.json`` (and
``plan.json`` when a plan chose the modes). A folder *holds a run* once it has a checkpoint:
from then on only ``--resume`` may write into it. A run that fails before its first checkpoint
leaves nothing behind (:meth:`RunFolder.discard`): there is nothing in it to resume.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from contextlib import suppress
from pathlib import Path

from revtrain.errors import RevtrainError
from revtrain.train.checkpoint import CHECKPOINT_NAME
from revtrain.train.files import remove_stale_temp_files

__all__ = ["RUNS_ROOT", "RUN_FILES", "RunExistsError", "RunFolder", "find_latest_run", "holds_run", "new_run_dir"]

RUNS_ROOT = Path("runs")
"""Where default run folders go (relative to the working directory)."""
RUN_FILES = ("config.json", "metrics.jsonl", "plan.json", "summary.json", CHECKPOINT_NAME)
"""The files a run writes into its folder."""


class RunExistsError(RevtrainError, ValueError):
    """A run would write into a folder that already holds another run."""


def holds_run(folder: str | Path) -> bool:
    """Whether ``folder`` holds a run: it has a checkpoint to resume."""
    return (Path(folder) / CHECKPOINT_NAME).is_file()


def new_run_dir(model: str, dataset: str, root: Path = RUNS_ROOT) -> Path:
    """``<root>/<model>-<dataset>-<YYYYmmdd-HHMMSS>``, with a numeric suffix if that exists."""
    base = root / f"{model}-{dataset}-{time.strftime('%Y%m%d-%H%M%S')}"
    path, n = base, 1
    while path.exists():
        n += 1
        path = base.with_name(f"{base.name}-{n}")
    return path


def find_latest_run(model: str, dataset: str, root: Path = RUNS_ROOT) -> Path | None:
    """The run folder of ``model`` on ``dataset`` under ``root`` that was active last, or None.

    A folder counts if it holds any run file; "active last" is the newest modification time
    among its run files (a run that is resumed becomes the latest again). The latest run may
    have no checkpoint (it was killed before its first save): callers say so rather than
    silently picking an older run.
    """
    latest: tuple[float, Path] | None = None
    for folder in root.glob(f"{model}-{dataset}-*"):
        times = [(folder / name).stat().st_mtime for name in RUN_FILES if (folder / name).is_file()]
        if folder.is_dir() and times and (latest is None or max(times) > latest[0]):
            latest = (max(times), folder)
    return latest[1] if latest else None


class RunFolder:
    """The folder one process writes a run into.

    :meth:`open` creates it (and its parents) if needed and removes temporary files left by
    killed saves; :meth:`discard` removes what this run wrote if it never saved a checkpoint.
    """

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._created: list[Path] = []  # folders this process made, deepest first
        self._found: set[str] = set()  # run files that were there before

    @property
    def checkpoint_path(self) -> Path:
        return self.path / CHECKPOINT_NAME

    def open(self, log: Callable[[str], None] = print) -> RunFolder:
        """Create the folder if missing and clean up stale temporary files; returns self."""
        missing = [p for p in (self.path, *self.path.parents) if not p.exists()]
        self.path.mkdir(parents=True, exist_ok=True)
        self._created = missing
        self._found = {name for name in RUN_FILES if (self.path / name).exists()}
        stale = remove_stale_temp_files(self.path, RUN_FILES)
        if stale:
            log(f"removed {len(stale)} temporary file(s) left in {self.path} by a killed save: "
                f"{', '.join(p.name for p in stale)}")
        return self

    def discard(self) -> bool:
        """If no checkpoint was saved, remove the run files and the folders this process made.

        Returns whether anything was discarded. A folder that holds a checkpoint is left alone,
        and so are files that were there before :meth:`open` (a plan given as input, say).
        """
        if holds_run(self.path):
            return False
        for name in set(RUN_FILES) - self._found:
            with suppress(FileNotFoundError):
                (self.path / name).unlink()
        remove_stale_temp_files(self.path, RUN_FILES)
        for folder in self._created:
            with suppress(OSError):  # not empty: someone else's files are there
                folder.rmdir()
        return True
