"""Checkpoints: atomic writes, and clear errors for corrupt or incompatible files."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import revtrain.train.checkpoint as checkpoint_module
from revtrain.models import create_model
from revtrain.train import (
    CorruptCheckpointError,
    DiskFullError,
    IncompatibleCheckpointError,
    Trainer,
    load_checkpoint,
    save_checkpoint,
)
from revtrain.train.checkpoint import (
    CHECKPOINT_VERSION,
    capture_rng_state,
    check_model_state,
    restore_rng_state,
)

from .conftest import TinyConfig


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The checkpoint of a tiny one-epoch run (module-scoped: the tests only read it)."""
    from .conftest import make_tiny_config

    config = make_tiny_config(tmp_path_factory.mktemp("trained"), epochs=1)
    Trainer(config).fit()
    return Path(config.run_dir) / "checkpoint.pt"


def test_failed_save_leaves_previous_checkpoint_intact(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "checkpoint.pt"
    save_checkpoint({"step": 1, "weights": torch.arange(1000.0)}, path)
    real_save = torch.save

    def save_half_then_fail(obj: Any, f: Any, *args: Any, **kwargs: Any) -> None:
        real_save(obj, f, *args, **kwargs)
        f.seek(f.tell() // 2)
        f.truncate()  # the bytes written so far are a torn file
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(checkpoint_module.torch, "save", save_half_then_fail)
    with pytest.raises(DiskFullError, match=f"no space left on device while writing checkpoint {path}.*"
                                            f"the previous checkpoint {path} is kept unchanged"):
        save_checkpoint({"step": 2, "weights": torch.zeros(1000)}, path)
    monkeypatch.undo()
    state = load_checkpoint(path)
    assert state["step"] == 1 and torch.equal(state["weights"], torch.arange(1000.0))
    assert [p.name for p in tmp_path.iterdir()] == ["checkpoint.pt"]  # no temp file left behind


def test_interrupt_during_save_leaves_previous_checkpoint_intact(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "checkpoint.pt"
    save_checkpoint({"step": 1}, path)

    def interrupted(obj: Any, f: Any, *args: Any, **kwargs: Any) -> None:
        f.write(b"PK\x03\x04 partial")
        raise KeyboardInterrupt

    monkeypatch.setattr(checkpoint_module.torch, "save", interrupted)
    with pytest.raises(KeyboardInterrupt):
        save_checkpoint({"step": 2}, path)
    monkeypatch.undo()
    assert load_checkpoint(path)["step"] == 1
    assert len(list(tmp_path.iterdir())) == 1


def test_truncated_checkpoint_names_the_problem(trained: Path, tmp_path: Path) -> None:
    data = trained.read_bytes()
    cut = tmp_path / "cut.pt"
    cut.write_bytes(data[: len(data) // 2])
    with pytest.raises(CorruptCheckpointError, match="truncated, corrupt or not a torch.save file") as info:
        load_checkpoint(cut)
    assert str(cut) in str(info.value) and "start a fresh run without --resume" in str(info.value)


@pytest.mark.parametrize("content", [b"", b"not a checkpoint at all\n" * 50])
def test_garbage_checkpoint_names_the_problem(tmp_path: Path, content: bytes) -> None:
    path = tmp_path / "garbage.pt"
    path.write_bytes(content)
    with pytest.raises(CorruptCheckpointError, match="cannot read checkpoint .*garbage.pt"):
        load_checkpoint(path)


def test_missing_checkpoint_suggests_auto(tmp_path: Path) -> None:
    with pytest.raises(CorruptCheckpointError, match="does not exist.*--resume auto"):
        load_checkpoint(tmp_path / "nope.pt")


def test_other_torch_file_is_not_a_training_checkpoint(tmp_path: Path) -> None:
    path = tmp_path / "weights.pt"
    torch.save(create_model("revnet38").state_dict(), path)
    with pytest.raises(IncompatibleCheckpointError, match="not a revtrain training checkpoint"):
        load_checkpoint(path)


def test_other_format_version_is_refused(trained: Path, tmp_path: Path) -> None:
    state = torch.load(trained, weights_only=True)
    state["version"] = CHECKPOINT_VERSION + 1
    path = tmp_path / "future.pt"
    torch.save(state, path)
    expected = f"format version {CHECKPOINT_VERSION + 1}.*reads version"
    with pytest.raises(IncompatibleCheckpointError, match=expected):
        load_checkpoint(path)


def test_checkpoint_of_another_model_is_refused(trained: Path, tiny_config: TinyConfig) -> None:
    expected = "cannot resume .* with --model resnet32 \\(the run used 'revnet38': .*Drop --model"
    with pytest.raises(IncompatibleCheckpointError, match=expected):
        Trainer(tiny_config(model="resnet32", resume=str(trained)))


def test_shape_mismatch_lists_the_parameters(trained: Path) -> None:
    state = load_checkpoint(trained)
    other = create_model("revnet38", num_classes=7, in_channels=1)
    expected = r"head\.fc\.weight is \(10, 112\) in the checkpoint but \(7, 112\) in the model"
    with pytest.raises(IncompatibleCheckpointError, match=expected):
        check_model_state(trained, state, "revnet38", other)


def test_checkpoint_from_other_batch_size_is_refused(trained: Path, tiny_config: TinyConfig) -> None:
    with pytest.raises(IncompatibleCheckpointError, match="--batch-size 32 \\(the run used 16: the data order"):
        Trainer(tiny_config(batch_size=32, resume=str(trained)))


def test_checkpoint_loads_without_running_code(trained: Path) -> None:
    state = torch.load(trained, weights_only=True)  # raises if anything but plain data is inside
    needed = {"model", "optimizer", "scheduler", "rng", "train_loader", "progress", "config", "version", "sha256"}
    assert needed <= set(state)


def test_rng_states_round_trip() -> None:
    state = capture_rng_state()
    first = (random.random(), np.random.rand(), torch.rand(3))
    restore_rng_state(state)
    again = (random.random(), np.random.rand(), torch.rand(3))
    assert first[:2] == again[:2] and torch.equal(first[2], again[2])
