"""Resolve a run once, at the door: which folder, which checkpoint, which settings.

:func:`resolve_run` turns the options of ``revtrain train`` (or a complete
:class:`TrainConfig`) into a :class:`ResolvedRun`: the config the run really uses, its folder,
and, when resuming, the checkpoint path and its content, read once. The :class:`Trainer`
takes it from there and reads nothing again.

Rules, so that no run is lost or silently changed:

- Without ``--resume``, a folder that already holds a run (a checkpoint) is refused.
- ``--resume auto`` resumes the latest *run* of the model and dataset (or the one in
  ``--run-dir``); when that run has no checkpoint, it says so and starts a new run.
- Options given with ``--resume`` that would change what the run trains on (model, task,
  dataset, image size, augmentation, batch size, seed) are refused, and so are ``--epochs``
  below the epochs already started and ``--max-steps-per-epoch`` below the steps already taken
  in the current epoch. Every other option given is applied deliberately and said so (a new
  learning rate, more epochs, another memory strategy, another device), and ``config.json``
  records what the run uses from then on.
- How the run is spread over processes (``--engine``, ``--data-parallel``, ``--shard``,
  ``--backend``, ``--port``, ``--timeout``) is not taken from the resumed run: each command says it. A
  data-parallel run resumes with another number of processes, sharded or not, or in one
  process. A PETRA run resumes with its stages, split and replicas only (``--stages`` is taken
  from the run; another stage count, or another ``--data-parallel``, is refused).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from revtrain.train.checkpoint import (
    CHECKPOINT_NAME,
    CorruptCheckpointError,
    IncompatibleCheckpointError,
)
from revtrain.train.checkpoint_folder import (
    CHECKPOINTS_FOLDER,
    is_checkpoint_folder,
    latest_checkpoint,
    read_checkpoint,
    run_dir_of,
)
from revtrain.train.config import DATA_PARALLEL_REFUSES, PROCESS_LAYOUT, ConfigError, TrainConfig
from revtrain.train.state import REQUIRED_PARTS
from revtrain.train.user_model import is_import_path, with_absolute_file
from revtrain.train.runs import (
    REPLACED_FOLDER,
    RUNS_ROOT,
    RunExistsError,
    find_latest_run,
    folder_entries,
    holds_run,
    new_run_dir,
    refuse_occupied,
)

__all__ = ["ResolvedRun", "ResumeConflictError", "resolve_run"]


class ResumeConflictError(IncompatibleCheckpointError):
    """An option given with ``--resume`` contradicts the run being resumed."""


_FIXED_REASONS = {
    "model": "the checkpoint's weights belong to that model",
    "task": "the run's loss and metrics are that task's",
    "dataset": "changing it mid-run would change the data the run trains on",
    "image_size": "changing it mid-run would change the data the run trains on",
    "augment": "changing it mid-run would change the data the run trains on",
    "batch_size": "the data order and the schedule's position are counted in batches of that size",
    "accumulation": "the schedule's position and the loader's are counted in steps of that many batches",
    "seed": "the data order and augmentation of the rest of the run come from that seed",
    "optimizer": "the checkpoint holds that optimizer's state",
    "context": "changing it mid-run would change the data the run trains on",
}
"""Options a resumed run cannot change, and why."""

_NONE_MEANS_DEFAULT = ("task", "image_size", "augment", "eval_batch_size", "data_dir", "run_dir", "context")
"""Options whose None means "the default": None given with a complete config is not a change."""

_STRATEGY = ("mode", "budget", "plan")

_ANNOUNCED = ("epochs", "max_steps_per_epoch", "lr", "momentum", "nesterov", "weight_decay", "warmup_epochs",
              "schedule", "milestones", "gamma", "divergence_factor", "mode", "budget", "plan", "device",
              "amp", "eval_batch_size", "grad_clip", "check_every", "engine", "data_parallel", "shard", "data_dir")
"""Options whose change on resume is said out loud (the others only change outputs)."""


@dataclass(frozen=True, kw_only=True)
class ResolvedRun:
    """A run ready to be built: what :class:`~revtrain.train.Trainer` takes."""

    config: TrainConfig
    """The settings the run uses (``run_dir`` set; ``resume`` the checkpoint path, or None)."""
    run_dir: Path
    """The folder the run writes to."""
    checkpoint: Path | None = None
    """The checkpoint resumed from, or None for a new run."""
    state: dict[str, Any] | None = None
    """The checkpoint's content (read once, checked), or None for a new run."""
    strategy_changed: bool = False
    """Resuming with another memory strategy (``--mode``/``--budget``/``--plan``): apply it
    instead of restoring the checkpoint's block modes."""
    notes: tuple[str, ...] = ()
    """What the user should be told (which run ``auto`` picked, which options were applied)."""


