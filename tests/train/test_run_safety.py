"""Runs you cannot lose (issue 8 §3): one test per class of fault.

Folders that hold a run, ``--resume auto``, history kept across processes, options that
contradict a checkpoint, damaged and diverged checkpoints, SIGTERM, a full disk, stale
temporary files, failed runs, file permissions.
"""

from __future__ import annotations

import errno
import io
import json
import os
import shutil
import signal
import stat
from pathlib import Path
from typing import Any

import pytest
import torch

import revtrain.train.checkpoint as checkpoint_module
from revtrain.core import get_modes, reversible_blocks
from revtrain.models import create_model
from revtrain.planner import Plan
from revtrain.train import (
    CorruptCheckpointError,
    DiskFullError,
    NonFiniteCheckpointError,
    ResumeConflictError,
    RunExistsError,
    Trainer,
    TrainingInterrupted,
    load_checkpoint,
    resolve_run,
    save_checkpoint,
)

from .conftest import TinyConfig, interrupt_at, make_tiny_config


@pytest.fixture(scope="module")
def finished(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The folder of a finished tiny run (2 epochs x 3 steps); tests copy it before writing."""
    config = make_tiny_config(tmp_path_factory.mktemp("finished") / "run")
    Trainer(config, out=io.StringIO()).fit()
    return Path(config.run_dir)


@pytest.fixture(scope="module")
def interrupted(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny run stopped after step 5: epoch 2, batch 2 of 3."""
    config = make_tiny_config(tmp_path_factory.mktemp("interrupted") / "run")
    with pytest.raises(KeyboardInterrupt):
        Trainer(config, callbacks=[interrupt_at(5)], out=io.StringIO()).fit()
    return Path(config.run_dir)


def _copy(run: Path, to: Path) -> Path:
    shutil.copytree(run, to)
    return to


def _state_of(run: Path) -> dict[str, Any]:
    return load_checkpoint(run / "checkpoint.pt")


# ----------------------------------------------------------------------------- folders holding a run


def test_new_run_into_a_folder_holding_a_run_is_refused_and_changes_nothing(
    finished: Path, tmp_path: Path
) -> None:
    run = _copy(finished, tmp_path / "run")
    before = {p.name: p.read_bytes() for p in run.iterdir()}
    with pytest.raises(RunExistsError, match=f"--run-dir {run} already holds a run.*--resume {run}"):
        Trainer(make_tiny_config(run))
    assert {p.name: p.read_bytes() for p in run.iterdir()} == before


def test_resuming_into_a_folder_holding_another_run_is_refused(finished: Path, interrupted: Path,
                                                              tmp_path: Path) -> None:
    other = _copy(finished, tmp_path / "other")
    with pytest.raises(RunExistsError, match=f"--run-dir {other} already holds another run"):
        resolve_run({"resume": str(interrupted), "run_dir": str(other)})


def test_a_folder_without_checkpoint_is_refused_unless_overwrite(tmp_path: Path) -> None:
    # Issue 24 changed this: such a folder used to be reused silently (its files replaced).
    dead = tmp_path / "dead"
    dead.mkdir()
    (dead / "config.json").write_text("{}")  # a run killed before its first save
    with pytest.raises(RunExistsError, match=f"--run-dir {dead} is not empty .config.json. and holds no checkpoint"):
        resolve_run(make_tiny_config(dead))
    run = resolve_run(make_tiny_config(dead, overwrite=True))
    assert run.state is None and any("--overwrite: starting a new run" in n for n in run.notes)


# ----------------------------------------------------------------------------- --resume auto


def _fake_run(folder: Path, *, checkpoint_of: Path | None, mtime: float) -> Path:
    if checkpoint_of is not None:
        _copy(checkpoint_of, folder)
    else:
        folder.mkdir(parents=True)
        (folder / "config.json").write_text("{}")
        (folder / "metrics.jsonl").write_text("")
    for p in folder.iterdir():
        os.utime(p, (mtime, mtime))
    return folder


def test_resume_auto_takes_the_latest_run_not_the_newest_checkpoint(
    finished: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    _fake_run(Path("runs/revnet38-digits-1"), checkpoint_of=finished, mtime=1000)
    crashed = _fake_run(Path("runs/revnet38-digits-2"), checkpoint_of=None, mtime=2000)
    run = resolve_run({"resume": "auto"})
    assert run.state is None and run.checkpoint is None  # a new run, not the finished one
    assert run.run_dir not in (Path("runs/revnet38-digits-1"), crashed)
    assert any(f"latest run of revnet38 on digits, {crashed}, stopped before its first checkpoint" in n
               for n in run.notes)


def test_resume_auto_resumes_the_run_active_last(finished: Path, interrupted: Path, tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    _fake_run(Path("runs/revnet38-digits-a"), checkpoint_of=finished, mtime=3000)
    _fake_run(Path("runs/revnet38-digits-b"), checkpoint_of=interrupted, mtime=2000)
    _fake_run(Path("runs/resnet32-digits-c"), checkpoint_of=interrupted, mtime=4000)  # another model
    run = resolve_run({"resume": "auto"})
    assert run.checkpoint == Path("runs/revnet38-digits-a/checkpoint.pt")
    assert any("resuming runs/revnet38-digits-a, the latest run" in n for n in run.notes)


def test_resume_auto_with_nothing_to_resume_starts_a_new_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    run = resolve_run({"resume": "auto"})
    assert run.state is None and run.config.resume is None
    assert any("no run of revnet38 on digits" in n for n in run.notes)


def test_resume_of_a_folder_without_checkpoint_says_so(tmp_path: Path) -> None:
    dead = tmp_path / "dead"
    dead.mkdir()
    with pytest.raises(CorruptCheckpointError, match=f"--resume {dead}: the folder holds no checkpoint.pt"):
        resolve_run({"resume": str(dead)})


# ----------------------------------------------------------------------------- history across processes


def test_resuming_a_finished_run_keeps_its_measured_history(finished: Path, tmp_path: Path) -> None:
    run = _copy(finished, tmp_path / "run")
    first = json.loads((run / "summary.json").read_text())
    again = Trainer(make_tiny_config(run, resume=str(run)), out=io.StringIO()).fit()
    assert again["steps"] == first["steps"] == 6 and again["processes"] == 2
    assert again["wall_time_s"] >= first["wall_time_s"] > 0.01
    assert again["train_time_s"] == first["train_time_s"] > 0
    assert again["train_peak_memory_bytes"] == first["train_peak_memory_bytes"] > 0
    assert again["samples_per_s"] == first["samples_per_s"]
    assert again["test_acc"] == first["test_acc"]
    this = again["this_process"]
    assert this["steps"] == 0 and this["samples_per_s"] is None and this["train_peak_memory_bytes"] is None


def test_a_run_resumed_into_another_folder_carries_its_history(finished: Path, tmp_path: Path) -> None:
    """A branch (--resume A --run-dir B) starts with A's records: B's epochs.csv covers the whole
    run, and A is left as it was."""
    import csv

    run = _copy(finished, tmp_path / "a")
    before = (run / "metrics.jsonl").read_bytes()
    Trainer(make_tiny_config(tmp_path / "b", epochs=3, resume=str(run)), out=io.StringIO()).fit()
    with (tmp_path / "b" / "epochs.csv").open() as f:
        assert [int(r["epoch"]) for r in csv.DictReader(f)] == [0, 1, 2]
    assert (run / "metrics.jsonl").read_bytes() == before


def test_resumed_run_totals_add_up_over_processes(interrupted: Path, tmp_path: Path) -> None:
    run = _copy(interrupted, tmp_path / "run")
    before = _state_of(run)["progress"]
    summary = Trainer(make_tiny_config(run, resume=str(run)), out=io.StringIO()).fit()
    this = summary["this_process"]
    assert (summary["steps"], this["steps"]) == (6, 1)
    assert summary["train_time_s"] == pytest.approx(before["train_time_s"] + this["train_time_s"], abs=2e-3)
    assert summary["wall_time_s"] >= before["wall_time_s"] + this["train_time_s"] - 2e-3
    assert summary["train_peak_memory_bytes"] >= before["peak_memory_bytes"] > 0
    after = _state_of(run)["progress"]  # the divergence bound stays the run's first loss
    assert after["reference_loss"] == before["reference_loss"] > 0 and after["processes"] == 2


# ----------------------------------------------------------------------------- options against the checkpoint


@pytest.mark.parametrize(
    ("option", "value", "flag"),
    [("model", "resnet32", "--model"), ("dataset", "synthetic", "--dataset"), ("batch_size", 8, "--batch-size"),
     ("seed", 1, "--seed"), ("image_size", 16, "--image-size"), ("augment", True, "--augment")],
)
def test_options_that_change_the_data_or_model_are_refused_on_resume(
    finished: Path, tmp_path: Path, option: str, value: Any, flag: str
) -> None:
    run = _copy(finished, tmp_path / "run")
    config_before = (run / "config.json").read_bytes()
    with pytest.raises(ResumeConflictError, match=f"cannot resume {run}/checkpoint.pt with {flag} {value} "
                                                   f"\\(the run used .*Drop {flag} to continue"):
        resolve_run({"resume": str(run), option: value, "epochs": 3})
    assert (run / "config.json").read_bytes() == config_before


def test_epochs_below_those_started_are_refused(interrupted: Path, finished: Path) -> None:
    # Mid-epoch 2, --epochs 2 finishes it; after epoch 2, only --epochs 3 trains on.
    for run, fix in ((interrupted, 2), (finished, 3)):
        with pytest.raises(ResumeConflictError, match=f"--epochs 1 is below the 2 epoch\\(s\\) that .* has already "
                                                      f"started; pass --epochs {fix} or more to train on"):
            resolve_run({"resume": str(run), "epochs": 1})


def test_max_steps_per_epoch_below_the_steps_taken_is_refused(interrupted: Path, tmp_path: Path) -> None:
    with pytest.raises(ResumeConflictError, match="--max-steps-per-epoch 1 is below the 2 steps .* in epoch 2"):
        resolve_run({"resume": str(interrupted), "max_steps_per_epoch": 1})
    run = _copy(interrupted, tmp_path / "run")  # equal to the steps taken: the epoch ends there
    trainer = Trainer(resolve_run({"resume": str(run), "max_steps_per_epoch": 2}), out=io.StringIO())
    trainer.fit()
    assert trainer.step == 5 and [h["epoch"] for h in trainer.history] == [0, 1]


def test_options_given_on_resume_are_applied_and_recorded(interrupted: Path, tmp_path: Path) -> None:
    run = _copy(interrupted, tmp_path / "run")
    resolved = resolve_run({"resume": str(run), "mode": "C", "lr": 0.05, "epochs": 3})
    assert any("epochs 2 -> 3, lr 0.1 -> 0.05, mode M -> C" in n for n in resolved.notes)
    trainer = Trainer(resolved, out=io.StringIO())
    assert set(get_modes(trainer.model).values()) == {"C"}  # not the checkpoint's M
    assert trainer.optimizer.param_groups[0]["initial_lr"] == 0.05
    recorded = json.loads((run / "config.json").read_text())
    assert (recorded["mode"], recorded["lr"], recorded["epochs"]) == ("C", 0.05, 3)
    assert recorded["resume"] == str(run / "checkpoint.pt")


def test_a_plan_given_on_resume_replaces_the_saved_modes(interrupted: Path, tmp_path: Path) -> None:
    names = [name for name, _ in reversible_blocks(create_model("revnet38"))]
    plan_path = tmp_path / "my_plan.json"
    Plan(modes={n: "C" if i < 2 else "M" for i, n in enumerate(names)}, budget_bytes=10**9, granularity=1,
         predicted_step_time_s=0.1, predicted_peak_bytes=10**6, model="revnet38").to_json(plan_path)
    run = _copy(interrupted, tmp_path / "run")
    trainer = Trainer(resolve_run({"resume": str(run), "plan": str(plan_path)}), out=io.StringIO())
    assert list(get_modes(trainer.model).values()) == ["C"] * 2 + ["M"] * 5
    recorded = json.loads((run / "config.json").read_text())
    assert (recorded["plan"], recorded["budget"]) == (str(plan_path), None)
    assert Plan.from_json(run / "plan.json").modes == get_modes(trainer.model)


def test_resuming_a_finished_run_says_there_is_nothing_to_train(finished: Path) -> None:
    notes = resolve_run({"resume": str(finished)}).notes
    assert any("has already trained its 2 epoch(s); nothing to train (pass --epochs 3" in n for n in notes)


def test_resume_without_options_restores_the_saved_modes(interrupted: Path, tmp_path: Path) -> None:
    run = _copy(interrupted, tmp_path / "run")
    state = torch.load(run / "checkpoint.pt", weights_only=True)
    state["modes"] = {name: "C" for name in state["modes"]}  # as if a plan had chosen C everywhere
    save_checkpoint({k: v for k, v in state.items() if k not in ("format", "version", "revtrain_version")},
                    run / "checkpoint.pt")
    trainer = Trainer(resolve_run({"resume": str(run)}), out=io.StringIO())
    assert set(get_modes(trainer.model).values()) == {"C"}


# ----------------------------------------------------------------------------- damaged checkpoints


def test_flipped_bytes_inside_a_tensor_are_refused(finished: Path, tmp_path: Path) -> None:
    path = tmp_path / "checkpoint.pt"
    data = bytearray((finished / "checkpoint.pt").read_bytes())
    weight = load_checkpoint(finished / "checkpoint.pt")["model"]["head.fc.weight"]
    at = bytes(data).find(weight.numpy().tobytes())
    assert at > 0
    data[at + 100 : at + 164] = bytes(b ^ 0xFF for b in data[at + 100 : at + 164])  # 64 flipped bytes
    path.write_bytes(bytes(data))
    with pytest.raises(CorruptCheckpointError, match=f"checkpoint {path} fails its checksum"):
        load_checkpoint(path)


def test_a_changed_value_is_refused(finished: Path, tmp_path: Path) -> None:
    state = torch.load(finished / "checkpoint.pt", weights_only=True)
    state["progress"]["step"] = 1000  # rewritten by hand, checksum not updated
    path = tmp_path / "edited.pt"
    torch.save(state, path)
    with pytest.raises(CorruptCheckpointError, match=f"checkpoint {path} fails its checksum"):
        load_checkpoint(path)


@pytest.mark.parametrize("where", ["model", "optimizer"])
def test_a_checkpoint_with_non_finite_state_is_refused(finished: Path, tmp_path: Path, where: str) -> None:
    state = load_checkpoint(finished / "checkpoint.pt")
    if where == "model":
        state["model"]["head.fc.weight"][0, 0] = float("nan")
        named = "model.head.fc.weight"
    else:
        state["optimizer"]["state"][0]["momentum_buffer"].view(-1)[0] = float("inf")
        named = "optimizer.state.0.momentum_buffer"
    path = save_checkpoint({k: v for k, v in state.items() if k not in ("format", "version", "revtrain_version")},
                           tmp_path / "checkpoint.pt")  # a valid checksum over the diverged values
    with pytest.raises(NonFiniteCheckpointError, match=f"checkpoint {path} holds NaN or infinite values \\({named}"):
        load_checkpoint(path)


# ----------------------------------------------------------------------------- signals, disks, leftovers


def test_sigterm_saves_a_checkpoint_and_stops_like_ctrl_c(tiny_config: TinyConfig,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    config = tiny_config("term")

    def scheduler_sends_sigterm(trainer: Trainer) -> None:
        if trainer.step == 2:
            os.kill(os.getpid(), signal.SIGTERM)

    handlers = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)
    with pytest.raises(TrainingInterrupted) as stop:
        Trainer(config, callbacks=[scheduler_sends_sigterm]).fit()
    assert stop.value.signum == signal.SIGTERM
    ckpt = Path(config.run_dir) / "checkpoint.pt"
    assert load_checkpoint(ckpt)["progress"]["step"] == 2
    err = capsys.readouterr().err
    assert "SIGTERM: stopping after this step" in err and f"terminated (SIGTERM) at step 2" in err
    assert f"revtrain train --resume {ckpt}" in err
    assert (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)) == handlers


def _fail_with_enospc_after(saves: int, monkeypatch: pytest.MonkeyPatch) -> None:
    real_save, calls = torch.save, []

    def save(obj: Any, f: Any, *args: Any, **kwargs: Any) -> None:
        calls.append(1)
        if len(calls) > saves:
            f.write(b"PK partial")
            raise OSError(errno.ENOSPC, "No space left on device")
        real_save(obj, f, *args, **kwargs)

    monkeypatch.setattr(checkpoint_module.torch, "save", save)


def test_full_disk_during_a_save_keeps_the_previous_checkpoint(tiny_config: TinyConfig,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    config = tiny_config("full", checkpoint_every=1)
    _fail_with_enospc_after(2, monkeypatch)
    ckpt = Path(config.run_dir) / "checkpoint.pt"
    with pytest.raises(DiskFullError) as info:
        Trainer(config, out=io.StringIO()).fit()
    message = str(info.value)
    assert "\n" not in message and message.startswith(f"no space left on device while writing checkpoint {ckpt}")
    assert f"the previous checkpoint {ckpt} is kept unchanged" in message
    monkeypatch.undo()
    assert load_checkpoint(ckpt)["progress"]["step"] == 2
    assert sorted(p.name for p in ckpt.parent.iterdir()) == ["checkpoint.pt", "config.json", "metrics.jsonl",
                                                              "steps.csv"]


def test_full_disk_while_logging_names_the_metrics_file(tiny_config: TinyConfig,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    config = tiny_config("full_log")
    trainer = Trainer(config, out=io.StringIO())
    assert trainer.metrics is not None
    real_write = trainer.metrics._file.write

    def write(text: str) -> int:
        if '"event": "step", "time": ' in text and '"step": 2,' in text:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_write(text)

    monkeypatch.setattr(trainer.metrics._file, "write", write)
    with pytest.raises(DiskFullError, match=f"no space left on device while appending to {config.run_dir}/metrics"):
        trainer.fit()


def test_temp_files_of_killed_saves_are_removed_and_live_ones_kept(finished: Path, tmp_path: Path) -> None:
    run = _copy(finished, tmp_path / "run")
    dead = run / ".checkpoint.pt.999999999.0badc0de.tmp"  # no such pid: its writer was killed
    live = run / f".checkpoint.pt.{os.getppid()}.5ca1ab1e.tmp"  # a writer that still runs
    legacy = run / ".checkpoint.pt.k2j3h4g5.tmp"  # mkstemp's name, from an older revtrain
    legacy_metrics = run / "metrics.jsonl.tmp"
    yours = run / ".notes.tmp"  # not a file revtrain writes
    for p in (dead, live, legacy, legacy_metrics, yours):
        p.write_bytes(b"partial")
    out = io.StringIO()
    Trainer(make_tiny_config(run, resume=str(run)), out=out)
    assert not dead.exists() and not legacy.exists() and not legacy_metrics.exists()
    assert live.exists() and yours.exists()
    assert "removed 3 temporary file(s)" in out.getvalue()


@pytest.mark.parametrize("when", ["building", "training"])
def test_a_run_that_fails_before_its_first_checkpoint_leaves_no_folder(tiny_config: TinyConfig, tmp_path: Path,
                                                                        when: str) -> None:
    config = tiny_config("sub/failed", plan=str(tmp_path / "missing.json") if when == "building" else None)
    with pytest.raises((RuntimeError, ValueError)):
        Trainer(config, callbacks=[interrupt_at(2, RuntimeError)], out=io.StringIO()).fit()
    assert not (tmp_path / "sub").exists()  # the folder and the parent it made are gone


def test_a_failed_run_keeps_files_that_were_there_before(tiny_config: TinyConfig, tmp_path: Path) -> None:
    folder = tmp_path / "mine"
    folder.mkdir()
    (folder / "notes.txt").write_text("keep me")
    (folder / "plan.json").write_text("{}")  # given as the input of another tool, say
    # Issue 24: a folder that is not empty needs --overwrite; a failed run still keeps what was there.
    with pytest.raises(RunExistsError, match="is not empty"):
        Trainer(tiny_config("mine"), out=io.StringIO())
    with pytest.raises(RuntimeError):
        Trainer(tiny_config("mine", overwrite=True), callbacks=[interrupt_at(1, RuntimeError)],
                out=io.StringIO()).fit()
    assert sorted(p.name for p in folder.iterdir()) == ["notes.txt", "plan.json"]


@pytest.mark.parametrize("umask", [0o022, 0o077])
def test_run_files_get_the_same_permissions(tiny_config: TinyConfig, umask: int) -> None:
    previous = os.umask(umask)
    try:
        config = tiny_config(f"perm{umask:o}", epochs=1)
        Trainer(config, out=io.StringIO()).fit()
    finally:
        os.umask(previous)
    run = Path(config.run_dir)
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in run.iterdir()}
    assert set(modes) == {"checkpoint.pt", "config.json", "metrics.jsonl", "summary.json", "steps.csv", "epochs.csv",
                          "curves.png"}
    assert set(modes.values()) == {0o666 & ~umask}, modes
    assert stat.S_IMODE(run.stat().st_mode) == 0o777 & ~umask


def test_a_signal_that_lands_while_the_processes_agree_is_kept_for_the_next_agreement() -> None:
    """The processes agree on a stop between steps (an all-reduce); a SIGTERM delivered during
    that collective, after this process handed in "no request", must not be overwritten by the
    run's answer "no stop": the request stands and the next agreement stops every process."""
    from revtrain.train.interrupts import StopSignals

    stop = StopSignals(log=lambda line: None)
    handed_in: list[int | None] = []

    def agree_while_the_signal_lands(signum: int | None) -> int | None:
        handed_in.append(signum)
        stop._request(signal.SIGTERM, None)  # the handler runs while the collective is under way
        return None  # no process had asked when they agreed

    stop.check_agreed(agree_while_the_signal_lands)  # no stop at this point, on any process
    assert handed_in == [None] and stop.signum == signal.SIGTERM

    def agree(signum: int | None) -> int | None:
        handed_in.append(signum)
        return signum

    with pytest.raises(TrainingInterrupted) as stopped:
        stop.check_agreed(agree)
    assert stopped.value.signum == signal.SIGTERM and handed_in == [None, signal.SIGTERM]


def test_a_strategy_given_on_resume_replaces_the_saved_mode_and_plans_saved_beside_a_mode_resume(
    finished: Path, tmp_path: Path
) -> None:
    """--budget on a C-mode run does not count the saved --mode C against it; a checkpoint that
    recorded --mode C beside a budget (which set every block's mode) still resumes."""
    c_run = tmp_path / "c"
    Trainer(make_tiny_config(c_run, epochs=1, mode="C"), out=io.StringIO()).fit()
    resolved = resolve_run({"resume": str(c_run), "budget": "1GiB", "epochs": 2})
    assert (resolved.config.mode, resolved.config.budget) == ("M", "1GiB")
    state = torch.load(_copy(finished, tmp_path / "old") / "checkpoint.pt", weights_only=True)
    state["config"] = {**state["config"], "mode": "C", "budget": "1GiB"}
    save_checkpoint({k: v for k, v in state.items() if k not in ("format", "version", "revtrain_version")},
                    tmp_path / "old" / "checkpoint.pt")
    resolved = resolve_run({"resume": str(tmp_path / "old"), "epochs": 3})
    assert (resolved.config.mode, resolved.config.budget) == ("M", "1GiB")
