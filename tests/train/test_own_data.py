"""`revtrain train` on a user's image folder and on downsampled ImageNet, from the command line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from revtrain.cli import main
from tests.data_files import make_image_folder, make_imagenet


def test_train_on_an_image_folder_with_workers(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    root = make_image_folder(tmp_path / "pics")
    run = tmp_path / "run"
    assert main(["train", "--dataset", "imagefolder", "--data-dir", str(root), "--image-size", "8",
                 "--batch-size", "4", "--epochs", "1", "--num-workers", "1", "--device", "cpu", "--quiet",
                 "--no-memory-report", "--run-dir", str(run)]) == 0
    summary = json.loads((run / "summary.json").read_text())
    assert summary["dataset"] == "imagefolder" and summary["steps"] == 3  # 9 images in batches of 4
    assert json.loads((run / "config.json").read_text())["num_workers"] == 1
    state = torch.load(run / "checkpoint.pt", weights_only=True)
    assert tuple(state["data"]["class_names"]) == ("cat", "dog", "owl") and state["data"]["num_classes"] == 3


def test_train_on_imagenet32_npz(tmp_path: Path) -> None:
    make_imagenet(tmp_path / "data")
    run = tmp_path / "run"
    assert main(["train", "--dataset", "imagenet32", "--data-dir", str(tmp_path / "data"), "--batch-size", "8",
                 "--epochs", "1", "--device", "cpu", "--quiet", "--no-memory-report", "--run-dir", str(run)]) == 0
    assert json.loads((run / "summary.json").read_text())["steps"] == 2


def test_the_example_image_folder_trains_as_the_readme_says(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """README: `python examples/digits_as_images.py pics` then `revtrain train --dataset imagefolder
    --data-dir pics --image-size 16 --epochs 2` (here with fewer steps)."""
    import runpy

    root = Path(__file__).parents[2]
    module = runpy.run_path(str(root / "examples" / "digits_as_images.py"))
    pics = module["write_digits_as_images"](tmp_path / "pics")
    assert len(list((pics / "train").rglob("*.png"))) == 1437 and len(list((pics / "val").rglob("*.png"))) == 360
    assert sorted(p.name for p in (pics / "train").iterdir()) == [str(d) for d in range(10)]
    run = tmp_path / "run"
    assert main(["train", "--dataset", "imagefolder", "--data-dir", str(pics), "--image-size", "16", "--epochs", "1",
                 "--max-steps-per-epoch", "2", "--device", "cpu", "--quiet", "--no-memory-report",
                 "--run-dir", str(run)]) == 0
    summary = json.loads((run / "summary.json").read_text())
    assert summary["dataset"] == "imagefolder" and summary["steps"] == 2