def resolve_run(options: Mapping[str, Any] | TrainConfig) -> ResolvedRun:
    """Resolve the run that ``options`` ask for.

    Args:
        options: The options given on the command line (absent ones take the defaults, or the
            resumed run's settings), or a complete :class:`TrainConfig` (every field counts as
            given, except a None that means "default").

    Raises:
        ConfigError: an option is invalid.
        RunExistsError: the folder holds another run and ``resume`` does not point at it.
        ResumeConflictError: an option contradicts the run being resumed.
        CheckpointError: the checkpoint cannot be read (missing, corrupt, non-finite).
    """
    if isinstance(options, TrainConfig):
        given = {k: v for k, v in options.to_dict().items() if v is not None or k not in _NONE_MEANS_DEFAULT}
        complete = True
    else:
        given, complete = dict(options), False
    if isinstance(given.get("model"), str):  # a file.py:factory is recorded by its absolute path
        given["model"] = with_absolute_file(given["model"])
    resume = given.get("resume")
    notes: list[str] = []
    if resume == "auto":
        resume = _auto_checkpoint(given, notes)
    if resume is None:
        return _new_run({**given, "resume": None}, notes)
    path = Path(resume)
    if path.is_dir() and not is_checkpoint_folder(path):
        latest = latest_checkpoint(path)
        if latest is None:
            aside = (f". The run an --overwrite run replaced is set aside in {path / REPLACED_FOLDER}: move its "
                     "files back to resume it" if (path / REPLACED_FOLDER).is_dir() else "")
            raise CorruptCheckpointError(
                f"--resume {path}: the folder holds no {CHECKPOINT_NAME} and no complete checkpoint folder in "
                f"{CHECKPOINTS_FOLDER}/ (its run stopped before its first checkpoint, or it is not a run folder); "
                f"start a new run without --resume{aside}"
            )
        path = latest
    return _resumed_run(given, path, complete, notes)


def _new_run(given: dict[str, Any], notes: list[str]) -> ResolvedRun:
    config = TrainConfig.from_dict(given)
    run_dir = Path(config.run_dir) if config.run_dir else new_run_dir(run_folder_name(config.model), config.dataset)
    refuse_occupied(run_dir, overwrite=config.overwrite)  # nothing a user made is replaced unasked
    if config.overwrite and folder_entries(run_dir):
        notes.append(f"--overwrite: starting a new run in {run_dir}; the run there is set aside until this one "
                     "saves its first checkpoint, and put back if it never does")
    return ResolvedRun(config=config.replace(run_dir=str(run_dir)), run_dir=run_dir, notes=tuple(notes))


def run_folder_name(model: str) -> str:
    """How a model is spelled in a default run folder's name: its registry name
    (``revformer-small`` -> ``revformer_small``), so ``--resume auto`` finds it under any spelling;
    a ``module:factory`` path gives its factory's name."""
    from revtrain.models.registry import model_info

    if ":" in model:
        return model.rsplit(":", 1)[1].rsplit(".", 1)[-1]
    try:
        return model_info(model).name
    except (KeyError, ValueError):
        return model


def _same_model(recorded: str, given: str) -> bool:
    """Whether a run that recorded ``recorded`` trained the model ``given`` names (a registered
    name in any spelling; a factory by its module or file, wherever the file was given from)."""
    if is_import_path(recorded) or is_import_path(given):
        return with_absolute_file(recorded) == with_absolute_file(given)
    return run_folder_name(recorded) == run_folder_name(given)


def _same_path(a: str, b: str) -> bool:
    return Path(a).expanduser().resolve() == Path(b).expanduser().resolve()


def _auto_checkpoint(given: Mapping[str, Any], notes: list[str]) -> str | None:
    """The checkpoint ``--resume auto`` means, or None (with a note saying why) for a new run."""
    defaults = TrainConfig()
    model, dataset = given.get("model", defaults.model), given.get("dataset", defaults.dataset)
    if given.get("run_dir"):
        folder = Path(given["run_dir"])
        latest = latest_checkpoint(folder)
        if latest is not None:
            notes.append(f"--resume auto: resuming the run in {folder}")
            return str(latest)
        notes.append(f"--resume auto: {folder} holds no checkpoint; starting a new run there")  # if empty
        return None
    data_dir = given.get("data_dir")

    def same_run(recorded: dict[str, Any]) -> bool:  # what a config cannot tell counts as the same
        if recorded.get("model") is not None and not _same_model(str(recorded["model"]), model):
            return False
        return data_dir is None or recorded.get("data_dir") is None or _same_path(recorded["data_dir"], data_dir)

    latest = find_latest_run(run_folder_name(model), dataset, accept=same_run)
    source = f" from {data_dir}" if data_dir is not None else ""
    if latest is None:
        notes.append(f"--resume auto: no run of {model} on {dataset}{source} under {RUNS_ROOT}/; starting a new run")
        return None
    if not holds_run(latest):
        notes.append(f"--resume auto: the latest run of {model} on {dataset}, {latest}, stopped before its "
                     "first checkpoint, so there is nothing to resume; starting a new run (pass --resume "
                     "<folder> to continue an older run)")
        return None
    notes.append(f"--resume auto: resuming {latest}, the latest run of {model} on {dataset}{source}")
    return str(latest_checkpoint(latest))


