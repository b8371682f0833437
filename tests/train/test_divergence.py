"""Non-finite options are refused before training; a diverging run stops, in M-mode and C-mode alike."""

from __future__ import annotations

import io
import math
import warnings
from pathlib import Path

import pytest
import torch
from torch import nn

from revtrain.errors import ReconstructionDriftWarning
from revtrain.train import ConfigError, Trainer, TrainingDivergedError, load_checkpoint
from revtrain.train.divergence import divergence_reason

from .conftest import TinyConfig, make_tiny_config


@pytest.mark.parametrize(
    ("option", "value"),
    [("lr", math.inf), ("weight_decay", math.nan), ("warmup_epochs", math.inf), ("momentum", math.nan),
     ("gamma", -math.inf), ("divergence_factor", math.inf), ("milestones", (0.5, math.nan))],
)
def test_non_finite_options_are_refused_naming_the_option(tmp_path: Path, option: str, value: object) -> None:
    flag = "--" + option.replace("_", "-")
    with pytest.raises(ConfigError, match=f"^{option} \\({flag}\\) must be a finite number"):
        make_tiny_config(tmp_path / "run", **{option: value})
    assert not (tmp_path / "run").exists()


def test_divergence_reason_names_the_bound() -> None:
    assert divergence_reason(2.0, reference=2.3, factor=10) is None
    assert divergence_reason(2.0, reference=None, factor=10) is None  # the first step sets the reference
    assert "more than 10 times the run's first loss 2.3" in str(divergence_reason(23.5, reference=2.3, factor=10))
    assert divergence_reason(1e9, reference=2.3, factor=0) is None  # the bound is off
    for loss in (math.nan, math.inf):
        assert divergence_reason(loss, reference=2.3, factor=0) == f"the training loss is {loss}"


class _Poison:
    """A forward hook on the model's output from step ``at`` on: NaN, or logits blown up."""

    def __init__(self, trainer: Trainer, at: int, kind: str) -> None:
        self.trainer, self.at, self.kind = trainer, at, kind
        trainer.model.register_forward_hook(self)

    def __call__(self, module: nn.Module, inputs: object, output: torch.Tensor) -> torch.Tensor | None:
        if not (module.training and self.trainer.step + 1 >= self.at):
            return None
        return output * math.nan if self.kind == "nan" else output * 1e4


@pytest.mark.parametrize("mode", ["M", "C"])
@pytest.mark.parametrize(("kind", "reason"), [("nan", "the training loss is nan"),
                                              ("huge", "the training loss [0-9.e+]+ is more than 10 times the run's first")])
def test_a_diverging_step_stops_the_run_before_its_update(tiny_config: TinyConfig, mode: str, kind: str,
                                                          reason: str) -> None:
    config = tiny_config(f"{kind}{mode}", mode=mode, checkpoint_every=2)
    trainer = Trainer(config, out=io.StringIO())
    _Poison(trainer, at=3, kind=kind)
    weights: dict[str, torch.Tensor] = {}
    trainer.callbacks.append(lambda t: weights.update({k: v.clone() for k, v in t.model.named_parameters()}))
    with pytest.raises(TrainingDivergedError, match=f"training diverged at step 3 \\(epoch 1\\): {reason}.*"
                                                    f"the last checkpoint, {config.run_dir}/checkpoint.pt, is kept"):
        trainer.fit()
    # Step 3 was not applied (its forward did update batch-norm statistics, as any forward does).
    assert all(torch.equal(p, weights[k]) for k, p in trainer.model.named_parameters())
    assert trainer.step == 2 and trainer.scheduler.last_epoch == 2
    assert load_checkpoint(Path(config.run_dir) / "checkpoint.pt")["progress"]["step"] == 2


@pytest.mark.parametrize("mode", ["M", "C"])
def test_a_learning_rate_that_blows_up_stops_the_run(tiny_config: TinyConfig, mode: str) -> None:
    config = tiny_config(f"lr{mode}", mode=mode, lr=1e3, warmup_epochs=0)
    # The forward of step 2 is already non-finite: the rebuild check leaves that to the loss
    # (no drift warning for a non-finite forward), and the trainer stops the run.
    with warnings.catch_warnings():
        warnings.simplefilter("error", ReconstructionDriftWarning)
        with pytest.raises(TrainingDivergedError, match="training diverged at step 2 .*Lower --lr \\(now 1000\\)"):
            Trainer(config, out=io.StringIO()).fit()
    assert not Path(config.run_dir).exists()  # failed before its first checkpoint: nothing left


def test_weights_that_turn_non_finite_are_never_checkpointed(tiny_config: TinyConfig) -> None:
    config = tiny_config("weights", checkpoint_every=1)

    def nan_gradient_step(trainer: Trainer) -> None:  # a finite loss, then a NaN update
        if trainer.step == 3:
            with torch.no_grad():
                next(trainer.model.parameters()).fill_(math.nan)

    with pytest.raises(TrainingDivergedError, match="the weights turned NaN or infinite by step 3 .*no checkpoint "
                                                    "was written"):
        Trainer(config, callbacks=[nan_gradient_step], out=io.StringIO()).fit()
    state = load_checkpoint(Path(config.run_dir) / "checkpoint.pt")  # finite, or it would raise
    assert state["progress"]["step"] == 3 and state["progress"]["pending_eval"] == 0  # saved before the poison
