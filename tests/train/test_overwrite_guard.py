"""Nothing a user made is overwritten (issue 24 §5) and errors on the user's files name the file
and the fix (§6): folders that are not empty, plan files, model spellings for ``--resume auto``,
checkpoints missing a part, a damaged enwik8, a full disk inside ``torch.save``, bad plan files."""

from __future__ import annotations

import errno
import gzip
import io
import os
from pathlib import Path
from typing import Any

import pytest
import torch

import revtrain.train.files as files_module
from revtrain.cli import main
from revtrain.data import DatasetError
from revtrain.data.text import load_corpus
from revtrain.train import (
    CheckpointError,
    DiskFullError,
    IncompatibleCheckpointError,
    RunExistsError,
    Trainer,
    load_checkpoint,
    resolve_run,
    save_checkpoint,
)
from revtrain.train.config import ConfigError
from revtrain.train.runs import REPLACED_FOLDER, RunFolder, find_latest_run

from .conftest import interrupt_at, make_tiny_config


def _contents(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def finished(tmp_path_factory: pytest.TempPathFactory) -> Path:
    config = make_tiny_config(tmp_path_factory.mktemp("finished") / "run", epochs=1)
    Trainer(config, out=io.StringIO()).fit()
    return Path(config.run_dir)


def test_a_folder_with_only_metrics_is_refused_and_loses_nothing(tmp_path: Path,
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text('{"event": "step", "step": 1, "loss": 2.0}\n')
    before = _contents(run)
    with pytest.raises(RunExistsError, match="is not empty .metrics.jsonl. and holds no checkpoint.*--overwrite"):
        Trainer(make_tiny_config(run))
    assert _contents(run) == before
    assert main(["train", "--run-dir", str(run), "--device", "cpu", "--quiet"]) == 2
    err = capsys.readouterr().err
    assert f"--run-dir {run} is not empty" in err and "Traceback" not in err
    assert _contents(run) == before


def test_overwrite_replaces_the_run_files_and_keeps_the_users_other_contents(finished: Path, tmp_path: Path) -> None:
    import shutil

    run = shutil.copytree(finished, tmp_path / "run")
    (run / "notes.txt").write_text("mine")
    old_checkpoint = (run / "checkpoint.pt").read_bytes()
    with pytest.raises(RunExistsError, match="already holds a run.*--overwrite"):
        Trainer(make_tiny_config(run, epochs=1))
    Trainer(make_tiny_config(run, epochs=1, overwrite=True, seed=1), out=io.StringIO()).fit()
    assert (run / "notes.txt").read_text() == "mine"
    assert (run / "checkpoint.pt").read_bytes() != old_checkpoint
    assert load_checkpoint(run / "checkpoint.pt")["config"]["seed"] == 1
    assert not (run / REPLACED_FOLDER).exists()  # deleted once the new run saved its checkpoint


def test_overwrite_puts_the_old_run_back_when_the_new_one_fails_before_its_first_checkpoint(
    finished: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """--overwrite sets the old run aside; a new run that fails before saving anything (at build
    time or in its first steps) gives it back, byte for byte, and says so."""
    import shutil

    run = shutil.copytree(finished, tmp_path / "run")
    before = _contents(run)
    with pytest.raises(RuntimeError):
        Trainer(make_tiny_config(run, overwrite=True), callbacks=[interrupt_at(2, RuntimeError)],
                out=io.StringIO()).fit()
    assert _contents(run) == before and not (run / REPLACED_FOLDER).exists()
    assert f"the run that --overwrite replaced is back in {run}" in capsys.readouterr().err
    with pytest.raises(ConfigError):  # fails while building (a plan that does not exist)
        Trainer(make_tiny_config(run, overwrite=True, plan=str(tmp_path / "missing.json")), out=io.StringIO())
    assert _contents(run) == before


def test_a_run_killed_before_its_first_checkpoint_keeps_the_run_it_replaced_aside(
    finished: Path, tmp_path: Path
) -> None:
    """A kill leaves the replaced run set aside: the next --overwrite keeps it there (the killed
    run had no checkpoint to lose) until a run saves one."""
    import shutil

    run = shutil.copytree(finished, tmp_path / "run")
    before = _contents(run)
    folder = RunFolder(run).open(log=lambda line: None)
    folder.replace_run(log=lambda line: None)  # what a killed run leaves: its start, no checkpoint
    (run / "metrics.jsonl").write_text("{}\n")
    with pytest.raises(RunExistsError, match=f"is in {run / REPLACED_FOLDER}: move its files back to resume it"):
        Trainer(make_tiny_config(run, epochs=1))
    with pytest.raises(CheckpointError, match=f"set aside in {run / REPLACED_FOLDER}: move its files back"):
        resolve_run({"resume": str(run)})
    Trainer(make_tiny_config(run, epochs=1, overwrite=True, seed=1), out=io.StringIO()).fit()
    assert not (run / REPLACED_FOLDER).exists() and load_checkpoint(run / "checkpoint.pt")["config"]["seed"] == 1
    run2 = shutil.copytree(finished, tmp_path / "run2")
    folder = RunFolder(run2).open(log=lambda line: None)
    folder.replace_run(log=lambda line: None)
    (run2 / "metrics.jsonl").write_text("{}\n")
    with pytest.raises(RuntimeError):
        Trainer(make_tiny_config(run2, overwrite=True), callbacks=[interrupt_at(1, RuntimeError)],
                out=io.StringIO()).fit()
    assert _contents(run2) == before


def test_resuming_into_another_non_empty_folder_is_refused(finished: Path, tmp_path: Path) -> None:
    other = tmp_path / "other"
    other.mkdir()
    (other / "metrics.jsonl").write_text("{}\n")
    with pytest.raises(RunExistsError, match=f"--run-dir {other} is not empty"):
        resolve_run({"resume": str(finished), "run_dir": str(other), "epochs": 2})
    assert (other / "metrics.jsonl").read_text() == "{}\n"


def test_plan_out_refuses_an_existing_file_before_measuring(tmp_path: Path,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    plan = tmp_path / "plan.json"
    plan.write_text("eleven minutes of profiling")
    assert main(["plan", "--model", "revnet38", "--device", "cpu", "--out", str(plan)]) == 2
    captured = capsys.readouterr()
    assert f"--out {plan} exists already; nothing was measured. Pass --overwrite" in captured.err
    assert "revtrain plan:" not in captured.out  # refused before the model was built or profiled
    assert plan.read_text() == "eleven minutes of profiling"
    profile = tmp_path / "profile.json"
    profile.write_text("kept")
    assert main(["plan", "--model", "revnet38", "--device", "cpu", "--out", str(tmp_path / "new.json"),
                 "--profile-out", str(profile)]) == 2
    assert "--profile-out" in capsys.readouterr().err and profile.read_text() == "kept"
    assert not (tmp_path / "new.json").exists()


@pytest.mark.parametrize("spelled", ["revformer-small", "revformer_small"])
def test_resume_auto_finds_a_run_under_either_spelling(spelled: str, tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    for i, name in enumerate(["revformer-small", "revformer_small"]):
        folder = Path(f"runs/{name}-text-{i}")
        folder.mkdir(parents=True)
        (folder / "config.json").write_text("{}")
        os.utime(folder / "config.json", (1000 + i, 1000 + i))
    assert find_latest_run(spelled, "text") == Path("runs/revformer_small-text-1")


def test_new_runs_are_named_by_the_registry_spelling(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    run = resolve_run({"model": "revformer-small", "dataset": "text"})
    assert run.run_dir.name.startswith("revformer_small-text-")


@pytest.mark.parametrize("part", ["optimizer", "train_loader", "progress"])
def test_a_checkpoint_missing_a_part_names_the_file_and_the_fix(finished: Path, tmp_path: Path, part: str) -> None:
    state = load_checkpoint(finished / "checkpoint.pt")
    del state[part]
    damaged = save_checkpoint(state, tmp_path / "checkpoint.pt")
    with pytest.raises(IncompatibleCheckpointError,
                       match=f"checkpoint {damaged} holds no {part} state.*start a new run without --resume"):
        resolve_run({"resume": str(damaged), "epochs": 2})


def test_a_damaged_enwik8_gz_names_the_file(tmp_path: Path) -> None:
    data = gzip.compress(b"<mediawiki>" * 1000)
    (tmp_path / "enwik8.gz").write_bytes(data[: len(data) // 2] + bytes(64))
    with pytest.raises(DatasetError, match=f"cannot decompress {tmp_path / 'enwik8.gz'}.*download enwik8 again"):
        load_corpus(tmp_path)


def test_a_full_disk_inside_torch_save_says_no_space(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The real ``torch.save`` reports a failed write as ``[enforce fail at inline_container.cc]``;
    the message must still say what happened."""
    real_fdopen = os.fdopen

    class FullDisk(io.RawIOBase):
        def __init__(self, f: Any) -> None:
            self.f, self.written = f, 0

        def writable(self) -> bool:
            return True

        def write(self, data: Any) -> int:
            self.written += len(data)
            if self.written > 4096:
                raise OSError(errno.ENOSPC, "No space left on device")
            return self.f.write(data)

        def fileno(self) -> int:
            return self.f.fileno()

        def flush(self) -> None:
            self.f.flush()

        def close(self) -> None:
            self.f.close()
            super().close()

    monkeypatch.setattr(files_module.os, "fdopen", lambda fd, mode: FullDisk(real_fdopen(fd, mode)))
    target = tmp_path / "checkpoint.pt"
    with pytest.raises(DiskFullError, match=f"no space left on device while writing checkpoint {target}"):
        save_checkpoint({"model": {"w": torch.randn(10_000)}}, target)
    monkeypatch.undo()
    assert sorted(os.listdir(tmp_path)) == []  # no temporary file left


def test_a_plan_file_of_random_bytes_or_a_folder_names_the_file(tmp_path: Path) -> None:
    junk = tmp_path / "plan.json"
    junk.write_bytes(bytes(range(256)) * 4)
    with pytest.raises(ConfigError, match=f"--plan {junk}: .*{junk}.* not UTF-8 JSON"):
        Trainer(make_tiny_config(tmp_path / "run", plan=str(junk)), out=io.StringIO())
    with pytest.raises(ConfigError, match=f"--plan {tmp_path} is a folder; pass the plan file"):
        Trainer(make_tiny_config(tmp_path / "run2", plan=str(tmp_path)), out=io.StringIO())


def test_a_petra_run_refuses_a_non_empty_folder(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run = tmp_path / "petra"
    run.mkdir()
    (run / "metrics.jsonl").write_text("mine\n")
    assert main(["train", "--stages", "2", "--engine", "simulator", "--run-dir", str(run), "--device", "cpu"]) == 2
    assert f"--run-dir {run} is not empty" in capsys.readouterr().err
    assert _contents(run) == {"metrics.jsonl": b"mine\n"}


def test_a_checkpoint_saved_elsewhere_does_not_release_the_replaced_run(finished: Path, tmp_path: Path) -> None:
    import shutil

    run = shutil.copytree(finished, tmp_path / "run")
    before = _contents(run)

    def snapshot_then_fail(trainer: Trainer) -> None:
        if trainer.step == 1:
            trainer.save_checkpoint(tmp_path / "snapshot.pt")  # not the run folder's checkpoint
        if trainer.step == 2:
            raise RuntimeError("simulated")

    with pytest.raises(RuntimeError):
        Trainer(make_tiny_config(run, overwrite=True), callbacks=[snapshot_then_fail], out=io.StringIO()).fit()
    assert (tmp_path / "snapshot.pt").is_file() and _contents(run) == before


def test_set_aside_covers_the_old_plan_when_the_new_run_writes_one_and_survives_a_kill_while_moving(
    finished: Path, tmp_path: Path
) -> None:
    import shutil

    run = shutil.copytree(finished, tmp_path / "run")
    (run / "plan.json").write_text("the old run's plan")
    before = _contents(run)
    folder = RunFolder(run).open(log=lambda line: None)
    moved = folder.replace_run(log=lambda line: None, writes_plan=True)
    assert "plan.json" in {p.name for p in moved} and not (run / "plan.json").exists()
    (run / "plan.json").write_text("the new run's plan")
    assert folder.discard() == "restored" and _contents(run) == before
    # A kill in the middle of setting the run aside leaves part of it in the .partial folder:
    # the next --overwrite first puts that part back, then sets the whole run aside.
    partial = run / f"{REPLACED_FOLDER}.partial"
    partial.mkdir()
    (run / "metrics.jsonl").rename(partial / "metrics.jsonl")
    folder = RunFolder(run).open(log=lambda line: None)
    folder.replace_run(log=lambda line: None)
    assert not partial.exists() and (run / REPLACED_FOLDER / "metrics.jsonl").is_file()
    assert folder.discard() == "restored" and _contents(run) == before
