"""CIFAR-10 and CIFAR-100 from the standard python batches in a local folder.

revtrain never downloads. Get the archives from https://www.cs.toronto.edu/~kriz/cifar.html
and extract them into one folder, the ``data_dir``::

    data_dir/cifar-10-batches-py/{data_batch_1..5, test_batch, batches.meta}
    data_dir/cifar-100-python/{train, test, meta}

(``data_dir`` may also point at the extracted folder itself.) Each file is a pickle of a dict
with bytes keys; ``b"data"`` is a uint8 array ``(N, 3072)`` holding the red, green and blue
32x32 planes of each image, row-major. Files are read with an unpickler that only rebuilds
numpy arrays, so a stray or hostile file fails with :class:`DatasetFormatError` instead of
running code.

Training augmentation is the standard one from the ResNet/RevNet papers: random 32x32 crop of
the image zero-padded by 4 pixels, random horizontal flip, then per-channel normalisation;
the test split is only normalised. Images stay uint8 in memory (150 MiB for the train split)
and are converted per batch.
"""

from __future__ import annotations

import importlib
import os
import pickle
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch

from revtrain.data.errors import DatasetFormatError, DatasetNotFoundError
from revtrain.data.loader import DatasetInfo, DatasetSplits, InMemoryDataset
from revtrain.data.transforms import BatchTransform

__all__ = [
    "CIFAR10_MEAN",
    "CIFAR10_STD",
    "CIFAR100_MEAN",
    "CIFAR100_STD",
    "CifarArrays",
    "default_data_dir",
    "load_cifar10",
    "load_cifar100",
    "build_cifar10",
    "build_cifar100",
]

# Per-channel statistics of the training images in [0, 1].
CIFAR10_MEAN = (0.4914, 0.4822, 0.4465)
CIFAR10_STD = (0.2470, 0.2435, 0.2616)
CIFAR100_MEAN = (0.5071, 0.4865, 0.4409)
CIFAR100_STD = (0.2673, 0.2564, 0.2762)

_PIXELS = 3 * 32 * 32


@dataclass(frozen=True)
class _Variant:
    title: str
    folder: str
    url: str
    train_files: tuple[str, ...]
    test_file: str
    meta_file: str


_CIFAR10 = _Variant(
    title="CIFAR-10",
    folder="cifar-10-batches-py",
    url="https://www.cs.toronto.edu/~kriz/cifar-10-python.tar.gz",
    train_files=tuple(f"data_batch_{i}" for i in range(1, 6)),
    test_file="test_batch",
    meta_file="batches.meta",
)
_CIFAR100 = _Variant(
    title="CIFAR-100",
    folder="cifar-100-python",
    url="https://www.cs.toronto.edu/~kriz/cifar-100-python.tar.gz",
    train_files=("train",),
    test_file="test",
    meta_file="meta",
)


@dataclass(frozen=True)
class CifarArrays:
    """Raw CIFAR splits: uint8 images ``(N, 3, 32, 32)``, int64 labels ``(N,)``, class names."""

    train_images: torch.Tensor
    train_labels: torch.Tensor
    test_images: torch.Tensor
    test_labels: torch.Tensor
    class_names: tuple[str, ...] | None
    folder: Path


def default_data_dir() -> Path:
    """``$REVTRAIN_DATA_DIR`` if set, else ``./data``: where datasets are looked for by default."""
    return Path(os.environ.get("REVTRAIN_DATA_DIR", "data"))


def _fix(variant: _Variant, data_dir: Path) -> str:
    return (
        f"download {variant.url} and extract it into {data_dir} "
        f"(`tar -xzf {variant.url.rsplit('/', 1)[-1]} -C {data_dir}` creates {data_dir / variant.folder})"
    )


def _find_folder(variant: _Variant, data_dir: Path) -> Path:
    """The folder holding the batches: ``data_dir/<archive folder>`` or ``data_dir`` itself."""
    needed = (*variant.train_files, variant.test_file)
    if not data_dir.is_dir():
        what = "is a file, not a folder" if data_dir.exists() else "does not exist"
        raise DatasetNotFoundError(
            f"{variant.title} data folder {data_dir} {what}; {_fix(variant, data_dir)}"
        )
    candidates = [data_dir / variant.folder, data_dir]
    present = {c: [name for name in needed if (c / name).is_file()] for c in candidates}
    for folder in candidates:
        if len(present[folder]) == len(needed):
            return folder
    best = max(candidates, key=lambda c: len(present[c]))
    if not present[best]:
        raise DatasetNotFoundError(
            f"no {variant.title} batches found: looked for {', '.join(needed)} in {candidates[0]} "
            f"and in {candidates[1]}; {_fix(variant, data_dir)}"
        )
    missing = [name for name in needed if name not in present[best]]
    raise DatasetNotFoundError(
        f"{variant.title} folder {best} is incomplete: missing {', '.join(missing)}; "
        f"{_fix(variant, data_dir)} again"
    )


