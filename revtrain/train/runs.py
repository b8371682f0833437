"""Run folders and resuming: where a run writes, which checkpoint ``--resume`` means, and
which settings a resumed run uses.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from revtrain.train.checkpoint import CHECKPOINT_NAME, find_latest_checkpoint, load_checkpoint
from revtrain.train.config import TrainConfig

__all__ = ["RUNS_ROOT", "resolve_config", "find_resume_checkpoint", "new_run_dir"]

RUNS_ROOT = Path("runs")
"""Where default run folders go (relative to the working directory)."""


def resolve_config(options: Mapping[str, Any]) -> TrainConfig:
    """The config of ``revtrain train``: the options given, over a resumed run's saved config.

    Without ``resume`` this is ``TrainConfig(**options)``. With it, the checkpoint's config is
    the base and only the options given explicitly override it (``--epochs 20`` extends a run),
    and the run continues in the checkpoint's folder unless ``run_dir`` is given.
    """
    options = dict(options)
    if options.get("resume") is None:
        return TrainConfig(**options)
    path = find_resume_checkpoint(options["resume"], options)
    if path is None:  # "auto" with nothing to resume: the Trainer says so and starts afresh
        return TrainConfig(**options)
    merged = {**load_checkpoint(path)["config"], **options, "resume": str(path)}
    merged["run_dir"] = options.get("run_dir", str(path.parent))
    return TrainConfig.from_dict(merged)


def find_resume_checkpoint(resume: str | None, options: Mapping[str, Any]) -> Path | None:
    """The checkpoint ``resume`` points at.

    Args:
        resume: A checkpoint file, a run folder holding one, or ``"auto"``: the checkpoint of
            ``options["run_dir"]`` if given, else the newest ``runs/<model>-<dataset>-*`` one.
        options: Training options; ``run_dir``, ``model`` and ``dataset`` are read for ``"auto"``.

    Returns:
        The path (not checked to exist unless ``"auto"``), or None when ``"auto"`` finds nothing.
    """
    if resume is None:
        return None
    if resume != "auto":
        path = Path(resume)
        return path / CHECKPOINT_NAME if (path / CHECKPOINT_NAME).is_file() else path
    if options.get("run_dir"):
        candidate = Path(options["run_dir"]) / CHECKPOINT_NAME
        return candidate if candidate.is_file() else None
    defaults = TrainConfig()
    return find_latest_checkpoint(RUNS_ROOT, options.get("model", defaults.model),
                                  options.get("dataset", defaults.dataset))


def new_run_dir(config: TrainConfig) -> Path:
    """``runs/<model>-<dataset>-<YYYYmmdd-HHMMSS>``, with a numeric suffix if that exists."""
    base = RUNS_ROOT / f"{config.model}-{config.dataset}-{time.strftime('%Y%m%d-%H%M%S')}"
    path, n = base, 1
    while path.exists():
        n += 1
        path = base.with_name(f"{base.name}-{n}")
    return path
