"""The digits split: fixed, stratified, normalised with train statistics, optionally upsampled."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from revtrain.data import build_digits, load_digits_split


@pytest.fixture(scope="module")
def split8():
    return load_digits_split()


def test_split_is_deterministic(split8):
    again = load_digits_split()
    for a, b in zip(split8, again, strict=True):
        assert torch.equal(a, b)
    other = load_digits_split(split_seed=1)
    assert not torch.equal(split8[3], other[3])


def test_split_sizes_shapes_and_range(split8):
    train_x, train_y, test_x, test_y = split8
    assert train_x.shape == (1437, 1, 8, 8) and test_x.shape == (360, 1, 8, 8)
    assert train_x.dtype == torch.float32 and train_y.dtype == torch.int64
    assert float(train_x.min()) == 0.0 and float(train_x.max()) == 1.0
    assert set(train_y.tolist()) == set(test_y.tolist()) == set(range(10))


def test_split_is_stratified(split8):
    _, train_y, _, test_y = split8
    total = torch.bincount(torch.cat([train_y, test_y]), minlength=10).float()
    test = torch.bincount(test_y, minlength=10).float()
    # Every class holds out its 20% share, up to the rounding of one example.
    assert bool(((test - 0.2 * total).abs() <= 1.0).all())


def test_train_split_is_normalised_with_its_own_statistics():
    splits = build_digits()
    x, _ = splits.train.get_batch(torch.arange(len(splits.train)))
    assert abs(float(x.mean())) < 1e-5 and abs(float(x.std()) - 1) < 1e-4
    test_x, _ = splits.test.get_batch(torch.arange(len(splits.test)))
    assert abs(float(test_x.mean())) < 0.1  # same statistics, different images
    assert splits.info.mean == splits.train.transform.mean


def test_upscale_keeps_content():
    train16, _, _, _ = load_digits_split(image_size=16)
    train8, _, _, _ = load_digits_split()
    assert train16.shape == (1437, 1, 16, 16)
    assert float(train16.min()) >= 0.0 and float(train16.max()) <= 1.0
    # Same images in the same order, upsampled bilinearly from the [0, 1] originals.
    reference = torch.nn.functional.interpolate(train8, size=(16, 16), mode="bilinear", align_corners=False)
    torch.testing.assert_close(train16, reference)


def test_info():
    info = build_digits(image_size=16).info
    assert (info.in_channels, info.num_classes, info.image_size) == (1, 10, 16)
    assert (info.train_size, info.test_size) == (1437, 360)


def test_augmentation_is_off_by_default_and_shifts_by_one_pixel_when_on():
    plain = build_digits()
    assert not plain.train.transform.is_random
    aug = build_digits(augment=True, image_size=16)
    assert aug.train.transform.crop_padding == 2 and not aug.train.transform.hflip
    idx = torch.arange(256)
    shifted, _ = aug.train.get_batch(idx, torch.Generator().manual_seed(0))
    clean, _ = aug.train.with_transform(aug.train.transform.for_eval()).get_batch(idx)
    assert shifted.shape == clean.shape
    assert (shifted != clean).flatten(1).any(1).float().mean() > 0.8


def test_the_bundled_digits_and_split_equal_scikit_learns() -> None:
    pytest.importorskip("sklearn")  # in the dev extra: CI checks the bundle
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    from revtrain.data.digits import DEFAULT_SPLIT, bundled_digits

    raw, bundle = load_digits(), bundled_digits()
    assert np.array_equal(bundle["images"], raw.images) and np.array_equal(bundle["labels"], raw.target)
    train, test = train_test_split(np.arange(len(raw.target)), test_size=DEFAULT_SPLIT[1],
                                   random_state=DEFAULT_SPLIT[0], stratify=raw.target)
    assert np.array_equal(bundle["train_index"], train) and np.array_equal(bundle["test_index"], test)


def test_the_default_digits_need_no_scikit_learn() -> None:
    import subprocess
    import sys

    code = ("import sys; from revtrain.data import build_digits; s = build_digits(); "
            "assert 'sklearn' not in sys.modules, 'sklearn imported'; print(s.info.train_size, s.info.test_size)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True)
    assert out.stdout.split() == ["1437", "360"]
