"""Your own images: ``--dataset imagefolder --data-dir D`` with ``D/train/<class>/*`` and ``D/val/<class>/*``.

The layout and its meaning are torchvision's ``ImageFolder``: classes are the sorted names of the
sub-folders, a class's images are the files under its folder (searched recursively, sorted) with
an image extension. Where torchvision imports, its ``ImageFolder`` finds the files; where it does
not (no torchvision, or a torchvision built for another torch), a reader with the same layout and
order does, so the same folder gives the same classes and the same samples either way.

Images are decoded per batch (in ``--num-workers`` worker processes when given), converted to
RGB, resized so that the shorter side is ``image_size`` and centre-cropped to a square, then
normalised with the ImageNet mean and standard deviation. Training augmentation (on by default):
a random crop after zero padding of ``image_size // 8`` pixels and a horizontal flip, drawn from
the loader's seeded generator, so a batch is a pure function of ``(seed, epoch, batch)`` as for
every revtrain dataset. Every file is decoded once when the dataset is built, as the reader
decodes it (JPEGs at 1/8 scale, which still decodes all of their compressed data), so an
unreadable, truncated or corrupt image is reported before training starts, by name.
"""

from __future__ import annotations

import os
from functools import cache
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

from revtrain.data.errors import DatasetFormatError, DatasetNotFoundError
from revtrain.data.loader import DatasetInfo, DatasetSplits
from revtrain.data.transforms import BatchTransform

if TYPE_CHECKING:
    from PIL.Image import Image as PILImage

__all__ = ["IMAGENET_MEAN", "IMAGENET_STD", "IMG_EXTENSIONS", "ImageFileDataset", "build_image_folder",
           "scan_image_folder"]

IMG_EXTENSIONS = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp")
"""File extensions counted as images (torchvision's ``IMG_EXTENSIONS``)."""
IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
DEFAULT_IMAGE_SIZE = 32


@cache
def _torchvision_image_folder() -> type | None:
    """torchvision's ``ImageFolder``, or None where torchvision does not import with this torch."""
    try:
        from torchvision.datasets import ImageFolder
    except Exception:  # ImportError, or RuntimeError from a torchvision built for another torch
        return None
    return ImageFolder


def scan_image_folder(root: str | os.PathLike[str]) -> tuple[list[str], list[tuple[str, int]]]:
    """The classes of an image folder and its ``(path, class index)`` samples, as ``ImageFolder`` finds them.

    Raises:
        DatasetNotFoundError: ``root`` is missing or holds no class folder.
        DatasetFormatError: a class folder holds no image.
    """
    root = Path(root)
    if not root.is_dir():
        raise DatasetNotFoundError(f"image folder {root} does not exist; it should hold one sub-folder of "
                                   "images per class")
    classes = sorted(e.name for e in os.scandir(root) if e.is_dir())
    if not classes:
        raise DatasetNotFoundError(f"image folder {root} holds no class folder; put each class's images in "
                                   f"{root}/<class>/")
    per_class = {c: _images_of(root / c) for c in classes}
    empty = [c for c, files in per_class.items() if not files]
    if empty:
        raise DatasetFormatError(
            f"class folder(s) {', '.join(str(root / c) for c in empty[:5])} hold no image (extensions "
            f"{' '.join(IMG_EXTENSIONS)}); add images or remove the empty folder(s)"
        )
    image_folder = _torchvision_image_folder()
    if image_folder is not None:
        found = image_folder(str(root))
        return list(found.classes), [(str(p), int(i)) for p, i in found.samples]
    return classes, [(str(p), i) for i, c in enumerate(classes) for p in per_class[c]]


def _images_of(folder: Path) -> list[Path]:
    found = []
    for dirpath, _, names in sorted(os.walk(folder, followlinks=True)):
        found += [Path(dirpath) / n for n in sorted(names) if n.lower().endswith(IMG_EXTENSIONS)]
    return found


class ImageFileDataset:
    """Image files decoded per batch; the interface of :class:`~revtrain.data.loader.InMemoryDataset`.

    Args:
        samples: ``(path, class index)`` pairs.
        image_size: Side of the square images the model sees.
        transform: Applied to each batch of uint8 images ``(B, 3, S, S)``.
    """

    def __init__(self, samples: list[tuple[str, int]], image_size: int, transform: BatchTransform) -> None:
        self.paths = [p for p, _ in samples]
        self.targets = torch.tensor([i for _, i in samples], dtype=torch.int64)
        self.image_size = image_size
        self.transform = transform

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = self.get_batch(torch.tensor([index]))
        return x[0], y[0]

    def get_batch(self, indices: torch.Tensor, generator: torch.Generator | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor]:
        """Decode, resize and transform the images at ``indices``; returns ``(inputs, targets)``."""
        images = torch.stack([self.decode(self.paths[int(i)]) for i in indices])  # (B, 3, S, S) uint8
        return self.transform(images, generator), self.targets[indices]

    def decode(self, path: str) -> torch.Tensor:
        """One image as uint8 ``(3, S, S)``: RGB, shorter side resized to S, centre crop."""
        from PIL import Image

        try:
            rgb = _read_rgb(path)
        except _read_errors() as err:
            raise DatasetFormatError(f"cannot read image {path} ({type(err).__name__}: {err}); replace or "
                                     "remove the file") from None
        s = self.image_size
        w, h = rgb.size
        scale = s / min(w, h)
        size = (max(s, round(w * scale)), max(s, round(h * scale)))
        rgb = rgb.resize(size, Image.Resampling.BILINEAR)
        left, top = (size[0] - s) // 2, (size[1] - s) // 2
        rgb = rgb.crop((left, top, left + s, top + s))
        return torch.from_numpy(np.asarray(rgb, dtype=np.uint8).copy()).permute(2, 0, 1)

    def with_transform(self, transform: BatchTransform) -> ImageFileDataset:
        out = ImageFileDataset([], self.image_size, transform)
        out.paths, out.targets = self.paths, self.targets
        return out


