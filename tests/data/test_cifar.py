"""CIFAR-10/100 readers against files written in the official python-batch format."""

from __future__ import annotations

import pickle
from pathlib import Path

import numpy as np
import pytest
import torch

from revtrain.data import (
    DatasetError,
    DatasetFormatError,
    DatasetNotFoundError,
    build_cifar10,
    build_cifar100,
    load_cifar10,
    load_cifar100,
)
from revtrain.data.cifar import CIFAR10_MEAN, CIFAR10_STD

URL10 = "https://www.cs.toronto.edu/~kriz/cifar-10-python.tar.gz"
PER_BATCH = 6


def write_batch(path: Path, content: object) -> None:
    with path.open("wb") as f:
        pickle.dump(content, f, protocol=2)


def _raw(path: Path) -> dict:
    with path.open("rb") as f:
        return pickle.load(f, encoding="bytes")


def test_cifar10_reads_every_batch_with_pixel_layout(make_cifar10):
    root = make_cifar10(per_batch=PER_BATCH)
    arrays = load_cifar10(root)
    assert arrays.train_images.shape == (5 * PER_BATCH, 3, 32, 32)
    assert arrays.train_images.dtype == torch.uint8
    assert arrays.test_images.shape == (PER_BATCH, 3, 32, 32)
    assert arrays.class_names is not None and arrays.class_names[0] == "airplane"
    # Batch 2, image 1: red plane is the first 1024 bytes row-major, blue the last 1024.
    raw = _raw(root / "cifar-10-batches-py" / "data_batch_2")
    img = arrays.train_images[PER_BATCH + 1]
    np.testing.assert_array_equal(img[0].numpy(), raw[b"data"][1, :1024].reshape(32, 32))
    np.testing.assert_array_equal(img[2].numpy(), raw[b"data"][1, 2048:].reshape(32, 32))
    assert arrays.train_labels[PER_BATCH + 1].item() == raw[b"labels"][1]
    assert arrays.train_labels.dtype == torch.int64


def test_cifar10_accepts_the_extracted_folder_itself(make_cifar10, tmp_path):
    root = make_cifar10(tmp_path / "flat", subfolder=False)
    assert load_cifar10(root).folder == root


def test_cifar100_fine_and_coarse_labels(make_cifar100):
    root = make_cifar100()
    fine = load_cifar100(root)
    coarse = load_cifar100(root, labels="coarse")
    raw = _raw(root / "cifar-100-python" / "train")
    assert fine.train_labels.tolist() == raw[b"fine_labels"]
    assert coarse.train_labels.tolist() == raw[b"coarse_labels"]
    assert len(fine.class_names or ()) == 100 and len(coarse.class_names or ()) == 20
    splits = build_cifar100(root)
    assert splits.info.num_classes == 100 and splits.info.train_size == 12 and splits.info.test_size == 6


def test_test_split_is_only_normalised(make_cifar10):
    splits = build_cifar10(make_cifar10())
    idx = torch.arange(4)
    x, y = splits.test.get_batch(idx)
    mean = torch.tensor(CIFAR10_MEAN).view(1, 3, 1, 1)
    std = torch.tensor(CIFAR10_STD).view(1, 3, 1, 1)
    expected = (splits.test.inputs[idx].float() / 255 - mean) / std
    torch.testing.assert_close(x, expected)
    torch.testing.assert_close(splits.test.get_batch(idx)[0], x)  # no randomness
    assert torch.equal(y, splits.test.targets[idx])


def test_train_augmentation_changes_images_but_keeps_shapes(make_cifar10):
    splits = build_cifar10(make_cifar10())
    idx = torch.arange(len(splits.train))
    plain, _ = splits.train.with_transform(splits.train.transform.for_eval()).get_batch(idx)
    gen = torch.Generator().manual_seed(0)
    augmented, _ = splits.train.get_batch(idx, gen)
    assert augmented.shape == plain.shape == (len(idx), 3, 32, 32)
    changed = (augmented != plain).flatten(1).any(1)
    assert changed.float().mean() > 0.8  # 1/81 * 1/2 chance per image to stay put
    no_aug, _ = build_cifar10(make_cifar10(), augment=False).train.get_batch(idx, gen)
    torch.testing.assert_close(no_aug, plain)