def _resumed_run(given: dict[str, Any], path: Path, complete: bool, notes: list[str]) -> ResolvedRun:
    state = read_checkpoint(path, weights=False)  # a folder's model and optimizer load once the model is built
    in_folder = set(state.get("folder_parts", ()))
    missing = [name for name in ("config", *REQUIRED_PARTS) if state.get(name) is None and name not in in_folder]
    if missing:
        raise IncompatibleCheckpointError(
            f"checkpoint {path} holds no {' or '.join(missing)} state, so it cannot continue the run exactly; "
            "resume from a checkpoint.pt written by `revtrain train`, or start a new run without --resume "
            "(revtrain.load reads the weights of a run folder)"
        )
    try:
        recorded = dict(state["config"])
        if recorded.get("budget") is not None or recorded.get("plan") is not None:
            recorded["mode"] = "M"  # a plan set every block's mode; a --mode saved beside it was not used
        saved = TrainConfig.from_dict(recorded).to_dict()
    except (ConfigError, KeyError, TypeError) as err:
        raise IncompatibleCheckpointError(f"checkpoint {path} holds a config this revtrain cannot use: {err}") from None
    if given.get("model") is not None and given["model"] == with_absolute_file(str(saved["model"])):
        given["model"] = saved["model"]  # the run's own spelling (a file.py:factory recorded relative to its folder)
    _refuse_fixed_changes(given, saved, state, path)
    merged = {**{k: v for k, v in saved.items() if k not in PROCESS_LAYOUT},  # each command says how it runs
              **{k: v for k, v in given.items() if k not in ("resume", "run_dir")}}
    if not complete and any(name in given for name in _STRATEGY):  # a strategy given replaces the saved one
        merged.update(mode=given.get("mode", "M"), budget=given.get("budget"), plan=given.get("plan"))
    home = run_dir_of(path)
    run_dir = Path(given["run_dir"]) if given.get("run_dir") else home
    merged.update(run_dir=str(run_dir), resume=str(path), overwrite=False)
    _refuse_inherited(given, merged, path)
    config = TrainConfig.from_dict(merged)
    if run_dir.resolve() != home.resolve() and holds_run(run_dir):
        raise RunExistsError(
            f"--run-dir {run_dir} already holds another run; resuming {path} there would overwrite it. "
            f"Choose an empty --run-dir, or drop --run-dir to continue in {home}"
        )
    if run_dir.resolve() != home.resolve() and folder_entries(run_dir):
        raise RunExistsError(
            f"--run-dir {run_dir} is not empty; resuming {path} there would replace its files. Choose an empty "
            f"--run-dir, or drop --run-dir to continue in {home}"
        )
    _refuse_shrinking(config, state, path)
    _refuse_other_stages(config, saved, path, replicas_known="data_parallel" in state["config"])
    notes += _announce_changes(saved, config.to_dict(), state)
    progress, loader = state.get("progress", {}), state["train_loader"]
    if loader["epoch"] >= config.epochs and progress.get("pending_eval") is None:
        notes.append(f"resume: {path} has already trained its {config.epochs} epoch(s); nothing to train "
                     f"(pass --epochs {config.epochs + 1} or more to continue it)")
    strategy_changed = any(saved[k] != getattr(config, k) for k in _STRATEGY)
    return ResolvedRun(config=config, run_dir=run_dir, checkpoint=path, state=state,
                       strategy_changed=strategy_changed, notes=tuple(notes))


def _refuse_fixed_changes(given: Mapping[str, Any], saved: Mapping[str, Any], state: Mapping[str, Any],
                          path: Path) -> None:
    was = {**saved, "task": state.get("task", saved.get("task"))}
    conflicts = [
        (name, given[name]) for name in _FIXED_REASONS
        if given.get(name) is not None and given[name] != was.get(name)
        and not (name == "task" and was.get(name) is None)
    ]
    if conflicts:
        lines = "; ".join(f"--{_flag(name)} {value} (the run used {was.get(name)!r}: {_FIXED_REASONS[name]})"
                          for name, value in conflicts)
        drop = " ".join(f"--{_flag(name)}" for name, _ in conflicts)
        raise ResumeConflictError(
            f"cannot resume {path} with {lines}. Drop {drop} to continue that run, or start a new run "
            "without --resume"
        )


