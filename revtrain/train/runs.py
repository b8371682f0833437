"""Run folders: where runs live, which run is the latest, and a folder's life cycle.

A run folder holds ``config.json``, ``metrics.jsonl``, ``checkpoint.pt`` (a data-parallel run:
checkpoint folders in ``checkpoints/``), ``summary.json`` (and ``plan.json`` when a plan chose
the modes). A folder *holds a run* once it has a checkpoint:
from then on only ``--resume`` may write into it. A run that fails before its first checkpoint
leaves nothing behind (:meth:`RunFolder.discard`): there is nothing in it to resume.
"""

from __future__ import annotations

import glob
import json
import shutil
import time
from collections.abc import Callable
from contextlib import suppress
from pathlib import Path
from typing import Any

from revtrain.errors import RevtrainError
from revtrain.train.checkpoint import CHECKPOINT_NAME
from revtrain.train.checkpoint_folder import latest_checkpoint
from revtrain.train.files import remove_stale_temp_files

__all__ = ["RUNS_ROOT", "RUN_FILES", "RUN_FOLDERS", "RunExistsError", "RunFolder", "clear_run_files", "find_latest_run", "folder_entries", "holds_run",
           "new_run_dir", "refuse_occupied", "run_name_spellings"]

RUNS_ROOT = Path("runs")
"""Where default run folders go (relative to the working directory)."""
RUN_FILES = ("config.json", "metrics.jsonl", "plan.json", "summary.json", CHECKPOINT_NAME, "steps.csv", "epochs.csv",
             "curves.png", "grad_angles.png")
"""The files a run writes into its folder (besides the folders ``checkpoints/`` and ``tensorboard/``)."""
RUN_FOLDERS = ("checkpoints", "tensorboard")
"""The folders a run may write into its folder: retained checkpoints, TensorBoard event files."""
REPLACED_FOLDER = ".replaced-run"
"""Where ``--overwrite`` keeps the run it replaces until the new run's first checkpoint."""


class RunExistsError(RevtrainError, ValueError):
    """A run would write into a folder that already holds another run."""


def holds_run(folder: str | Path) -> bool:
    """Whether ``folder`` holds a run: it has a checkpoint to resume (``checkpoint.pt``, or a
    complete checkpoint folder in ``checkpoints/``)."""
    return latest_checkpoint(folder) is not None


def folder_entries(folder: str | Path) -> list[str]:
    """The names in ``folder`` (sorted; empty when it is missing or not a folder)."""
    path = Path(folder)
    return sorted(p.name for p in path.iterdir()) if path.is_dir() else []


