"""Datasets and deterministic, resumable loaders.

One call builds everything a training run needs::

    train_loader, test_loader, info = build_dataloaders("digits", batch_size=128, image_size=16)
    model = create_model("revnet38", in_channels=info.in_channels, num_classes=info.num_classes)

Datasets are registered by name (:mod:`revtrain.data.registry`: ``register_dataset``,
``list_datasets``): ``"digits"`` (scikit-learn's handwritten digits, bundled, offline, the
default), ``"cifar10"`` and ``"cifar100"`` (python batches in a local folder), ``"synthetic"``
(seeded random data of any shape), ``"text"`` (bytes of local text files, by default the Python
standard library's sources; see :mod:`revtrain.data.text`), ``"imagefolder"`` (your images in
``train/<class>/`` and ``val/<class>/``), ``"imagenet32"`` and ``"imagenet64"`` (downsampled
ImageNet's npz batches, PETRA's data). The loaders are :class:`ResumableLoader`: batch ``b``
of epoch ``e`` depends only on ``(seed, e, b)``, and ``state_dict()`` / ``load_state_dict()``
restore the exact position after a checkpoint; see :mod:`revtrain.data.loader` for the trainer loop.
"""

from __future__ import annotations

import os

from revtrain.data.cifar import (
    CifarArrays,
    build_cifar10,
    build_cifar100,
    default_data_dir,
    load_cifar10,
    load_cifar100,
)
from revtrain.data.digits import build_digits, load_digits_split
from revtrain.data.errors import DatasetError, DatasetFormatError, DatasetNotFoundError
from revtrain.data.loader import DatasetInfo, DatasetSplits, InMemoryDataset, ResumableLoader, derive_seed
from revtrain.data.synthetic import build_synthetic, make_synthetic
from revtrain.data.text import ByteWindows, build_text, load_corpus
from revtrain.data.transforms import BatchTransform
from revtrain.data.imagefolder import ImageFileDataset, build_image_folder, scan_image_folder
from revtrain.data.imagenet_npz import build_downsampled_imagenet
from revtrain.data.registry import build_registered, dataset_entry, list_datasets, register_dataset
from revtrain.data import builtin as _builtin  # noqa: F401  (registers the shipped datasets)

__all__ = [
    "DATASETS",
    "build_dataloaders",
    "build_datasets",
    "BatchTransform",
    "ByteWindows",
    "CifarArrays",
    "DatasetError",
    "DatasetFormatError",
    "DatasetInfo",
    "DatasetNotFoundError",
    "DatasetSplits",
    "ImageFileDataset",
    "InMemoryDataset",
    "ResumableLoader",
    "build_cifar10",
    "build_cifar100",
    "build_digits",
    "build_downsampled_imagenet",
    "build_image_folder",
    "dataset_entry",
    "list_datasets",
    "register_dataset",
    "scan_image_folder",
    "build_synthetic",
    "build_text",
    "default_data_dir",
    "derive_seed",
    "load_cifar10",
    "load_cifar100",
    "load_corpus",
    "load_digits_split",
    "make_synthetic",
]

DATASETS = tuple(list_datasets())
"""The datasets revtrain ships (:func:`list_datasets` also lists those registered later)."""


def build_datasets(
    name: str = "digits",
    *,
    data_dir: str | os.PathLike[str] | None = None,
    augment: bool | None = None,
    image_size: int | None = None,
    input_shape: tuple[int, ...] | None = None,
    num_classes: int | None = None,
    train_size: int | None = None,
    test_size: int | None = None,
    seed: int = 0,
    context: int | None = None,
) -> DatasetSplits:
    """Build the train and test splits of a registered dataset by name; arguments as in
    :func:`build_dataloaders`. Options left as None take the dataset's defaults; an option the
    dataset does not take is refused by name (:mod:`revtrain.data.registry`)."""
    given = dict(data_dir=data_dir, augment=augment, image_size=image_size, input_shape=input_shape,
                 num_classes=num_classes, train_size=train_size, test_size=test_size, context=context)
    return build_registered(name, given, seed)


def build_dataloaders(
    name: str = "digits",
    *,
    batch_size: int = 128,
    eval_batch_size: int | None = None,
    data_dir: str | os.PathLike[str] | None = None,
    num_workers: int = 0,
    seed: int = 0,
    augment: bool | None = None,
    image_size: int | None = None,
    drop_last: bool = False,
    pin_memory: bool = False,
    input_shape: tuple[int, ...] | None = None,
    num_classes: int | None = None,
    train_size: int | None = None,
    test_size: int | None = None,
    context: int | None = None,
) -> tuple[ResumableLoader, ResumableLoader, DatasetInfo]:
    """Build the train and test loaders of a dataset.

    Args:
        name: A registered dataset (:func:`list_datasets`).
        batch_size: Training batch size.
        eval_batch_size: Test batch size; defaults to ``batch_size``.
        data_dir: Folder holding the CIFAR archives' extracted folders; defaults to
            ``$REVTRAIN_DATA_DIR`` or ``./data``. Text: a file or folder of text files
            (default: the Python standard library's sources). Unused by digits and synthetic.
        num_workers: Worker processes per loader; 0 builds batches in the calling process.
        seed: Seeds the training order and augmentation (and the synthetic data). The digits
            train/test split is fixed and does not depend on it.
        augment: Training augmentation; ``None`` takes the dataset's default (CIFAR: crop and
            flip on; digits: off, ``True`` turns on one-pixel shifts; synthetic: none; text: random
            window offsets, on).
        image_size: Side of the images: digits are upsampled to it (default 8); CIFAR only
            accepts 32; synthetic uses ``(3, image_size, image_size)``.
        drop_last: Drop the last, smaller training batch.
        pin_memory: Pin batches in page-locked memory (useful with a GPU).
        input_shape: Synthetic only: shape of one example (default ``(3, 32, 32)``).
        num_classes: Synthetic only: number of classes (default 10).
        train_size: Synthetic only: training examples (default 1024).
        test_size: Synthetic only: test examples (default 256).
        context: Text only: tokens per sample, the model's sequence length (default 128).

    Returns:
        ``(train_loader, test_loader, info)``. The train loader shuffles and augments; the test
        loader serves the test split in stored order without augmentation.

    Raises:
        DatasetNotFoundError: A CIFAR folder or file is missing (the message says how to get it).
        DatasetFormatError: A CIFAR file is malformed.
        ValueError: Unknown name or an option that does not apply to the dataset.
    """
    splits = build_datasets(
        name,
        data_dir=data_dir,
        augment=augment,
        image_size=image_size,
        input_shape=input_shape,
        num_classes=num_classes,
        train_size=train_size,
        test_size=test_size,
        seed=seed,
        context=context,
    )
    train = ResumableLoader(
        splits.train,
        batch_size=batch_size,
        shuffle=True,
        seed=seed,
        drop_last=drop_last,
        num_workers=num_workers,
        pin_memory=pin_memory,
    )
    test = ResumableLoader(
        splits.test,
        batch_size=eval_batch_size or batch_size,
        shuffle=False,
        seed=seed,
        num_workers=num_workers,
        pin_memory=pin_memory,
    )
    return train, test, splits.info
