"""A PETRA training run: metrics, per-stage checkpoints, exact resume, and refusals before start."""

from __future__ import annotations

import json
import socket
from pathlib import Path

import pytest
import torch

from revtrain.parallel import PetraConfig, RunOptions, train
from revtrain.parallel.errors import PipelineConfigError
from revtrain.parallel.launch import check_port
from revtrain.parallel.runner import checked_split


def _options(run_dir: Path, **overrides: object) -> RunOptions:
    base: dict[str, object] = dict(model="revnet38", dataset="synthetic", image_size=8, batch_size=16, max_batches=3,
                                   stages=3, split="3,3,3", engine="simulator", epochs=2, warmup_epochs=0.5,
                                   run_dir=str(run_dir), quiet=True)
    base.update(overrides)
    return RunOptions(**base)  # type: ignore[arg-type]


def _weights(run_dir: Path, num_stages: int) -> dict[str, torch.Tensor]:
    manifest = json.loads((run_dir / "checkpoints" / "latest.json").read_text())
    out = {}
    for name in manifest["files"]:
        state = torch.load(run_dir / "checkpoints" / name, weights_only=False)["worker"]
        for unit, tensors in state["units"].items():
            out |= {f"{unit}.{k}": v for k, v in tensors.items()}
    return out


def test_a_run_writes_metrics_checkpoints_and_memory_and_resumes_exactly(tmp_path: Path) -> None:
    lines: list[str] = []
    summary = train(_options(tmp_path / "full"), PetraConfig(accumulation=2), log=lines.append)
    metrics = [json.loads(line) for line in (tmp_path / "full" / "metrics.jsonl").read_text().splitlines()]
    assert [m["epoch"] for m in metrics] == [1, 2]
    assert {"train_loss", "train_acc", "test_loss", "test_acc", "samples_per_s", "reconstruction_error"} <= set(metrics[0])
    assert metrics[-1]["updates"] == [4, 4, 4]  # 3 batches per epoch, k=2: 2 updates (one partial) per epoch
    assert [m["stage"] for m in summary["memory"]] == [0, 1, 2]
    assert all(m["param_bytes"] > 0 for m in summary["memory"])
    assert sorted(p.name for p in (tmp_path / "full" / "checkpoints").iterdir()) == [
        "latest.json", "stage0-epoch2.pt", "stage1-epoch2.pt", "stage2-epoch2.pt"]
    assert any(line.startswith("done: revnet38") for line in lines)

    class Crash(Exception):
        pass

    def crash_after_epoch_1(line: str) -> None:
        if line.startswith("epoch 1/2"):
            raise Crash  # the process dies right after epoch 1's checkpoint

    with pytest.raises(Crash):
        train(_options(tmp_path / "split", quiet=False), PetraConfig(accumulation=2), log=crash_after_epoch_1)
    train(_options(tmp_path / "split", resume=True), PetraConfig(accumulation=2), log=lambda _: None)
    full, resumed = _weights(tmp_path / "full", 3), _weights(tmp_path / "split", 3)
    assert full.keys() == resumed.keys()
    assert all(torch.equal(full[k], resumed[k]) for k in full)
    again = [json.loads(line) for line in (tmp_path / "split" / "metrics.jsonl").read_text().splitlines()]
    assert again[-1]["test_loss"] == metrics[-1]["test_loss"]


def test_bad_settings_fail_before_any_process_starts(tmp_path: Path) -> None:
    petra = PetraConfig()
    with pytest.raises(PipelineConfigError, match="10 stages for a model of 9 blocks"):
        checked_split(_options(tmp_path / "a", stages=10, split=None, engine="processes"), petra)
    with pytest.raises(PipelineConfigError, match="covers 5 blocks"):
        checked_split(_options(tmp_path / "b", stages=2, split="2,3", engine="processes"), petra)
    with pytest.raises(PipelineConfigError, match="'nccl' needs CUDA"):
        checked_split(_options(tmp_path / "c", backend="nccl", engine="processes"), petra)
    assert checked_split(_options(tmp_path / "d", stages=2, split=None, balance="count"), petra) == [5, 4]
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        with pytest.raises(PipelineConfigError, match=f"port {port} is in use"):
            check_port(port)
    assert not any((tmp_path / name).exists() for name in "abcd")  # nothing was started or written
    with pytest.raises(PipelineConfigError, match="stages must be an integer >= 1"):
        _options(tmp_path, stages=0)
    with pytest.raises(PipelineConfigError, match="resume needs --run-dir"):
        RunOptions(resume=True)
