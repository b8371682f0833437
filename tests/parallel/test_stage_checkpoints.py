"""PETRA's per-stage checkpoints are revtrain checkpoints: checksummed, refused when damaged or not finite."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from revtrain.parallel import checkpoint as ckpt
from revtrain.train.checkpoint import CorruptCheckpointError, NonFiniteCheckpointError


def _stage_state(value: float = 1.0) -> dict:
    return {"worker": {"stage_index": 0, "units": {"0.weight": torch.full((64, 64), value)},
                       "optimizer": {"state": {}, "param_groups": []}, "scheduler": None, "updates": 3, "pending": 0}}


def test_a_stage_file_round_trips(tmp_path: Path) -> None:
    ckpt.save_stage(tmp_path, 0, 2, _stage_state())
    ckpt.save_stage(tmp_path, 0, 4, _stage_state(2.0))
    state = ckpt.load_stage(tmp_path, 0, 2)
    assert state["step"] == 2 and state["worker"]["updates"] == 3
    assert torch.equal(state["worker"]["units"]["0.weight"], torch.ones(64, 64))
    ckpt.prune(tmp_path, 0, 4)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["stage0-step4.pt"]


def test_flipped_bytes_inside_a_tensor_are_refused_by_the_checksum(tmp_path: Path) -> None:
    path = ckpt.save_stage(tmp_path, 0, 1, _stage_state())
    data = bytearray(path.read_bytes())
    ones = torch.ones(64, dtype=torch.float32).numpy().tobytes()
    at = data.find(ones)  # inside the stored weight
    assert at > 0
    data[at + 1 : at + 65] = bytes(b ^ 0xFF for b in data[at + 1 : at + 65])
    path.write_bytes(bytes(data))
    with pytest.raises(CorruptCheckpointError, match="fails its checksum"):
        ckpt.load_stage(tmp_path, 0, 1)


def test_a_stage_saved_with_nan_weights_is_refused(tmp_path: Path) -> None:
    ckpt.save_stage(tmp_path, 0, 1, _stage_state(math.nan))
    with pytest.raises(NonFiniteCheckpointError, match="NaN or infinite weights .*0.weight"):
        ckpt.load_stage(tmp_path, 0, 1)
