"""PETRA as the Trainer's engine in one process (the simulator): J = 1 is ordinary training, the
learning-rate rule is part of the run config, and a resume keeps the split it had."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from revtrain.cli import main
from revtrain.parallel import PetraEngine
from revtrain.train import ConfigError, TrainConfig, Trainer

TINY = dict(model="revnet38", dataset="digits", epochs=1, max_steps_per_epoch=3, batch_size=16, threads=1,
            quiet=True, memory_report=False, warmup_epochs=0.5)


def test_one_stage_equals_the_ordinary_trainer(tmp_path: Path) -> None:
    """J = 1 through the PETRA engine makes the update of the local engine (SGD, Nesterov, weight
    decay, k = 2 micro-batches averaged). Float32: the model runs its reversible sequence as one
    autograd function and the stage block by block, so the gradients differ by rounding (about
    1e-8 relative); J = 1 equals plain backprop to 1e-10 in float64 in test_arithmetic.py."""
    tiny = {**TINY, "max_steps_per_epoch": 1}
    local = Trainer(TrainConfig(**tiny, accumulation=2, lr=0.05, run_dir=str(tmp_path / "local")))
    start = {k: v.clone() for k, v in local.model.state_dict().items()}
    local.fit()
    petra = Trainer(TrainConfig(**tiny, accumulation=2, lr=0.05, stages=1, engine="simulator",
                                run_dir=str(tmp_path / "petra")), engine=PetraEngine(simulate=True))
    petra.fit()
    want, got = local.model.state_dict(), petra.model.state_dict()
    assert petra.step == local.step == 1
    for key, value in want.items():
        torch.testing.assert_close(got[key], value, rtol=1e-5, atol=1e-6, msg=key)
    assert any(not torch.equal(value, start[key]) for key, value in want.items())


def test_the_learning_rate_rule_is_a_field_of_the_run_config() -> None:
    assert TrainConfig(stages=2, batch_size=64).lr == pytest.approx(0.025)
    assert TrainConfig(stages=2, batch_size=64, accumulation=4, lr_per_256=0.2).lr == pytest.approx(0.2)
    assert TrainConfig(stages=2, lr=0.3).lr == 0.3 and TrainConfig().lr == 0.1
    again = TrainConfig.from_dict(TrainConfig(stages=2, batch_size=32).to_dict())
    assert again.lr == pytest.approx(0.0125) and again.stages == 2
    with pytest.raises(ConfigError, match="--split, --lr-per-256: PETRA options; add --stages J"):
        TrainConfig(split="3,3", lr_per_256=0.2)
    with pytest.raises(ConfigError, match="--optimizer: PETRA uses SGD.*--amp: PETRA runs"):
        TrainConfig(stages=2, optimizer="adamw", amp="bf16")


@pytest.mark.multiprocess  # the resume without --stages runs on one process per stage
def test_a_resume_keeps_the_split_and_refuses_another(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run = tmp_path / "run"
    argv = ["train", "--stages", "2", "--engine", "simulator", "--epochs", "1", "--max-steps-per-epoch", "2",
            "--batch-size", "16", "--threads", "1", "--quiet", "--no-memory-report"]
    assert main([*argv, "--split", "6,3", "--run-dir", str(run)]) == 0
    assert json.loads((run / "summary.json").read_text())["petra"]["split"] == [6, 3]
    capsys.readouterr()
    assert main([*argv, "--epochs", "2", "--split", "5,4", "--resume", str(run)]) == 2
    assert "trained with the split 6,3 (blocks per stage) and this run asks for 5,4" in capsys.readouterr().err
    # No --stages: the run's stages and split, on one process per stage (--engine is each command's).
    assert main(["train", "--epochs", "2", "--resume", str(run)]) == 0
    summary = json.loads((run / "summary.json").read_text())
    assert summary["petra"]["split"] == [6, 3] and summary["steps"] == 4
    assert json.loads((run / "config.json").read_text())["engine"] == "processes"
    assert main([*argv, "--epochs", "3", "--resume", str(run)]) == 0  # the split it had, without --split
    summary = json.loads((run / "summary.json").read_text())
    assert summary["petra"]["split"] == [6, 3] and summary["steps"] == 6
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["stage0-step6.pt", "stage1-step6.pt"]
    # --engine alone on a resume (the guide's "continue it in one process"): the run's stages are kept.
    assert main(["train", "--epochs", "4", "--engine", "simulator", "--quiet", "--no-memory-report",
                 "--resume", str(run)]) == 0
    assert json.loads((run / "config.json").read_text())["engine"] == "simulator"
    assert json.loads((run / "summary.json").read_text())["steps"] == 8


def test_the_simulator_under_torchrun_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    """N simulators in one folder would each train the whole run: refused before anything is written."""
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "test")
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert main(["train", "--stages", "2", "--engine", "simulator", "--run-dir", str(tmp_path / "run")]) == 2
    assert "use --engine processes, or start one process" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()
