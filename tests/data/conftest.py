"""Fixtures that write CIFAR folders in the exact format of the official python archives."""

from __future__ import annotations

import pickle
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest


def write_batch(path: Path, batch: dict[bytes, object], protocol: int = 2) -> None:
    with path.open("wb") as f:
        pickle.dump(batch, f, protocol=protocol)


def cifar10_batch(rng: np.random.Generator, n: int, name: str) -> dict[bytes, object]:
    return {
        b"batch_label": f"{name} of 5".encode(),
        b"labels": [int(v) for v in rng.integers(0, 10, n)],  # a list of ints, as in the archive
        b"data": rng.integers(0, 256, (n, 3072), dtype=np.uint8),
        b"filenames": [f"img_{i}.png".encode() for i in range(n)],
    }


@pytest.fixture
def make_cifar10(tmp_path: Path) -> Callable[..., Path]:
    """Write ``<root>/cifar-10-batches-py/`` (``per_batch`` images per file) and return ``root``."""

    def make(root: Path | None = None, *, subfolder: bool = True, per_batch: int = 6, seed: int = 0) -> Path:
        root = root or tmp_path / "data"
        folder = root / "cifar-10-batches-py" if subfolder else root
        folder.mkdir(parents=True, exist_ok=True)
        rng = np.random.default_rng(seed)
        for i in range(1, 6):
            write_batch(folder / f"data_batch_{i}", cifar10_batch(rng, per_batch, f"training batch {i}"))
        write_batch(folder / "test_batch", cifar10_batch(rng, per_batch, "testing batch 1"))
        names = [
            b"airplane",
            b"automobile",
            b"bird",
            b"cat",
            b"deer",
            b"dog",
            b"frog",
            b"horse",
            b"ship",
            b"truck",
        ]
        meta = {b"num_cases_per_batch": per_batch, b"label_names": names, b"num_vis": 3072}
        write_batch(folder / "batches.meta", meta)
        return root

    return make


@pytest.fixture
def make_cifar100(tmp_path: Path) -> Callable[..., Path]:
    """Write ``<root>/cifar-100-python/{train,test,meta}`` and return ``root``."""

    def make(root: Path | None = None, *, n_train: int = 12, n_test: int = 6) -> Path:
        root = root or tmp_path / "data"
        folder = root / "cifar-100-python"
        folder.mkdir(parents=True, exist_ok=True)
        rng = np.random.default_rng(1)
        for name, n in (("train", n_train), ("test", n_test)):
            fine = rng.integers(0, 100, n)
            batch = {
                b"filenames": [f"x_{i}.png".encode() for i in range(n)],
                b"batch_label": f"{name}ing batch 1 of 1".encode(),
                b"fine_labels": [int(v) for v in fine],
                b"coarse_labels": [int(v) // 5 for v in fine],
                b"data": rng.integers(0, 256, (n, 3072), dtype=np.uint8),
            }
            write_batch(folder / name, batch, protocol=pickle.HIGHEST_PROTOCOL)
        meta = {
            b"fine_label_names": [f"fine{i}".encode() for i in range(100)],
            b"coarse_label_names": [f"coarse{i}".encode() for i in range(20)],
        }
        write_batch(folder / "meta", meta)
        return root

    return make
