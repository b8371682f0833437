"""Small dataset files in their real formats, written by tests: an ImageFolder tree of PNG and JPEG
images, and downsampled-ImageNet npz batches."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from PIL import Image

COLOURS = {"cat": (200, 10, 10), "dog": (10, 200, 10), "owl": (10, 10, 200)}


def write_image(path: Path, colour: tuple[int, int, int], size: tuple[int, int] = (20, 12), fmt: str = "PNG") -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new("RGB", size, colour).save(path, format=fmt)


def make_image_folder(root: Path, per_class: int = 3) -> Path:
    """``root/{train,val}/<class>/`` with solid-colour images of each class's colour (PNG and JPEG,
    one in a nested folder), of several sizes."""
    for split in ("train", "val"):
        for name, colour in COLOURS.items():
            for i in range(per_class):
                fmt, ext = ("JPEG", "jpg") if i == 1 else ("PNG", "png")
                sub = "nested/" if i == 2 else ""
                write_image(root / split / name / f"{sub}{i}.{ext}", colour, size=(20 + 4 * i, 12 + i), fmt=fmt)
    (root / "train" / "cat" / "readme.txt").write_text("not an image: skipped by extension")
    return root


def write_npz_batch(path: Path, rng: np.random.Generator, n: int, side: int, mean: bool = True) -> tuple[np.ndarray, list[int]]:
    data = rng.integers(0, 256, (n, 3 * side * side), dtype=np.uint8)
    labels = [int(v) for v in rng.integers(1, 1001, n)]  # 1-based, a list as in the distributed files
    arrays = {"data": data, "labels": labels}
    if mean:
        arrays["mean"] = data.mean(axis=0)
    path.parent.mkdir(parents=True, exist_ok=True)
    np.savez(path, **arrays)
    return data, labels


def make_imagenet(root: Path, side: int = 32, per_batch: int = 5) -> tuple[np.ndarray, list[int]]:
    """The unpacked archives' layout: ``Imagenet<S>_train_npz/train_data_batch_{1,2,10}.npz`` and
    ``Imagenet<S>_val_npz/val_data.npz``; returns the training data in file order (1, 2, 10)."""
    rng = np.random.default_rng(0)
    parts = [write_npz_batch(root / f"Imagenet{side}_train_npz" / f"train_data_batch_{i}.npz", rng, per_batch, side)
             for i in (1, 2, 10)]
    write_npz_batch(root / f"Imagenet{side}_val_npz" / "val_data.npz", rng, per_batch, side, mean=False)
    return np.concatenate([d for d, _ in parts]), [label for _, ls in parts for label in ls]


