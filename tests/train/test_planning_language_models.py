"""``revtrain train --budget`` / ``--plan`` on a language model: the plan is made with the token
loss, and a plan made at another sequence length is flagged."""

from __future__ import annotations

import io
from pathlib import Path

import pytest

from revtrain.core import get_modes
from revtrain.planner import Plan
from revtrain.train import TrainConfig, Trainer

def _config(corpus: Path, run_dir: Path, **overrides) -> TrainConfig:
    options = dict(model="revformer_tiny", dataset="text", data_dir=str(corpus), batch_size=4, epochs=1,
                   max_steps_per_epoch=1, optimizer="adamw", lr=1e-3, warmup_epochs=0, device="cpu", threads=1,
                   quiet=True, memory_report=False, run_dir=str(run_dir))
    options.update(overrides)
    return TrainConfig(**options)


def test_budget_plans_a_language_model_with_its_token_loss(corpus, tmp_path):
    # The model's logits are (B, T, vocab): planning with the image classifier's cross-entropy
    # would fail on them; the plan is made with the run's task's loss.
    out = io.StringIO()
    trainer = Trainer(_config(corpus, tmp_path / "run", budget="1GiB", context=8), out=out)
    plan = Plan.from_json(tmp_path / "run" / "plan.json")
    assert plan.modes == get_modes(trainer.model) and len(plan.modes) == 2
    assert plan.input_shape == (8,) and plan.batch_size == 4
    assert plan.measured_peak_bytes is not None and plan.summary() in out.getvalue()


def test_a_plan_made_at_another_sequence_length_is_flagged(corpus, tmp_path):
    Trainer(_config(corpus, tmp_path / "planned", budget="1GiB", context=8))
    plan_path = tmp_path / "planned" / "plan.json"
    out = io.StringIO()
    Trainer(_config(corpus, tmp_path / "same", plan=str(plan_path), context=8), out=out)
    assert "warning" not in out.getvalue()
    out = io.StringIO()
    trainer = Trainer(_config(corpus, tmp_path / "longer", plan=str(plan_path), context=16), out=out)
    assert "warning: the plan was solved for sequence length 8 (this run: 16)" in out.getvalue()
    assert get_modes(trainer.model) == Plan.from_json(plan_path).modes  # applied all the same, as for a batch size


def test_train_budget_on_a_language_model_from_the_command_line(corpus, tmp_path, capsys):
    from revtrain.cli import main

    run_dir = tmp_path / "cli"
    code = main(["train", "--model", "revformer-tiny", "--dataset", "text", "--data-dir", str(corpus),
                 "--context", "8", "--batch-size", "4", "--epochs", "1", "--max-steps-per-epoch", "1",
                 "--warmup-epochs", "0", "--device", "cpu", "--threads", "1", "--quiet", "--no-memory-report",
                 "--budget", "1GiB", "--run-dir", str(run_dir)])
    assert code in (0, None)
    plan = Plan.from_json(run_dir / "plan.json")
    assert plan.input_shape == (8,) and list(plan.modes) == ["layers.blocks.0", "layers.blocks.1"]
    assert plan.summary() in capsys.readouterr().out


def test_a_budget_no_plan_can_meet_on_a_language_model_is_a_clear_error(corpus, tmp_path):
    from revtrain.planner.errors import BudgetTooSmallError

    with pytest.raises(BudgetTooSmallError, match="budget"):
        Trainer(_config(corpus, tmp_path / "small", budget="1KiB", context=8))