_SAFE_GLOBALS = {
    ("_codecs", "encode"),
    ("numpy", "ndarray"),
    ("numpy", "dtype"),
    ("numpy.core.multiarray", "_reconstruct"),
    ("numpy.core.multiarray", "scalar"),
    ("numpy.core.numeric", "_frombuffer"),
}


class _ArrayUnpickler(pickle.Unpickler):
    """Unpickles plain containers and numpy arrays, nothing else."""

    def find_class(self, module: str, name: str) -> Any:
        public = module.replace("numpy._core", "numpy.core")
        if (public, name) not in _SAFE_GLOBALS:
            raise pickle.UnpicklingError(f"refusing to load {module}.{name}: not part of a CIFAR batch")
        if public.startswith("numpy.core"):
            # numpy >= 2 moved numpy.core to numpy._core; importing the old name warns.
            try:
                return getattr(importlib.import_module(public.replace("numpy.core", "numpy._core")), name)
            except ImportError:
                pass
        return getattr(importlib.import_module(public), name)


def _unpickle(path: Path, variant: _Variant, data_dir: Path) -> Any:
    try:
        with path.open("rb") as f:
            return _ArrayUnpickler(f, encoding="bytes").load()
    except (
        pickle.UnpicklingError,
        EOFError,
        ValueError,
        TypeError,
        AttributeError,
        IndexError,
        KeyError,
    ) as err:
        raise DatasetFormatError(
            f"{path} is not a {variant.title} python batch (unpickling failed: {err}); "
            f"{_fix(variant, data_dir)}, or point data_dir at the extracted folder"
        ) from err


def _read_batch(
    path: Path, label_key: bytes, num_classes: int, variant: _Variant, data_dir: Path
) -> tuple[torch.Tensor, torch.Tensor]:
    """Images ``(N, 3, 32, 32)`` uint8 and labels ``(N,)`` int64 from one batch file."""
    batch = _unpickle(path, variant, data_dir)

    def bad(problem: str) -> DatasetFormatError:
        return DatasetFormatError(
            f"{path} is not a valid {variant.title} batch: {problem}; expected a dict with "
            f"b'data' (uint8 array of shape (N, {_PIXELS})) and {label_key!r} (N ints in "
            f"[0, {num_classes})); {_fix(variant, data_dir)}"
        )

    if not isinstance(batch, dict):
        raise bad(f"it holds a {type(batch).__name__}, not a dict")
    missing = [k for k in (b"data", label_key) if k not in batch]
    if missing:
        found = ", ".join(repr(k) for k in list(batch)[:8])
        raise bad(f"keys {', '.join(repr(k) for k in missing)} missing (found: {found or 'none'})")
    data = batch[b"data"]
    if (
        not isinstance(data, np.ndarray)
        or data.dtype != np.uint8
        or data.ndim != 2
        or data.shape[1] != _PIXELS
    ):
        desc = (
            f"{data.dtype} array of shape {data.shape}"
            if isinstance(data, np.ndarray)
            else type(data).__name__
        )
        raise bad(f"b'data' is a {desc}")
    try:
        labels = np.asarray(batch[label_key], dtype=np.int64)
    except (TypeError, ValueError) as err:
        raise bad(f"{label_key!r} is not a list of ints ({err})") from err
    if labels.shape != (data.shape[0],):
        raise bad(f"{label_key!r} has shape {labels.shape} but there are {data.shape[0]} images")
    if labels.size and (labels.min() < 0 or labels.max() >= num_classes):
        raise bad(f"{label_key!r} has values in [{labels.min()}, {labels.max()}]")
    images = torch.from_numpy(np.ascontiguousarray(data)).view(-1, 3, 32, 32)  # (N, 3, 32, 32)
    return images, torch.from_numpy(labels)


def _read_names(path: Path, key: bytes, variant: _Variant, data_dir: Path) -> tuple[str, ...] | None:
    """Class names from the meta file; ``None`` when the file is absent (it is not needed to train)."""
    if not path.is_file():
        return None
    meta = _unpickle(path, variant, data_dir)
    names = meta.get(key) if isinstance(meta, dict) else None
    if not isinstance(names, list) or not all(isinstance(n, (bytes, str)) for n in names):
        raise DatasetFormatError(
            f"{path} is not a valid {variant.title} meta file: expected a dict with {key!r} "
            f"(a list of class names); {_fix(variant, data_dir)}"
        )
    return tuple(n.decode() if isinstance(n, bytes) else n for n in names)