_INHERITED_FIX = {"grad_angle_every": "--grad-angle-every 0", "budget": "--mode M (or --mode C)",
                  "plan": "--mode M (or --mode C)"}
"""How to drop a resumed run's option that the processes of this command cannot honour."""


def _refuse_inherited(given: Mapping[str, Any], merged: Mapping[str, Any], path: Path) -> None:
    """An option the run was saved with (not given now) that ``--data-parallel`` cannot honour:
    say where it came from and how to drop it (:class:`TrainConfig` would blame the command)."""
    if merged.get("data_parallel") is None:
        return
    for name, (ok, why) in DATA_PARALLEL_REFUSES.items():
        if name not in given and merged.get(name) not in ok:
            raise ResumeConflictError(
                f"cannot resume {path} with --data-parallel {merged['data_parallel']}: the run was trained with "
                f"--{_flag(name)} {_show(merged[name])}, which is not available with --data-parallel ({why}); "
                f"pass {_INHERITED_FIX[name]} to continue it without, or resume it without --data-parallel"
            )


def _refuse_shrinking(config: TrainConfig, state: Mapping[str, Any], path: Path) -> None:
    loader = state["train_loader"]
    epoch, next_batch = int(loader["epoch"]), int(loader["next_batch"])
    started = epoch + (1 if next_batch > 0 else 0)
    if config.epochs < started:
        raise ResumeConflictError(
            f"--epochs {config.epochs} is below the {started} epoch(s) that {path} has already started; "
            f"pass --epochs {started if next_batch > 0 else started + 1} or more to train on (or drop --epochs)"
        )
    taken = -(-next_batch // config.accumulation)  # optimizer steps of this epoch
    if config.max_steps_per_epoch is not None and taken > config.max_steps_per_epoch:
        raise ResumeConflictError(
            f"--max-steps-per-epoch {config.max_steps_per_epoch} is below the {taken} steps that {path} "
            f"has already taken in epoch {epoch + 1}; pass --max-steps-per-epoch {taken} or more "
            "(or drop it)"
        )


def _refuse_other_stages(config: TrainConfig, saved: Mapping[str, Any], path: Path, *,
                         replicas_known: bool = True) -> None:
    """A PETRA run's checkpoint holds one state per stage, each of its replicas' (a data-parallel
    run may continue as a PETRA run: its checkpoint holds the whole model). A run saved before
    its config recorded ``data_parallel`` (``replicas_known`` False) is checked by its stages only."""
    if saved.get("stages") is None:
        return
    was = (saved["stages"], saved.get("data_parallel") or 1)
    now = (config.stages, config.data_parallel or 1)
    if not replicas_known:
        if now[0] != was[0]:
            raise ResumeConflictError(
                f"cannot resume {path} as {now[0]} PETRA stage(s): the run trained {was[0]} stages, and its "
                f"checkpoint holds one state per stage; pass --stages {was[0]} (with the run's --data-parallel), "
                "or start a new run without --resume"
            )
        return
    if now != was:
        raise ResumeConflictError(
            f"cannot resume {path} as {now[0]} PETRA stage(s) x {now[1]} replica(s): the run trained {was[0]} "
            f"stages x {was[1]} replica(s), and its checkpoint holds one state per stage; pass --stages {was[0]}"
            + (f" --data-parallel {was[1]}" if was[1] > 1 else " without --data-parallel")
            + ", or start a new run without --resume"
        )


def _announce_changes(saved: Mapping[str, Any], new: Mapping[str, Any], state: Mapping[str, Any]) -> list[str]:
    changed = [name for name in _ANNOUNCED if saved.get(name) != new.get(name)]
    if not changed:
        return []
    what = ", ".join(f"{name} {_show(saved.get(name))} -> {_show(new.get(name))}" for name in changed)
    notes = [f"resume: applying the options given: {what}"]
    schedule = {"epochs", "max_steps_per_epoch", "lr", "warmup_epochs", "schedule", "milestones", "gamma"}
    if schedule & set(changed):
        step = state.get("progress", {}).get("step", "?")
        notes.append(f"resume: the learning-rate schedule is recomputed for these settings and continues from step {step}")
    return notes


def _flag(name: str) -> str:
    return name.replace("_", "-")


def _show(value: Any) -> str:
    if isinstance(value, (list, tuple)):
        return " ".join(map(str, value))
    return str(value)

