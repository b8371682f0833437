"""Synthetic data: any shape, seeded, balanced, learnable."""

from __future__ import annotations

import pytest
import torch

from revtrain.data import build_synthetic, make_synthetic


@pytest.mark.parametrize("shape", [(3, 8, 8), (16,), (2, 4, 5, 6)])
def test_shapes_and_balance(shape):
    x, y = make_synthetic(103, shape, 4, seed=1)
    assert x.shape == (103, *shape) and x.dtype == torch.float32 and y.dtype == torch.int64
    counts = torch.bincount(y, minlength=4)
    assert int(counts.max() - counts.min()) <= 1


def test_seeded():
    a = make_synthetic(20, (5,), 3, seed=7)
    b = make_synthetic(20, (5,), 3, seed=7)
    c = make_synthetic(20, (5,), 3, seed=8)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    assert not torch.equal(a[0], c[0])


def test_splits_share_prototypes_so_the_task_is_learnable():
    splits = build_synthetic(input_shape=(32,), num_classes=5, train_size=200, test_size=100, noise=1.0)
    train_x, train_y = splits.train.inputs, splits.train.targets
    test_x, test_y = splits.test.inputs, splits.test.targets
    assert not torch.equal(train_x[:100], test_x)
    means = torch.stack([train_x[train_y == c].mean(0) for c in range(5)])
    predicted = torch.cdist(test_x, means).argmin(1)
    assert float((predicted == test_y).float().mean()) > 0.9
    assert splits.info.input_shape == (32,) and splits.info.image_size is None


def test_rejects_bad_arguments():
    with pytest.raises(ValueError, match="input_shape"):
        make_synthetic(4, (), 2)
    with pytest.raises(ValueError, match="num_classes"):
        make_synthetic(4, (3,), 0)



@pytest.mark.parametrize("options", [dict(num_classes=0), dict(image_size=0), dict(train_size=0)])
def test_a_zero_is_refused_not_replaced_by_the_default(options: dict) -> None:
    from revtrain.data import build_dataloaders

    with pytest.raises(ValueError, match=">= 1|positive"):
        build_dataloaders("synthetic", batch_size=2, **options)
