"""Exact resume: an interrupted-and-resumed run ends bit-identical to an uninterrupted one."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest

from revtrain.train import TrainConfig, Trainer, load_checkpoint, resolve_run
from revtrain.train.resume import ResumeConflictError

from .conftest import TinyConfig, assert_same_training_state, interrupt_at, make_tiny_config


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Trainer:
    """The tiny run (2 epochs x 3 steps), uninterrupted; shared by the tests of this module."""
    trainer = Trainer(make_tiny_config(tmp_path_factory.mktemp("reference")))
    trainer.fit()
    return trainer


def _steps(run_dir: str | Path) -> list[tuple[int, float, float]]:
    lines = Path(run_dir, "metrics.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in lines]
    return [(r["step"], r["loss"], r["lr"]) for r in records if r["event"] == "step"]


def test_keyboard_interrupt_mid_epoch_saves_and_resumes_exactly(
    tiny_config: TinyConfig, reference: Trainer, capsys: pytest.CaptureFixture[str]
) -> None:
    config = tiny_config("interrupted")
    first = Trainer(config, callbacks=[interrupt_at(4)])  # step 4 = batch 2 of 3 in epoch 2
    with pytest.raises(KeyboardInterrupt):
        first.fit()
    ckpt = Path(config.run_dir) / "checkpoint.pt"
    err = capsys.readouterr().err
    assert f"checkpoint saved to {ckpt}" in err and f"revtrain train --resume {ckpt}" in err
    state = load_checkpoint(ckpt)
    assert state["progress"]["step"] == 4
    assert state["train_loader"]["epoch"] == 1 and state["train_loader"]["next_batch"] == 1

    resumed = Trainer(config.replace(resume=str(ckpt)))
    resumed.fit()
    assert_same_training_state(resumed, reference)
    assert resumed.history == [
        {**h, "samples_per_s": r["samples_per_s"], "epoch_train_time_s": r["epoch_train_time_s"],
         "memory_bytes": r["memory_bytes"]}
        for h, r in zip(reference.history, resumed.history, strict=True)
    ]
    assert _steps(config.run_dir) == _steps(reference.config.run_dir)


def test_interrupt_after_last_step_of_epoch_evaluates_on_resume(
    tiny_config: TinyConfig, reference: Trainer
) -> None:
    config = tiny_config("epoch_end")
    with pytest.raises(KeyboardInterrupt):
        Trainer(config, callbacks=[interrupt_at(3)]).fit()
    state = load_checkpoint(Path(config.run_dir) / "checkpoint.pt")
    assert state["progress"]["pending_eval"] == 0 and state["progress"]["history"] == []
    resumed = Trainer(config.replace(resume=str(Path(config.run_dir) / "checkpoint.pt")))
    resumed.fit()
    assert_same_training_state(resumed, reference)
    assert [h["test_acc"] for h in resumed.history] == [h["test_acc"] for h in reference.history]


def test_crash_resumes_from_periodic_checkpoint_and_metrics_read_as_one_run(
    tiny_config: TinyConfig, reference: Trainer
) -> None:
    config = tiny_config("crashed", checkpoint_every=2)
    with pytest.raises(RuntimeError, match="simulated"):
        Trainer(config, callbacks=[interrupt_at(5, RuntimeError)]).fit()  # last save: step 4
    ckpt = Path(config.run_dir) / "checkpoint.pt"
    assert load_checkpoint(ckpt)["progress"]["step"] == 4
    assert [s for s, _, _ in _steps(config.run_dir)] == [1, 2, 3, 4, 5]  # step 5 was lost
    resumed = Trainer(config.replace(resume=str(ckpt)))
    resumed.fit()
    assert_same_training_state(resumed, reference)
    assert _steps(config.run_dir) == _steps(reference.config.run_dir)


def test_sigint_stops_after_the_current_step(tiny_config: TinyConfig) -> None:
    config = tiny_config("sigint")

    def press_ctrl_c(trainer: Trainer) -> None:
        if trainer.step == 2:
            os.kill(os.getpid(), signal.SIGINT)

    handler = signal.getsignal(signal.SIGINT)
    trainer = Trainer(config, callbacks=[press_ctrl_c])
    with pytest.raises(KeyboardInterrupt):
        trainer.fit()
    assert load_checkpoint(Path(config.run_dir) / "checkpoint.pt")["progress"]["step"] == 2
    assert signal.getsignal(signal.SIGINT) is handler  # the trainer's handler is gone


def test_resume_takes_saved_config_and_explicit_overrides(tiny_config: TinyConfig) -> None:
    config = tiny_config("extend", epochs=1, lr=0.05)
    Trainer(config).fit()
    ckpt = Path(config.run_dir) / "checkpoint.pt"
    run = resolve_run({"resume": str(ckpt), "epochs": 2})
    merged = run.config
    assert (merged.epochs, merged.lr, merged.batch_size) == (2, 0.05, 16)
    assert merged.run_dir == config.run_dir and merged.resume == str(ckpt)
    assert run.checkpoint == ckpt and run.state is not None and run.state["progress"]["step"] == 3
    assert any("epochs 1 -> 2" in note for note in run.notes)
    trainer = Trainer(run)
    trainer.fit()
    assert trainer.step == 6 and [h["epoch"] for h in trainer.history] == [0, 1]


def test_a_new_check_interval_on_resume_is_said_and_a_run_saved_without_one_leaves_the_layers_as_built(
    tiny_config: TinyConfig,
) -> None:
    config = tiny_config("checks", epochs=1)
    Trainer(config).fit()
    ckpt = Path(config.run_dir) / "checkpoint.pt"
    run = resolve_run({"resume": str(ckpt), "epochs": 2, "check_every": 0})
    assert run.config.check_every == 0
    assert any("check_every None -> 0" in note for note in run.notes)
    # A run saved before the option existed reads as leaving the layers as built (None), so
    # resuming it without the option announces no change.
    older = {k: v for k, v in run.state["config"].items() if k != "check_every"}
    assert TrainConfig.from_dict(older).check_every is None


def test_resume_auto_finds_the_run_folder_checkpoint(tiny_config: TinyConfig) -> None:
    config = tiny_config("auto", epochs=1)
    Trainer(config).fit()
    run = resolve_run({"resume": "auto", "run_dir": config.run_dir, "epochs": 2})
    assert run.config.resume == str(Path(config.run_dir) / "checkpoint.pt")
    assert Trainer(run).step == 3


def test_abort_inside_a_step_keeps_the_last_checkpoint(
    tiny_config: TinyConfig, capsys: pytest.CaptureFixture[str]
) -> None:
    config = tiny_config("abort", checkpoint_every=2)
    trainer = Trainer(config)

    def second_ctrl_c(module: object, inputs: object, output: object) -> None:
        if trainer.step == 4 and module is trainer.model:  # in the forward of step 5
            raise KeyboardInterrupt

    trainer.model.register_forward_hook(second_ctrl_c)
    with pytest.raises(KeyboardInterrupt):
        trainer.fit()
    assert "aborted inside a training step at step 4: no checkpoint written" in capsys.readouterr().err
    assert load_checkpoint(Path(config.run_dir) / "checkpoint.pt")["progress"]["step"] == 4


def test_resume_accepts_the_run_folder(tiny_config: TinyConfig) -> None:
    config = tiny_config("folder", epochs=1)
    Trainer(config).fit()
    assert Trainer(config.replace(resume=config.run_dir)).step == 3


def test_a_resume_reads_the_checkpoint_once(tiny_config: TinyConfig, request: pytest.FixtureRequest) -> None:
    config = tiny_config("once", epochs=1)
    Trainer(config).fit()
    reads = request.getfixturevalue("checkpoint_reads")  # counting starts after the first run
    trainer = Trainer(resolve_run({"resume": config.run_dir, "epochs": 2}))
    trainer.fit()
    assert reads == [Path(config.run_dir) / "checkpoint.pt"] and trainer.step == 6


def test_an_option_of_the_resumed_run_that_data_parallel_refuses_is_named_as_the_runs(
        tiny_config: TinyConfig) -> None:
    """The run was saved with --grad-angle-every; its resume with --data-parallel says the option
    came from the run and how to drop it, and dropping it that way resumes."""
    config = tiny_config("angles", epochs=1, grad_angle_every=3)
    Trainer(config).fit()
    with pytest.raises(ResumeConflictError, match=r"the run was trained with --grad-angle-every 3, which is not "
                                                  r"available with --data-parallel .*pass --grad-angle-every 0"):
        resolve_run({"resume": config.run_dir, "data_parallel": 2})
    run = resolve_run({"resume": config.run_dir, "data_parallel": 2, "grad_angle_every": 0})
    assert (run.config.data_parallel, run.config.grad_angle_every) == (2, 0)
