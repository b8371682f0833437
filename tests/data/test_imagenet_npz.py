"""``--dataset imagenet32/64``: downsampled ImageNet npz batches in their real format, written by the tests."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from revtrain.data import DatasetFormatError, DatasetNotFoundError, build_dataloaders
from revtrain.data.imagenet_npz import load_npz_batches
from tests.data_files import make_imagenet, write_npz_batch


def test_images_planes_and_labels(tmp_path: Path) -> None:
    data, labels = make_imagenet(tmp_path)
    _, test, info = build_dataloaders("imagenet32", data_dir=tmp_path, batch_size=4, augment=False)
    assert info.name == "imagenet32" and info.input_shape == (3, 32, 32) and info.num_classes == 1000
    assert (info.train_size, info.test_size) == (15, 5)
    x, y = load_npz_batches(sorted((tmp_path / "Imagenet32_train_npz").glob("*.npz"),
                                   key=lambda p: int(p.stem.rsplit("_", 1)[1])), 32)
    assert y.tolist() == [label - 1 for label in labels]
    # Red plane first, row-major: pixel (row 2, col 5) of image 7's green channel is data[7, 1024 + 2*32 + 5].
    assert x[7, 1, 2, 5] == data[7, 1024 + 2 * 32 + 5] and x[7, 0, 31, 31] == data[7, 1023]
    assert torch.equal(x.reshape(15, -1), torch.from_numpy(data))
    xb, yb = next(iter(test))
    assert xb.shape == (4, 3, 32, 32) and xb.dtype == torch.float32 and yb.max() < 1000


def test_a_flat_folder_of_imagenet64_works(tmp_path: Path) -> None:
    rng = np.random.default_rng(1)
    write_npz_batch(tmp_path / "train_data_batch_1.npz", rng, 3, 64)
    write_npz_batch(tmp_path / "val_data.npz", rng, 2, 64, mean=False)
    train, _, info = build_dataloaders("imagenet64", data_dir=tmp_path, batch_size=2)
    assert info.input_shape == (3, 64, 64) and next(iter(train))[0].shape == (2, 3, 64, 64)


def test_wrong_size_missing_files_and_bad_labels_are_explained(tmp_path: Path) -> None:
    make_imagenet(tmp_path / "i64", side=64, per_batch=2)
    with pytest.raises(DatasetFormatError, match="holds 64x64 images, not 32x32; use --dataset imagenet64"):
        build_dataloaders("imagenet32", data_dir=tmp_path / "i64", batch_size=2)
    (tmp_path / "empty").mkdir()
    with pytest.raises(DatasetNotFoundError, match="no train_data_batch_<i>.npz and val_data.npz under"):
        build_dataloaders("imagenet32", data_dir=tmp_path / "empty", batch_size=2)
    bad = tmp_path / "bad" / "train_data_batch_1.npz"
    bad.parent.mkdir()
    np.savez(bad, data=np.zeros((2, 3072), np.uint8), labels=[0, 1001])
    with pytest.raises(DatasetFormatError, match="labels must be 2 class numbers in 1..1000"):
        load_npz_batches([bad], 32)
    cut = tmp_path / "cut.npz"
    cut.write_bytes(bad.read_bytes()[:100])
    with pytest.raises(DatasetFormatError, match=f"cannot read {cut}"):
        load_npz_batches([cut], 32)
