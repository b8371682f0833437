"""The `revtrain` command line: subcommands, help from config docstrings, errors without tracebacks."""

from __future__ import annotations

import errno
import json
import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from revtrain.cli import main
from revtrain.models import list_models
from revtrain.train import TrainConfig, field_docs, load_checkpoint

TINY = ["--image-size", "8", "--batch-size", "16", "--eval-batch-size", "360", "--max-steps-per-epoch", "2",
        "--device", "cpu", "--no-memory-report", "--quiet"]


@pytest.fixture(autouse=True, scope="module")
def one_thread() -> Iterator[None]:
    """One thread: on a busy 2-core machine OpenMP's spinning makes two threads ~10x slower."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _fails_cleanly(capsys: pytest.CaptureFixture[str], argv: list[str]) -> str:
    assert main(argv) == 2
    captured = capsys.readouterr()
    assert "Traceback" not in captured.err and captured.err.count("\n") == 1  # one paragraph
    return captured.err


def test_models_lists_every_registered_model_with_counts(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["models"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split()[:5] == ["model", "kind", "dataset", "params", "paper"]
    assert [line.split()[0] for line in lines[1:]] == list_models()
    revnet38 = next(line for line in lines if line.startswith("revnet38 "))
    assert "reversible" in revnet38 and "0.46M" in revnet38


def test_models_pattern_filters(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["models", "resnet1*"]) == 0
    names = [line.split()[0] for line in capsys.readouterr().out.splitlines()[1:]]
    assert names == list_models("resnet1*") and names


def test_unknown_model_lists_close_matches(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    err = _fails_cleanly(capsys, ["train", "--model", "revnet-38", "--run-dir", str(tmp_path / "r")])
    assert "unknown model 'revnet-38'; did you mean: revnet38" in err
    assert "revtrain models" in err


def test_missing_cifar_folder_says_how_to_get_it(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    missing = tmp_path / "no-data"
    err = _fails_cleanly(capsys, ["train", "--dataset", "cifar10", "--data-dir", str(missing),
                                  "--run-dir", str(tmp_path / "r")])
    assert f"data folder {missing} does not exist" in err and "cifar-10-python.tar.gz" in err


def test_corrupt_checkpoint_fails_cleanly(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    bad = tmp_path / "checkpoint.pt"
    bad.write_bytes(b"\x00" * 100)
    err = _fails_cleanly(capsys, ["train", "--resume", str(bad)])
    assert f"cannot read checkpoint {bad}" in err


def test_bad_option_value_fails_cleanly(capsys: pytest.CaptureFixture[str]) -> None:
    err = _fails_cleanly(capsys, ["train", "--epochs", "0"])
    assert "epochs must be an integer >= 1" in err


def test_help_comes_from_the_config_docstrings(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["train", "--help"])
    assert exit_info.value.code == 0
    text = " ".join(capsys.readouterr().out.split())  # undo argparse's line wrapping
    for name in ("lr", "weight_decay", "budget", "resume", "task", "divergence_factor"):
        assert " ".join(field_docs(TrainConfig)[name].split()) in text
    assert "--no-nesterov" in text and "(default: revnet38)" in text


def test_train_then_resume_with_more_epochs(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    run = tmp_path / "run"
    assert main(["train", *TINY, "--epochs", "1", "--run-dir", str(run)]) == 0
    out = capsys.readouterr().out
    assert "epoch 1/1" in out and "test loss" in out and " acc " in out
    assert json.loads((run / "summary.json").read_text())["steps"] == 2

    # Resume takes the saved settings (image size, batch size, ...) and extends to 2 epochs.
    assert main(["train", "--resume", str(run / "checkpoint.pt"), "--epochs", "2", "--no-memory-report"]) == 0
    out = capsys.readouterr().out
    assert "resumed from" in out and "epoch 2/2" in out and "epoch 1/2" not in out
    config = json.loads((run / "config.json").read_text())
    assert (config["epochs"], config["image_size"], config["batch_size"]) == (2, 8, 16)
    assert json.loads((run / "summary.json").read_text())["steps"] == 4


def test_train_resume_reads_the_checkpoint_once(tmp_path: Path, request: pytest.FixtureRequest) -> None:
    """`revtrain train --resume` learns the run's process layout and trains from one read of its checkpoint."""
    run = tmp_path / "run"
    assert main(["train", *TINY, "--epochs", "1", "--run-dir", str(run)]) == 0
    reads = request.getfixturevalue("checkpoint_reads")  # counting starts after the first run
    assert main(["train", "--resume", str(run), "--epochs", "2", "--no-memory-report", "--quiet"]) == 0
    assert reads == [run / "checkpoint.pt"]
    assert json.loads((run / "summary.json").read_text())["steps"] == 4


