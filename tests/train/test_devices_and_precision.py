"""``--device cuda:N`` everywhere and ``--amp bf16`` on the CPU (issue 24 §7)."""

from __future__ import annotations

import io
import math
from pathlib import Path

import pytest
import torch

from revtrain.cli import main
from revtrain.train import ConfigError, TrainConfig, Trainer

from .conftest import make_tiny_config


# bf16's 8-bit mantissa makes M-mode rebuilds drift past the float32 tolerance; the core says so
# (ReconstructionDriftWarning), as it does for bf16 on CUDA.
@pytest.mark.filterwarnings("ignore::revtrain.errors.ReconstructionDriftWarning")
def test_bf16_autocast_trains_on_the_cpu(tmp_path: Path) -> None:
    trainer = Trainer(make_tiny_config(tmp_path / "run", amp="bf16", epochs=1), out=io.StringIO())
    dtypes: list[torch.dtype] = []
    first_conv = next(m for m in trainer.model.modules() if isinstance(m, torch.nn.Conv2d))
    first_conv.register_forward_hook(lambda module, args, out: dtypes.append(out.dtype))
    summary = trainer.fit()
    assert trainer.device.type == "cpu"
    assert dtypes and set(dtypes) == {torch.bfloat16}  # every forward ran under bf16 autocast
    assert all(p.dtype == torch.float32 for p in trainer.model.parameters())  # weights stay float32
    assert math.isfinite(summary["train_loss"]) and summary["test_acc"] is not None
    assert "amp bf16" in trainer._header()


@pytest.mark.parametrize("device", ["cuda:0", "cuda:1", "cuda", "cpu", "auto"])
def test_device_names_are_accepted(device: str) -> None:
    assert TrainConfig(device=device).device == device


@pytest.mark.parametrize("device", ["gpu", "cuda:x", "cuda:-1", "cuda1"])
def test_bad_device_names_say_the_choices(device: str) -> None:
    with pytest.raises(ConfigError, match="device must be auto, cpu, cuda or cuda:N"):
        TrainConfig(device=device)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message shown without CUDA")
def test_cuda_index_without_cuda_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["train", "--device", "cuda:1", "--run-dir", str(tmp_path / "r")]) == 2
    assert "--device cuda:1 was asked for but CUDA is not available" in capsys.readouterr().err


def test_a_gpu_index_with_several_processes_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["train", "--stages", "2", "--device", "cuda:1", "--run-dir", str(tmp_path / "r")]) == 2
    assert "each process of --stages/--data-parallel takes the GPU of its local rank" in capsys.readouterr().err


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_train_on_the_last_gpu_by_index(tmp_path: Path) -> None:
    index = torch.cuda.device_count() - 1
    trainer = Trainer(make_tiny_config(tmp_path / "run", device=f"cuda:{index}", epochs=1, amp="bf16"),
                      out=io.StringIO())
    trainer.fit()
    assert trainer.device == torch.device("cuda", index)
    assert all(p.device == torch.device("cuda", index) for p in trainer.model.parameters())
    with pytest.raises(ConfigError, match=f"has {torch.cuda.device_count()} GPU"):
        Trainer(make_tiny_config(tmp_path / "bad", device=f"cuda:{index + 1}"), out=io.StringIO())
