"""The trainer's seams: loss, metrics and formatting come from a Task; a step is forward_backward + optimizer_step."""

from __future__ import annotations

import io
import json
from collections.abc import Iterator, Mapping
from pathlib import Path

import pytest
import torch
from torch import Tensor

import revtrain.tasks as tasks_module
from revtrain.data import DatasetInfo
from revtrain.tasks import Classification, Task
from revtrain.train import ConfigError, Trainer
from revtrain.train.build import fit_model_to_data

from .conftest import TinyConfig


class Top2(Classification):
    """Classification that also reports top-2 accuracy and counts what the trainer asks of it."""

    name = "top2_test"
    headline = "top2"
    calls: dict[str, int] = {}

    def loss(self, output: Tensor, target: Tensor) -> Tensor:
        Top2.calls["loss"] = Top2.calls.get("loss", 0) + 1
        return super().loss(output, target)

    def batch_sums(self, output: Tensor, target: Tensor, loss: Tensor | None = None) -> dict[str, float]:
        sums = super().batch_sums(output, target, loss)
        top2 = output.topk(2, dim=1).indices
        sums["top2"] = float((top2 == target[:, None]).any(1).sum())
        return sums

    def summarize(self, sums: Mapping[str, float]) -> dict[str, float]:
        count = max(sums.get("count", 0.0), 1.0)
        return {**super().summarize(sums), "top2": sums.get("top2", 0.0) / count}

    def format(self, metrics: Mapping[str, float]) -> str:
        return f"loss {metrics['loss']:.4f} top-2 {metrics['top2']:.1%}"


class FakeLanguageModeling(Classification):
    name = "fake_lm_test"
    input_kind = "tokens"


@pytest.fixture
def registered() -> Iterator[None]:
    """Register the test tasks for one test only (the task registry is global)."""
    with pytest.MonkeyPatch.context() as mp:
        for cls in (Top2, FakeLanguageModeling):
            mp.setitem(tasks_module._TASKS, cls.name, cls)
        Top2.calls = {}
        yield


def test_loss_metrics_and_lines_come_from_the_task(tiny_config: TinyConfig, registered: None) -> None:
    config = tiny_config(task="top2_test", memory_report=True, epochs=1)
    out = io.StringIO()
    trainer = Trainer(config, out=out)
    assert isinstance(trainer.task, Top2)
    summary = trainer.fit()
    # three training steps, and the memory report in the run's modes and in C-mode: a warm-up, a
    # tracked step (what a step leaves for the next counts) and the measured step each
    assert Top2.calls["loss"] == 3 + 2 * 3
    events = [json.loads(line) for line in Path(config.run_dir, "metrics.jsonl").read_text().splitlines()]
    steps = [e for e in events if e["event"] == "step"]
    assert all(0 <= e["top2"] <= 1 and e["top2"] >= e["acc"] for e in steps)
    epoch = next(e for e in events if e["event"] == "epoch")
    assert {"train_top2", "test_top2", "train_acc", "test_acc", "train_loss", "test_loss"} <= set(epoch)
    assert summary["task"] == "top2_test" and summary["headline"] == "top2"
    assert summary["test_top2"] == trainer.history[-1]["test_top2"] >= summary["test_acc"]
    lines = out.getvalue().splitlines()
    assert any(line.startswith("epoch 1/1  train loss ") and " top-2 " in line for line in lines)
    assert any(line.startswith("test loss ") and " top-2 " in line for line in lines)


def test_evaluation_sums_are_exact_over_uneven_batches(tiny_config: TinyConfig, registered: None) -> None:
    trainer = Trainer(tiny_config(task="top2_test", eval_batch_size=100))  # 360 = 3 x 100 + 60
    metrics = trainer.evaluate()
    trainer.model.eval()
    test_set = trainer.test_loader.dataset
    with torch.no_grad():  # the whole test split in one batch
        x, y = test_set.get_batch(torch.arange(len(test_set)))
        output = trainer.model(x)
    whole = Top2().summarize(Top2().batch_sums(output, y))
    assert metrics == pytest.approx(whole, rel=1e-6)


def test_the_task_must_fit_the_models_inputs(tiny_config: TinyConfig, registered: None) -> None:
    with pytest.raises(ConfigError, match="--task fake_lm_test trains on tokens inputs and model revnet38 takes "
                                          "image inputs; drop --task"):
        Trainer(tiny_config(task="fake_lm_test"))
    with pytest.raises(ConfigError, match="--task nope: unknown task 'nope'; known tasks: "):
        Trainer(tiny_config(task="nope"))


def test_model_is_fitted_to_the_dataset_from_its_input_spec() -> None:
    info = DatasetInfo(name="digits", input_shape=(1, 8, 8), num_classes=10, train_size=1, test_size=1)
    fit = fit_model_to_data("revnet110", None, info, torch.zeros(2, 1, 8, 8))
    assert fit.overrides == {"num_classes": 10, "in_channels": 1}
    assert (fit.spec.kind, fit.spec.shape, fit.task.name) == ("image", (1, 8, 8), "classification")
    with pytest.raises(ConfigError, match="model revnet110 takes image inputs but dataset digits gives tokens"):
        fit_model_to_data("revnet110", None, info, torch.zeros(2, 8, dtype=torch.long))


def test_forward_backward_only_accumulates_and_optimizer_step_only_updates(tiny_config: TinyConfig) -> None:
    trainer = Trainer(tiny_config())
    batch = trainer.first_batch()
    before = [p.detach().clone() for p in trainer.model.parameters()]
    loss, sums = trainer.forward_backward(batch)
    assert loss.requires_grad is False and sums["count"] == 16 and sums["loss_sum"] == pytest.approx(16 * float(loss))
    assert all(torch.equal(p, b) for p, b in zip(trainer.model.parameters(), before, strict=True))
    first = [p.grad.clone() for p in trainer.model.parameters()]
    trainer.forward_backward(batch)  # gradients accumulate: twice the same batch, twice the gradient
    for p, g in zip(trainer.model.parameters(), first, strict=True):
        torch.testing.assert_close(p.grad, 2 * g, rtol=1e-5, atol=1e-7)  # float32 sum of two equal terms
    assert trainer.step == 0 and trainer.scheduler.last_epoch == 0
    trainer.optimizer_step()
    assert trainer.step == 1 and trainer.scheduler.last_epoch == 1
    assert any(not torch.equal(p, b) for p, b in zip(trainer.model.parameters(), before, strict=True))


def test_a_trainer_with_another_step_plugs_into_fit(tiny_config: TinyConfig) -> None:
    """Gradient accumulation over two half batches: a new train_step, the same loop."""

    class HalfBatches(Trainer):
        def train_step(self, batch: tuple[Tensor, Tensor]) -> tuple[float, dict[str, float]]:
            self.optimizer.zero_grad(set_to_none=True)
            x, y = batch
            half = x.shape[0] // 2
            total: dict[str, float] = {}
            for part in ((x[:half], y[:half]), (x[half:], y[half:])):
                loss, sums = self.forward_backward(part)
                tasks_module.add_sums(total, sums)
            self.optimizer_step()
            return total["loss_sum"] / total["count"], total

    trainer = HalfBatches(tiny_config(epochs=1))
    summary = trainer.fit()
    assert summary["steps"] == 3 and len(trainer.history) == 1
    assert trainer.history[0]["train_loss"] > 0 and 0 <= summary["test_acc"] <= 1


def test_task_classes_are_abstract() -> None:
    with pytest.raises(TypeError):
        Task()  # type: ignore[abstract]