def test_train_with_check_every_from_the_command_line(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    run = tmp_path / "run"
    assert main(["train", *TINY, "--epochs", "1", "--check-every", "0", "--run-dir", str(run)]) == 0
    assert "rebuild check off" in capsys.readouterr().out
    assert json.loads((run / "config.json").read_text())["check_every"] == 0
    err = _fails_cleanly(capsys, ["train", *TINY, "--check-every", "-1", "--run-dir", str(tmp_path / "bad")])
    assert "check_every must be an integer >= 0" in err


def test_bench_runs_a_suite_with_small_options(tmp_path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "core"
    argv = ["bench", "core", "--shapes", "2x4x4x2", "--repeats", "2", "--warmup", "0", "--device", "cpu",
            "--out", str(out)]
    assert main(argv) == 0
    table = out.with_name("core.md").read_text()
    assert "| 2x4x4x2 | plain |" in table and "| 2x4x4x2 | M |" in table
    assert f"wrote {out}.md" in capsys.readouterr().out


def test_plan_subcommand_is_wired(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["plan", "--help"])
    assert exit_info.value.code == 0
    assert "--budget" in capsys.readouterr().out


def test_no_command_prints_help(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([]) == 2
    assert "train" in capsys.readouterr().out


@pytest.mark.parametrize(("argv", "message"), [
    (["--lr", "inf"], "lr (--lr) must be a finite number, got inf"),
    (["--weight-decay", "nan"], "weight_decay (--weight-decay) must be a finite number, got nan"),
    (["--warmup-epochs", "inf"], "warmup_epochs (--warmup-epochs) must be a finite number, got inf"),
])
def test_non_finite_options_fail_cleanly(capsys: pytest.CaptureFixture[str], argv: list[str], message: str) -> None:
    assert message in _fails_cleanly(capsys, ["train", *argv])


def test_run_safety_errors_are_one_line_naming_the_file(capsys: pytest.CaptureFixture[str], tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    run = tmp_path / "run"
    assert main(["train", *TINY, "--epochs", "1", "--run-dir", str(run)]) == 0
    capsys.readouterr()
    err = _fails_cleanly(capsys, ["train", *TINY, "--run-dir", str(run)])  # no --resume
    assert f"--run-dir {run} already holds a run" in err
    err = _fails_cleanly(capsys, ["train", "--resume", str(run), "--batch-size", "8"])
    assert f"cannot resume {run / 'checkpoint.pt'} with --batch-size 8" in err
    damaged = tmp_path / "damaged.pt"
    state = torch.load(run / "checkpoint.pt", weights_only=True)
    state["config"]["lr"] = 1.0
    torch.save(state, damaged)
    err = _fails_cleanly(capsys, ["train", "--resume", str(damaged)])
    assert f"checkpoint {damaged} fails its checksum" in err

    import revtrain.train.checkpoint as checkpoint_module

    def disk_full(obj: object, f: object, *args: object, **kwargs: object) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(checkpoint_module.torch, "save", disk_full)
    err = _fails_cleanly(capsys, ["train", "--resume", str(run), "--epochs", "2"])
    assert f"no space left on device while writing checkpoint {run / 'checkpoint.pt'}" in err
    assert "the previous checkpoint" in err and "is kept unchanged" in err


def test_sigterm_saves_and_exits_143(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    """A real SIGTERM, sent by another thread (as a scheduler would) once training runs."""
    previous = signal.signal(signal.SIGTERM, lambda *_: None)  # a stray signal must not kill pytest
    run = tmp_path / "run"
    metrics = run / "metrics.jsonl"

    def scheduler() -> None:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if metrics.is_file() and '"step"' in metrics.read_text():
                os.kill(os.getpid(), signal.SIGTERM)
                return
            time.sleep(0.01)

    sender = threading.Thread(target=scheduler, daemon=True)
    sender.start()
    try:
        code = main(["train", *TINY, "--epochs", "1000", "--run-dir", str(run)])
    finally:
        sender.join()
        signal.signal(signal.SIGTERM, previous)
    assert code == 128 + signal.SIGTERM
    err = capsys.readouterr().err
    assert "terminated (SIGTERM) at step" in err and f"revtrain train --resume {run / 'checkpoint.pt'}" in err
    assert load_checkpoint(run / "checkpoint.pt")["progress"]["step"] >= 1
