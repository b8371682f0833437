"""A tiny training run: RevNet-38 on 8x8 digits, batches of 16, 3 steps per epoch, on the CPU."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from revtrain.train import TrainConfig, Trainer

TinyConfig = Callable[..., TrainConfig]


@pytest.fixture(autouse=True, scope="module")
def one_thread() -> Any:
    """Train on one thread: on a busy 2-core machine OpenMP's spinning threads make two ~10x slower."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


TEXT = "the quick brown fox jumps over the lazy dog. " * 200
"""A small corpus for the language-model runs."""


@pytest.fixture
def corpus(tmp_path: Path) -> Path:
    """A text folder holding :data:`TEXT` in one file."""
    folder = tmp_path / "corpus"
    folder.mkdir()
    (folder / "a.txt").write_text(TEXT)
    return folder


def make_tiny_config(run_dir: Path, **overrides: Any) -> TrainConfig:
    """The tiny run, writing to ``run_dir``; 6 steps and 2 evaluations, about a second."""
    options: dict[str, Any] = dict(
        model="revnet38", dataset="digits", image_size=8, batch_size=16, eval_batch_size=360,
        epochs=2, max_steps_per_epoch=3, warmup_epochs=0.5, device="cpu", quiet=True,
        memory_report=False, run_dir=str(run_dir),
    )
    options.update(overrides)
    return TrainConfig(**options)


@pytest.fixture
def tiny_config(tmp_path: Path) -> TinyConfig:
    """``tiny_config(name, **overrides)``: the tiny run writing to ``tmp_path/name``."""
    return lambda name="run", **overrides: make_tiny_config(tmp_path / name, **overrides)


def interrupt_at(step: int, exc: type[BaseException] = KeyboardInterrupt) -> Callable[[Trainer], None]:
    """A callback that raises ``exc`` once the trainer has finished optimizer step ``step``."""

    def callback(trainer: Trainer) -> None:
        if trainer.step == step:
            raise exc(f"simulated at step {step}")

    return callback


def assert_same_training_state(a: Trainer, b: Trainer) -> None:
    """Parameters, buffers and optimizer state bit-identical (torch.equal), and same counters."""
    sa, sb = a.model.state_dict(), b.model.state_dict()
    assert sa.keys() == sb.keys()
    for key in sa:
        assert torch.equal(sa[key], sb[key]), f"{key} differs"
    oa, ob = a.optimizer.state_dict(), b.optimizer.state_dict()
    assert oa["state"].keys() == ob["state"].keys() and oa["state"]
    for index in oa["state"]:
        assert torch.equal(oa["state"][index]["momentum_buffer"], ob["state"][index]["momentum_buffer"])
    assert [g["lr"] for g in oa["param_groups"]] == [g["lr"] for g in ob["param_groups"]]
    assert a.step == b.step
    assert a.train_loader.state_dict() == b.train_loader.state_dict()
