"""The handwritten digits scikit-learn ships: the default dataset, bundled, available offline.

1,797 grey images of 8x8 pixels with values 0..16, ten classes (the test set of the UCI
"Optical Recognition of Handwritten Digits" data, E. Alpaydin and C. Kaynak, 1998, CC BY 4.0, as
``sklearn.datasets.load_digits`` gives it). They are stored in ``digits.npz`` beside this file
(48 KB) with the default split, so the main job needs no scikit-learn; another split
(``split_seed``, ``test_fraction``) is computed by scikit-learn, which must then be installed.
revtrain splits them once,
stratified, 80/20 with a fixed seed (``split_seed``, independent of the training seed, so that
every run is evaluated on the same test images), scales them to [0, 1], optionally upsamples
them (RevNet/ResNet stages downsample twice, which leaves 2x2 maps from 8x8 inputs), and
normalises them with the mean and standard deviation of the training split.

Augmentation is off by default: the images are centred and size-normalised already, and the
test accuracy of small models is ~97-99% without it. With ``augment=True`` each training
image is shifted by up to one original pixel in each direction (a random crop after zero
padding of ``image_size // 8`` pixels); there is no flip, since mirrored digits are not digits.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from revtrain.data.loader import DatasetInfo, DatasetSplits, InMemoryDataset
from revtrain.data.transforms import BatchTransform

__all__ = ["DEFAULT_SPLIT", "DIGITS_NATIVE_SIZE", "build_digits", "bundled_digits", "load_digits_split"]

DIGITS_NATIVE_SIZE = 8
"""Side of the images as scikit-learn ships them."""
DEFAULT_SPLIT = (0, 0.2)
"""``(split_seed, test_fraction)`` of the split stored with the data."""
_BUNDLE = Path(__file__).with_name("digits.npz")
_MAX_PIXEL = 16.0


def load_digits_split(
    *, split_seed: int = 0, test_fraction: float = 0.2, image_size: int = DIGITS_NATIVE_SIZE
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The stratified split of the digits, scaled to [0, 1], before normalisation.

    Args:
        split_seed: Seed of the train/test split. Keep the default to compare runs.
        test_fraction: Share of each class that goes to the test split.
        image_size: Side of the returned images; sizes other than 8 are made by bilinear
            interpolation (``align_corners=False``) of the [0, 1] images.

    Returns:
        ``(train_x, train_y, test_x, test_y)``: float32 images ``(N, 1, S, S)`` and int64 labels ``(N,)``.
    """
    if not 0.0 < test_fraction < 1.0:
        raise ValueError(f"test_fraction must be in (0, 1), got {test_fraction}")
    if image_size < 1:
        raise ValueError(f"image_size must be >= 1, got {image_size}")
    bundle = bundled_digits()
    images = torch.as_tensor(bundle["images"], dtype=torch.float32) / _MAX_PIXEL  # (N, 8, 8)
    labels = torch.as_tensor(bundle["labels"], dtype=torch.int64)
    if (split_seed, test_fraction) == DEFAULT_SPLIT:
        train_idx, test_idx = bundle["train_index"].astype(np.int64), bundle["test_index"].astype(np.int64)
    else:
        train_idx, test_idx = _stratified_split(len(labels), labels.numpy(), test_fraction, split_seed)
    x = images[:, None]  # (N, 1, 8, 8)
    if image_size != DIGITS_NATIVE_SIZE:
        x = F.interpolate(x, size=(image_size, image_size), mode="bilinear", align_corners=False)
    train_i, test_i = torch.as_tensor(train_idx), torch.as_tensor(test_idx)
    return x[train_i].contiguous(), labels[train_i], x[test_i].contiguous(), labels[test_i]


def bundled_digits() -> dict[str, np.ndarray]:
    """The stored digits: ``images`` (1797, 8, 8) uint8 in 0..16, ``labels`` (1797,), and the default
    split's ``train_index`` and ``test_index`` in the order scikit-learn's ``train_test_split`` gives them."""
    with np.load(_BUNDLE) as data:
        return {name: data[name] for name in ("images", "labels", "train_index", "test_index")}


def _stratified_split(n: int, labels: np.ndarray, test_fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    try:
        from sklearn.model_selection import train_test_split
    except ImportError:
        raise ImportError(f"a digits split other than the bundled one (split_seed={DEFAULT_SPLIT[0]}, "
                          f"test_fraction={DEFAULT_SPLIT[1]}) is computed by scikit-learn: pip install "
                          "scikit-learn") from None
    train_idx, test_idx = train_test_split(np.arange(n), test_size=test_fraction, random_state=seed, stratify=labels)
    return train_idx, test_idx


def build_digits(
    *,
    image_size: int = DIGITS_NATIVE_SIZE,
    augment: bool = False,
    split_seed: int = 0,
    test_fraction: float = 0.2,
) -> DatasetSplits:
    """Train and test splits of the digits, ready for :class:`~revtrain.data.loader.ResumableLoader`.

    Args:
        image_size: Side of the images the model sees (8 native; 16 or 32 for deep nets).
        augment: Random shifts of up to one original pixel on the training split.
        split_seed: Seed of the fixed train/test split (not the training seed).
        test_fraction: Share of each class held out for testing.
    """
    train_x, train_y, test_x, test_y = load_digits_split(
        split_seed=split_seed, test_fraction=test_fraction, image_size=image_size
    )
    mean, std = train_x.mean().item(), train_x.std().item()
    padding = max(1, image_size // DIGITS_NATIVE_SIZE) if augment else 0
    train_tf = BatchTransform(mean=(mean,), std=(std,), train=augment, crop_padding=padding)
    info = DatasetInfo(
        name="digits",
        input_shape=(1, image_size, image_size),
        num_classes=10,
        train_size=len(train_y),
        test_size=len(test_y),
        mean=(mean,),
        std=(std,),
        class_names=tuple(str(d) for d in range(10)),
    )
    return DatasetSplits(
        train=InMemoryDataset(train_x, train_y, train_tf),
        test=InMemoryDataset(test_x, test_y, train_tf.for_eval()),
        info=info,
    )