# ----------------------------------------------------------------------- errors


def test_missing_folder_names_folder_and_download(tmp_path):
    missing = tmp_path / "nowhere"
    with pytest.raises(DatasetNotFoundError) as info:
        load_cifar10(missing)
    msg = str(info.value)
    assert str(missing) in msg and "does not exist" in msg
    assert URL10 in msg and f"extract it into {missing}" in msg
    assert isinstance(info.value, DatasetError) and isinstance(info.value, FileNotFoundError)


def test_empty_folder_lists_where_it_looked(tmp_path):
    with pytest.raises(DatasetNotFoundError) as info:
        load_cifar100(tmp_path)
    msg = str(info.value)
    assert "no CIFAR-100 batches found" in msg
    assert str(tmp_path / "cifar-100-python") in msg
    assert "cifar-100-python.tar.gz" in msg


def test_missing_file_is_named(make_cifar10):
    root = make_cifar10()
    (root / "cifar-10-batches-py" / "data_batch_3").unlink()
    with pytest.raises(DatasetNotFoundError) as info:
        load_cifar10(root)
    msg = str(info.value)
    assert "missing data_batch_3" in msg and "data_batch_1" not in msg.split("missing")[1].split(";")[0]
    assert URL10 in msg


def test_meta_file_is_optional(make_cifar10):
    root = make_cifar10()
    (root / "cifar-10-batches-py" / "batches.meta").unlink()
    assert load_cifar10(root).class_names is None


def _corrupt(root: Path, name: str, content: object = None, raw_bytes: bytes | None = None) -> Path:
    path = root / "cifar-10-batches-py" / name
    if raw_bytes is not None:
        path.write_bytes(raw_bytes)
    else:
        write_batch(path, content)  # type: ignore[arg-type]
    return path


@pytest.mark.parametrize(
    ("content", "raw_bytes", "expected"),
    [
        (None, b"this is not a pickle at all", "unpickling failed"),
        (None, b"", "unpickling failed"),
        ([1, 2, 3], None, "holds a list, not a dict"),
        ({b"pixels": np.zeros((2, 3072), np.uint8), b"labels": [0, 1]}, None, "b'data' missing"),
        ({b"data": np.zeros((2, 3072), np.uint8)}, None, "b'labels' missing"),
        ({b"data": np.zeros((2, 32, 32, 3), np.uint8), b"labels": [0, 1]}, None, "shape (2, 32, 32, 3)"),
        ({b"data": np.zeros((2, 3072), np.float32), b"labels": [0, 1]}, None, "float32 array"),
        ({b"data": np.zeros((2, 3072), np.uint8), b"labels": [0]}, None, "there are 2 images"),
        ({b"data": np.zeros((2, 3072), np.uint8), b"labels": [0, 10]}, None, "values in [0, 10]"),
        (
            {"data": np.zeros((2, 3072), np.uint8), "labels": [0, 1]},
            None,
            "missing (found: 'data', 'labels')",
        ),
    ],
)
def test_malformed_batch_says_what_is_wrong(make_cifar10, content, raw_bytes, expected):
    root = make_cifar10()
    path = _corrupt(root, "data_batch_4", content, raw_bytes)
    with pytest.raises(DatasetFormatError) as info:
        load_cifar10(root)
    msg = str(info.value)
    assert expected in msg
    assert str(path) in msg and URL10 in msg
    assert isinstance(info.value, DatasetError) and isinstance(info.value, ValueError)


class _Exploit:
    def __reduce__(self):
        return (Path.touch, (Path(self.target),))  # type: ignore[attr-defined]


def test_pickle_with_foreign_objects_is_refused_not_run(make_cifar10, tmp_path):
    root = make_cifar10()
    marker = tmp_path / "pwned"
    exploit = _Exploit()
    exploit.target = str(marker)  # type: ignore[attr-defined]
    _corrupt(root, "test_batch", {b"data": exploit, b"labels": []})
    with pytest.raises(DatasetFormatError, match="refusing to load"):
        load_cifar10(root)
    assert not marker.exists()


def test_malformed_meta(make_cifar10):
    root = make_cifar10()
    _corrupt(root, "batches.meta", {b"names": []})
    with pytest.raises(DatasetFormatError, match="label_names"):
        load_cifar10(root)
