"""Downsampled ImageNet (Chrabaszcz et al. 2017), the data PETRA trains on: ``--dataset imagenet32``/``imagenet64``.

The files as image-net.org distributes them: ``train_data_batch_1.npz`` ... ``train_data_batch_10.npz``
and ``val_data.npz``, each holding ``data`` (``N x 3*S*S`` uint8, the red plane, then green, then
blue, each row-major, as in CIFAR's python batches), ``labels`` (1 to 1000) and, in the training
batches, ``mean``. They are looked for anywhere under ``--data-dir`` (default ``$REVTRAIN_DATA_DIR``
or ``./data``), so both the unpacked archives' folders (``Imagenet32_train_npz/``,
``Imagenet32_val_npz/``) and one flat folder work.

The images stay uint8 in memory (ImageNet32: 3.9 GB, ImageNet64: 15.7 GB) and are normalised per
batch with the ImageNet mean and standard deviation; training augmentation (on by default) is
CIFAR's: random crop after zero padding of ``S // 8`` pixels and a horizontal flip. Labels are
shifted to 0..999.
"""

from __future__ import annotations

import math
import os
import re
import zipfile
from pathlib import Path

import numpy as np
import torch

from revtrain.data.cifar import default_data_dir
from revtrain.data.errors import DatasetFormatError, DatasetNotFoundError
from revtrain.data.imagefolder import IMAGENET_MEAN, IMAGENET_STD
from revtrain.data.loader import DatasetInfo, DatasetSplits, InMemoryDataset
from revtrain.data.transforms import BatchTransform

__all__ = ["build_downsampled_imagenet", "load_npz_batches"]

NUM_CLASSES = 1000
_TRAIN = re.compile(r"train_data_batch_(\d+)\.npz$")
_URL = "https://image-net.org/download-images.php (Downsampled ImageNet, npz format)"


def _find(root: Path, size: int) -> tuple[list[Path], Path]:
    if not root.is_dir():
        raise DatasetNotFoundError(f"ImageNet{size} folder {root} does not exist; download Imagenet{size}_train_npz "
                                   f"and Imagenet{size}_val_npz from {_URL}, unpack them there, or pass --data-dir")
    train = sorted((p for p in root.rglob("train_data_batch_*.npz") if _TRAIN.search(p.name)),
                   key=lambda p: int(_TRAIN.search(p.name).group(1)))  # type: ignore[union-attr]
    val = sorted(root.rglob("val_data.npz"))
    if not train or not val:
        missing = " and ".join(n for n, found in (("train_data_batch_<i>.npz", train), ("val_data.npz", val))
                               if not found)
        raise DatasetNotFoundError(f"no {missing} under {root}; download Imagenet{size}_train_npz and "
                                   f"Imagenet{size}_val_npz from {_URL} and unpack them under {root}")
    if len(val) > 1:
        raise DatasetFormatError(f"{len(val)} val_data.npz files under {root} ({', '.join(map(str, val))}); keep "
                                 "the one of this image size, or pass its folder as --data-dir")
    return train, val[0]


def load_npz_batches(paths: list[Path], size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Images ``(N, 3, S, S)`` uint8 and labels ``(N,)`` int64 in 0..999 from downsampled-ImageNet npz files.

    Raises:
        DatasetFormatError: a file is not such a batch, holds another image size, or labels out of range.
    """
    arrays: list[tuple[np.ndarray, np.ndarray]] = []
    for path in paths:
        try:
            with np.load(path, allow_pickle=False) as batch:
                data, labels = batch["data"], np.asarray(batch["labels"])
        except KeyError as err:
            raise DatasetFormatError(f"{path} is not a downsampled-ImageNet batch: it has no {err} array") from None
        except (OSError, ValueError, EOFError, zipfile.BadZipFile) as err:
            raise DatasetFormatError(f"cannot read {path} ({type(err).__name__}: {err}); the file is damaged or "
                                     "not an npz batch: download it again") from None
        side = math.isqrt(data.shape[1] // 3) if data.ndim == 2 else 0
        if data.ndim != 2 or data.dtype != np.uint8 or 3 * side * side != data.shape[1]:
            raise DatasetFormatError(f"{path}: data is {data.dtype} {data.shape}, expected uint8 N x 3*S*S images")
        if side != size:
            raise DatasetFormatError(f"{path} holds {side}x{side} images, not {size}x{size}; use "
                                     f"--dataset imagenet{side}, or point --data-dir at the ImageNet{size} files")
        if labels.shape != (data.shape[0],) or labels.min(initial=1) < 1 or labels.max(initial=1) > NUM_CLASSES:
            raise DatasetFormatError(f"{path}: labels must be {data.shape[0]} class numbers in 1..{NUM_CLASSES}, "
                                     f"got shape {labels.shape}, range {labels.min(initial=0)}..{labels.max(initial=0)}")
        arrays.append((data, labels))
    total = sum(d.shape[0] for d, _ in arrays)
    images = torch.empty((total, 3, size, size), dtype=torch.uint8)  # filled in place: no second copy
    targets = torch.empty(total, dtype=torch.int64)
    start = 0
    for data, labels in arrays:
        n = data.shape[0]
        images[start:start + n] = torch.from_numpy(data.reshape(n, 3, size, size))
        targets[start:start + n] = torch.from_numpy(labels.astype(np.int64) - 1)
        start += n
    return images, targets


def build_downsampled_imagenet(size: int, data_dir: str | os.PathLike[str] | None = None, *,
                               augment: bool | None = None) -> DatasetSplits:
    """Train and validation splits of ImageNet at ``size`` x ``size`` (see the module docstring)."""
    root = Path(data_dir).expanduser() if data_dir is not None else default_data_dir()
    train_files, val_file = _find(root, size)
    train_x, train_y = load_npz_batches(train_files, size)
    val_x, val_y = load_npz_batches([val_file], size)
    augment = True if augment is None else augment
    train_tf = BatchTransform(scale=1 / 255, mean=IMAGENET_MEAN, std=IMAGENET_STD, train=augment,
                              crop_padding=max(1, size // 8) if augment else 0, hflip=augment)
    info = DatasetInfo(name=f"imagenet{size}", input_shape=(3, size, size), num_classes=NUM_CLASSES,
                       train_size=len(train_y), test_size=len(val_y), mean=IMAGENET_MEAN, std=IMAGENET_STD)
    return DatasetSplits(train=InMemoryDataset(train_x, train_y, train_tf),
                         test=InMemoryDataset(val_x, val_y, train_tf.for_eval()), info=info)