def _read_errors() -> tuple[type[Exception], ...]:
    """What PIL raises for a file it cannot decode (a missing, truncated or corrupt file, an image
    of more than twice ``Image.MAX_IMAGE_PIXELS``)."""
    from PIL import Image

    return OSError, ValueError, SyntaxError, Image.DecompressionBombError


def _read_rgb(path: str, *, reduced: bool = False) -> PILImage:
    """The image at ``path`` decoded to RGB: what :meth:`ImageFileDataset.decode` reads.

    ``reduced`` decodes a JPEG at 1/8 scale (PIL's ``draft``): the entropy-coded data is still
    read and decoded to its end, so a truncated or corrupt JPEG fails as it does at full scale,
    for less than a full decode of a photo.
    """
    from PIL import Image

    with Image.open(path) as image:
        if reduced and image.format == "JPEG":
            image.draft(None, (1, 1))
        return image.convert("RGB")


def _check_readable(samples: list[tuple[str, int]]) -> None:
    """Refuse, by name, the files that training would fail to read.

    Every file is decoded once, as the reader decodes it (:func:`_read_rgb`; JPEGs at reduced
    scale), since opening a file reads only its header, which a truncated file still has, and
    PIL's ``verify()`` checks PNG chunks but nothing of a JPEG's data. Costs one epoch's
    decoding at most, in every process that builds the dataset.
    """
    errors = _read_errors()
    bad = []
    for path, _ in samples:
        try:
            _read_rgb(path, reduced=True)
        except errors:
            bad.append(path)
    if bad:
        shown = ", ".join(bad[:5]) + (f" and {len(bad) - 5} more" if len(bad) > 5 else "")
        raise DatasetFormatError(f"{len(bad)} file(s) with an image extension are not readable images: {shown}; "
                                 "replace or remove them")


def build_image_folder(data_dir: str | os.PathLike[str] | None = None, *, image_size: int | None = None,
                       augment: bool | None = None) -> DatasetSplits:
    """Train and test splits of ``data_dir/train`` and ``data_dir/val`` (see the module docstring).

    Raises:
        DatasetNotFoundError: no ``data_dir``, or it lacks ``train/`` or ``val/``.
        DatasetFormatError: an empty class folder, an unreadable image, or classes that differ
            between ``train/`` and ``val/``.
    """
    if data_dir is None:
        raise DatasetNotFoundError("--dataset imagefolder needs --data-dir D, a folder holding train/<class>/ "
                                   "and val/<class>/ image folders")
    root = Path(data_dir).expanduser()
    missing = [name for name in ("train", "val") if not (root / name).is_dir()]
    if missing:
        raise DatasetNotFoundError(
            f"image folder dataset {root} has no {' or '.join(m + '/' for m in missing)} folder; it needs "
            f"{root}/train/<class>/... and {root}/val/<class>/... (the ImageFolder layout)"
        )
    train_classes, train = scan_image_folder(root / "train")
    val_classes, val = scan_image_folder(root / "val")
    if train_classes != val_classes:
        only_train = sorted(set(train_classes) - set(val_classes))
        only_val = sorted(set(val_classes) - set(train_classes))
        parts = [f"only in train/: {', '.join(only_train)}" if only_train else "",
                 f"only in val/: {', '.join(only_val)}" if only_val else ""]
        raise DatasetFormatError(f"{root}: train/ and val/ hold different classes ({'; '.join(p for p in parts if p)}); "
                                 "give both splits the same class folders")
    _check_readable(train + val)
    size = image_size or DEFAULT_IMAGE_SIZE
    augment = True if augment is None else augment
    train_tf = BatchTransform(scale=1 / 255, mean=IMAGENET_MEAN, std=IMAGENET_STD, train=augment,
                              crop_padding=max(1, size // 8) if augment else 0, hflip=augment)
    info = DatasetInfo(name="imagefolder", input_shape=(3, size, size), num_classes=len(train_classes),
                       train_size=len(train), test_size=len(val), mean=IMAGENET_MEAN, std=IMAGENET_STD,
                       class_names=tuple(train_classes))
    return DatasetSplits(train=ImageFileDataset(train, size, train_tf),  # type: ignore[arg-type]
                         test=ImageFileDataset(val, size, train_tf.for_eval()),  # type: ignore[arg-type]
                         info=info)