def refuse_occupied(run_dir: str | Path, *, overwrite: bool, flag: str = "--run-dir") -> None:
    """Refuse to start a new run in a folder that is not empty, unless ``overwrite``.

    Raises:
        RunExistsError: the folder holds files (a run to resume, or anything else); nothing
            was changed. The message lists what is there and names the way out.
    """
    if overwrite:
        return
    names = folder_entries(run_dir)
    if Path(run_dir).exists() and not Path(run_dir).is_dir():
        raise RunExistsError(f"{flag} {run_dir} is a file, not a folder; choose another {flag}")
    if not names:
        return
    if holds_run(run_dir):
        raise RunExistsError(
            f"{flag} {run_dir} already holds a run ({latest_checkpoint(run_dir)}); nothing was changed. "
            f"Pass --resume {run_dir} to continue it, --overwrite to replace it by a new run, or choose another "
            f"{flag} for a new run"
        )
    shown = ", ".join(names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")
    aside = (f" The run an --overwrite run replaced (that run was stopped before its first checkpoint) is "
             f"in {Path(run_dir) / REPLACED_FOLDER}: move its files back to resume it."
             if REPLACED_FOLDER in names else "")
    raise RunExistsError(
        f"{flag} {run_dir} is not empty ({shown}) and holds no checkpoint to resume; nothing was changed. "
        f"Choose another (or an empty) {flag}, or pass --overwrite to start a new run there (the files a "
        "run writes are replaced)." + aside
    )


def clear_run_files(run_dir: str | Path, keep: tuple[str | Path, ...] = ()) -> list[Path]:
    """Remove the files and folders a run writes (:data:`RUN_FILES`, :data:`RUN_FOLDERS`) from
    ``run_dir`` before ``--overwrite`` starts a new run there; other files, ``plan.json`` (a run
    writes its own when it uses a plan) and ``keep`` (inputs of the new run) stay. Returns what was
    removed."""
    kept = {Path(p).resolve() for p in keep}
    removed = []
    for name in (*RUN_FILES, *RUN_FOLDERS):
        path = Path(run_dir) / name
        if name == "plan.json":  # as often an input (a plan made for this run) as an output
            continue
        if path.resolve() in kept or not path.exists():
            continue
        shutil.rmtree(path) if path.is_dir() else path.unlink()
        removed.append(path)
    return removed


def run_name_spellings(model: str) -> list[str]:
    """The spellings of a model name a run folder may carry: as given, and with ``-``/``_`` swapped
    (``revformer-small`` and ``revformer_small`` name the same registered model)."""
    return list(dict.fromkeys((model, model.replace("-", "_"), model.replace("_", "-"))))


def _recorded_config(folder: Path) -> dict[str, Any] | None:
    """A run folder's ``config.json``, or None when it cannot be read."""
    try:
        config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return config if isinstance(config, dict) else None


def new_run_dir(model: str, dataset: str, root: Path = RUNS_ROOT) -> Path:
    """``<root>/<model>-<dataset>-<YYYYmmdd-HHMMSS>``, with a numeric suffix if that exists."""
    base = root / f"{model}-{dataset}-{time.strftime('%Y%m%d-%H%M%S')}"
    path, n = base, 1
    while path.exists():
        n += 1
        path = base.with_name(f"{base.name}-{n}")
    return path


def find_latest_run(model: str, dataset: str, root: Path = RUNS_ROOT,
                    accept: Callable[[dict[str, Any]], bool] | None = None) -> Path | None:
    """The run folder of ``model`` on ``dataset`` under ``root`` that was active last, or None.

    A folder counts if it holds any run file; "active last" is the newest modification time
    among its run files (a run that is resumed becomes the latest again). The latest run may
    have no checkpoint (it was killed before its first save): callers say so rather than
    silently picking an older run. ``accept`` tells whether a run's recorded options (its
    ``config.json``) are the run asked for, where folder names alone cannot tell (two factories
    of one name in two files, two data folders); a folder whose config cannot be read counts.
    """
    latest: tuple[float, Path] | None = None
    folders = {f for name in run_name_spellings(model) for f in root.glob(f"{glob.escape(name)}-{glob.escape(dataset)}-*")}
    for folder in sorted(folders):
        recorded = _recorded_config(folder) if accept is not None else None
        if recorded is not None and not accept(recorded):  # type: ignore[misc]
            continue
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
        self._found = {name for name in (*RUN_FILES, *RUN_FOLDERS) if (self.path / name).exists()}
        stale = remove_stale_temp_files(self.path, RUN_FILES)
        if stale:
            log(f"removed {len(stale)} temporary file(s) left in {self.path} by a killed save: "
                f"{', '.join(p.name for p in stale)}")
        return self

    @property
    def replaced_path(self) -> Path:
        """Where ``--overwrite`` keeps the run it replaces until the new run saves a checkpoint."""
        return self.path / REPLACED_FOLDER

    def replace_run(self, keep: tuple[str | Path, ...] = (), log: Callable[[str], None] = print, *,
                    writes_plan: bool = False) -> list[Path]:
        """Set aside the files of the run that was here (:data:`RUN_FILES`, :data:`RUN_FOLDERS`;
        not ``keep``, inputs of the new run, nor ``plan.json`` unless the new run ``writes_plan``)
        before a new run with ``--overwrite`` writes its own: they move to :attr:`replaced_path`
        and are deleted when the new run saves its first checkpoint (:meth:`release_replaced`),
        or put back if it never does (:meth:`discard`). Returns what was set aside."""
        backup, partial = self.replaced_path, self.path / f"{REPLACED_FOLDER}.partial"
        if partial.is_dir():  # a kill while setting a run aside: put back what had moved
            _move_back(partial, self.path)
        if backup.exists():
            if not holds_run(self.path):  # a run killed before its first checkpoint: the one it
                removed = clear_run_files(self.path, keep)  # replaced is still set aside
                self._found -= {p.name for p in removed}
                return removed
            shutil.rmtree(backup)  # a newer run saved a checkpoint since: the old one is replaced
        kept = {Path(p).resolve() for p in keep}
        moved = [self.path / name for name in (*RUN_FILES, *RUN_FOLDERS) if (name != "plan.json" or writes_plan)
                 and (self.path / name).exists() and (self.path / name).resolve() not in kept]
        if moved:
            partial.mkdir()
            for path in moved:
                path.rename(partial / path.name)
            partial.rename(backup)  # the whole run at once
            log(f"--overwrite: set aside {', '.join(p.name for p in moved)} of the run in {self.path} "
                f"(in {backup.name}/ until this run saves its first checkpoint)")
        self._found -= {p.name for p in moved}
        return moved

    def release_replaced(self) -> None:
        """Delete the run ``--overwrite`` set aside once the new run holds a checkpoint in this
        folder (a checkpoint saved elsewhere does not count)."""
        if self.replaced_path.exists() and holds_run(self.path):
            shutil.rmtree(self.replaced_path)

    def discard(self) -> str | None:
        """If no checkpoint was saved, remove the run files and the folders this process made,
        and put back a run that ``--overwrite`` set aside.

        Returns None when a checkpoint was saved (nothing is removed), else what happened:
        ``"restored"`` (the replaced run is back), ``"removed"`` (the folder is gone) or
        ``"cleared"`` (this run's files are gone; the folder holds other files). Files that were
        there before :meth:`open` (a plan given as input, say) stay.
        """
        if holds_run(self.path):
            return None
        for name in set(RUN_FILES) - self._found:
            with suppress(FileNotFoundError):
                (self.path / name).unlink()
        for name in set(RUN_FOLDERS) - self._found:
            shutil.rmtree(self.path / name, ignore_errors=True)
        remove_stale_temp_files(self.path, RUN_FILES)
        if self.replaced_path.is_dir():
            _move_back(self.replaced_path, self.path)
            return "restored"
        for folder in self._created:
            with suppress(OSError):  # not empty: someone else's files are there
                folder.rmdir()
        return "cleared" if self.path.exists() else "removed"


def _move_back(aside: Path, folder: Path) -> None:
    """Put the files set aside in ``aside`` back into ``folder`` (none is replaced), then remove
    ``aside`` if it is empty."""
    for path in aside.iterdir():
        if not (folder / path.name).exists():
            path.rename(folder / path.name)
    with suppress(OSError):
        aside.rmdir()
