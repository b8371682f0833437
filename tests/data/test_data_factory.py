"""build_dataloaders: every dataset name, its info, and argument checks."""

from __future__ import annotations

import pytest
import torch

from revtrain.data import DATASETS, DatasetNotFoundError, build_dataloaders


def test_digits_default():
    train, test, info = build_dataloaders(batch_size=100)
    assert info.name == "digits" and (info.in_channels, info.num_classes, info.image_size) == (1, 10, 8)
    x, y = next(iter(train))
    assert x.shape == (100, 1, 8, 8) and y.shape == (100,)
    assert sum(len(y) for _, y in test) == info.test_size == 360
    assert train.shuffle and not test.shuffle


def test_digits_upscaled_with_eval_batch_size():
    _, test, info = build_dataloaders("digits", batch_size=32, eval_batch_size=400, image_size=16)
    assert info.input_shape == (1, 16, 16)
    ((x, _),) = list(test)
    assert x.shape == (360, 1, 16, 16)


def test_cifar_names(make_cifar10, make_cifar100):
    root10 = make_cifar10()
    train, test, info = build_dataloaders("cifar10", batch_size=4, data_dir=root10)
    assert (info.in_channels, info.num_classes, info.image_size) == (3, 10, 32)
    assert (info.train_size, info.test_size) == (30, 6) and len(train) == 8
    assert train.dataset.transform.is_random and not test.dataset.transform.is_random
    _, _, info100 = build_dataloaders("cifar100", batch_size=4, data_dir=make_cifar100())
    assert info100.num_classes == 100
    with pytest.raises(ValueError, match="32x32"):
        build_dataloaders("cifar10", batch_size=4, data_dir=root10, image_size=64)


def test_cifar_default_data_dir_comes_from_environment(make_cifar10, monkeypatch, tmp_path):
    monkeypatch.setenv("REVTRAIN_DATA_DIR", str(make_cifar10()))
    assert build_dataloaders("cifar10", batch_size=4)[2].train_size == 30
    monkeypatch.setenv("REVTRAIN_DATA_DIR", str(tmp_path / "empty"))
    with pytest.raises(DatasetNotFoundError, match=r"cifar-10-python\.tar\.gz"):
        build_dataloaders("cifar10", batch_size=4)


def test_synthetic_shapes():
    train, test, info = build_dataloaders(
        "synthetic", batch_size=10, input_shape=(4, 6, 6), num_classes=3, train_size=30, test_size=12, seed=2
    )
    assert (info.in_channels, info.num_classes, info.image_size) == (4, 3, 6)
    assert [len(y) for _, y in train] == [10, 10, 10]
    x, _ = next(iter(test))
    assert x.shape == (10, 4, 6, 6)
    rebuilt, _, _ = build_dataloaders(
        "synthetic", batch_size=10, input_shape=(4, 6, 6), num_classes=3, train_size=30, test_size=12, seed=2
    )
    train.set_epoch(0)  # it was iterated above
    for (xa, ya), (xb, yb) in zip(train, rebuilt, strict=True):
        assert torch.equal(xa, xb) and torch.equal(ya, yb)


def test_info_is_plain_data():
    info = build_dataloaders("synthetic", batch_size=8, image_size=8)[2]
    d = info.to_dict()
    assert d["in_channels"] == 3 and d["image_size"] == 8 and d["input_shape"] == (3, 8, 8)


def test_bad_arguments_are_explained():
    with pytest.raises(ValueError, match="unknown dataset 'mnist'; choose one of digits"):
        build_dataloaders("mnist", batch_size=8)
    with pytest.raises(ValueError, match="num_classes only applies to the 'synthetic' dataset, not 'digits'"):
        build_dataloaders("digits", batch_size=8, num_classes=3)
    with pytest.raises(ValueError, match="num_classes, train_size only apply to the 'synthetic' dataset"):
        build_dataloaders("digits", batch_size=8, num_classes=3, train_size=4)
    with pytest.raises(ValueError, match="no augmentation"):
        build_dataloaders("synthetic", batch_size=8, augment=True)
    assert DATASETS[0] == "digits"