def _load(
    variant: _Variant,
    data_dir: str | os.PathLike[str] | None,
    label_key: bytes,
    names_key: bytes,
    num_classes: int,
) -> CifarArrays:
    root = Path(data_dir) if data_dir is not None else default_data_dir()
    folder = _find_folder(variant, root)
    parts = [
        _read_batch(folder / name, label_key, num_classes, variant, root) for name in variant.train_files
    ]
    test_images, test_labels = _read_batch(folder / variant.test_file, label_key, num_classes, variant, root)
    names = _read_names(folder / variant.meta_file, names_key, variant, root)
    if names is not None and len(names) != num_classes:
        raise DatasetFormatError(
            f"{folder / variant.meta_file} lists {len(names)} class names, expected {num_classes}; "
            f"{_fix(variant, root)}"
        )
    return CifarArrays(
        train_images=torch.cat([p[0] for p in parts]),
        train_labels=torch.cat([p[1] for p in parts]),
        test_images=test_images,
        test_labels=test_labels,
        class_names=names,
        folder=folder,
    )


def load_cifar10(data_dir: str | os.PathLike[str] | None = None) -> CifarArrays:
    """Read CIFAR-10 (50,000 train / 10,000 test images, 10 classes).

    Args:
        data_dir: Folder containing ``cifar-10-batches-py/`` or the batches themselves;
            defaults to :func:`default_data_dir`.

    Raises:
        DatasetNotFoundError: The folder or one of the batch files is missing.
        DatasetFormatError: A file is not a CIFAR-10 python batch.
    """
    return _load(_CIFAR10, data_dir, b"labels", b"label_names", 10)


def load_cifar100(
    data_dir: str | os.PathLike[str] | None = None, *, labels: Literal["fine", "coarse"] = "fine"
) -> CifarArrays:
    """Read CIFAR-100 (50,000 train / 10,000 test images).

    Args:
        data_dir: Folder containing ``cifar-100-python/`` or its files; defaults to
            :func:`default_data_dir`.
        labels: ``"fine"`` for the 100 classes, ``"coarse"`` for the 20 superclasses.

    Raises:
        DatasetNotFoundError: The folder or one of the files is missing.
        DatasetFormatError: A file is not a CIFAR-100 python batch.
    """
    if labels not in ("fine", "coarse"):
        raise ValueError(f"labels must be 'fine' or 'coarse', got {labels!r}")
    num_classes = 100 if labels == "fine" else 20
    return _load(
        _CIFAR100, data_dir, f"{labels}_labels".encode(), f"{labels}_label_names".encode(), num_classes
    )


def _splits(
    name: str,
    arrays: CifarArrays,
    num_classes: int,
    mean: Sequence[float],
    std: Sequence[float],
    augment: bool,
) -> DatasetSplits:
    mean_t, std_t = tuple(mean), tuple(std)
    train_tf = BatchTransform(
        scale=1 / 255, mean=mean_t, std=std_t, train=augment, crop_padding=4 if augment else 0, hflip=augment
    )
    info = DatasetInfo(
        name=name,
        input_shape=(3, 32, 32),
        num_classes=num_classes,
        train_size=len(arrays.train_labels),
        test_size=len(arrays.test_labels),
        mean=mean_t,
        std=std_t,
        class_names=arrays.class_names,
    )
    return DatasetSplits(
        train=InMemoryDataset(arrays.train_images, arrays.train_labels, train_tf),
        test=InMemoryDataset(arrays.test_images, arrays.test_labels, train_tf.for_eval()),
        info=info,
    )


def build_cifar10(data_dir: str | os.PathLike[str] | None = None, *, augment: bool = True) -> DatasetSplits:
    """CIFAR-10 splits with the standard augmentation (crop 32 / pad 4, flip) when ``augment``."""
    return _splits("cifar10", load_cifar10(data_dir), 10, CIFAR10_MEAN, CIFAR10_STD, augment)


def build_cifar100(
    data_dir: str | os.PathLike[str] | None = None,
    *,
    augment: bool = True,
    labels: Literal["fine", "coarse"] = "fine",
) -> DatasetSplits:
    """CIFAR-100 splits (fine labels by default) with the standard augmentation when ``augment``."""
    arrays = load_cifar100(data_dir, labels=labels)
    return _splits("cifar100", arrays, 100 if labels == "fine" else 20, CIFAR100_MEAN, CIFAR100_STD, augment)
