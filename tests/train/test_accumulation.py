"""Gradient accumulation (``--accumulation k``): k micro-batches make one optimizer step."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from revtrain.train import Trainer
from revtrain.train.resume import ResumeConflictError, resolve_run
from tests.train.conftest import TinyConfig, assert_same_training_state, interrupt_at


@pytest.fixture
def float64() -> Iterator[None]:
    before = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(before)


def micro_batches(trainer: Trainer, k: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    loader = iter(trainer.train_loader)
    return [(x.double(), y) for x, y in (next(loader) for _ in range(k))]


def test_k_micro_batches_equal_one_batch_of_k_b_in_float64(tiny_config: TinyConfig, float64: None) -> None:
    """revvit_digits has layer norms only (no batch statistics): 4 micro-batches of 6 and one
    batch of 24 give the same loss and, after one SGD step with momentum, the same weights."""
    config = dict(model="revvit_digits", batch_size=6, weight_decay=1e-3)
    micro = Trainer(tiny_config("micro", accumulation=4, **config))
    whole = Trainer(tiny_config("whole", **config))
    parts = micro_batches(micro, 4)
    before = {k: v.clone() for k, v in micro.model.state_dict().items()}
    assert all(torch.equal(v, whole.model.state_dict()[k]) for k, v in before.items())
    for _ in range(2):  # the second step also checks the momentum buffers
        loss_a, sums_a = micro.train_step(*parts)
        loss_b, sums_b = whole.train_step((torch.cat([x for x, _ in parts]), torch.cat([y for _, y in parts])))
        assert loss_a == pytest.approx(loss_b, rel=1e-12)
        assert sums_a["count"] == sums_b["count"] == 24 and sums_a["correct"] == sums_b["correct"]
    for name, value in whole.model.state_dict().items():
        torch.testing.assert_close(micro.model.state_dict()[name], value, rtol=1e-10, atol=1e-13, msg=name)
    assert any(not torch.equal(before[k], v) for k, v in micro.model.state_dict().items())


def test_a_run_counts_optimizer_steps_and_updates_batch_norm_per_micro_batch(tiny_config: TinyConfig) -> None:
    """revnet38 on digits (batch-norm layers): with k = 2 and 3 steps an epoch the loader reads 6
    micro-batches an epoch, every batch norm counts 6 batches, and the schedule 3 steps."""
    trainer = Trainer(tiny_config(accumulation=2, epochs=1))
    norm = next(m for m in trainer.model.modules() if isinstance(m, torch.nn.BatchNorm2d))
    summary = trainer.fit()
    assert summary["steps"] == 3 and trainer.scheduler.last_epoch == 3
    assert int(norm.num_batches_tracked) == 6
    assert trainer.history[0]["samples_per_s"] > 0


def test_the_last_step_of_an_epoch_takes_the_micro_batches_left(tiny_config: TinyConfig) -> None:
    """digits: 1437 training samples in batches of 360 make 4 micro-batches (the last of 357);
    k = 3 gives 2 steps an epoch: 3 micro-batches, then 1."""
    trainer = Trainer(tiny_config(batch_size=360, accumulation=3, epochs=1, max_steps_per_epoch=None))
    assert (trainer.batches_per_epoch, trainer.steps_per_epoch) == (4, 2)
    seen: list[int] = []
    step = trainer.train_step
    trainer.train_step = lambda *batches: (seen.append(len(batches)), step(*batches))[1]  # type: ignore[method-assign]
    trainer.fit()
    assert seen == [3, 1] and trainer.step == 2


def test_an_interrupted_accumulating_run_resumes_exactly(tiny_config: TinyConfig) -> None:
    straight = Trainer(tiny_config("straight", accumulation=2))
    straight.fit()
    first = Trainer(tiny_config("split", accumulation=2), callbacks=[interrupt_at(4)])
    with pytest.raises(KeyboardInterrupt):
        first.fit()
    assert first.train_loader.next_batch == 2  # epoch 2 after one step of two micro-batches
    again = Trainer(tiny_config("split", accumulation=2, resume="auto"))
    again.fit()
    assert_same_training_state(straight, again)


def test_resume_refuses_another_accumulation(tiny_config: TinyConfig) -> None:
    Trainer(tiny_config(epochs=1)).fit()
    path = tiny_config().run_dir
    with pytest.raises(ResumeConflictError, match="accumulation"):
        resolve_run({"resume": path, "accumulation": 2})


@pytest.mark.parametrize("bad", [0, -1, 1.5, True])
def test_accumulation_must_be_a_positive_integer(tiny_config: TinyConfig, bad: object) -> None:
    with pytest.raises(ValueError, match="accumulation must be an integer >= 1"):
        tiny_config(accumulation=bad)
