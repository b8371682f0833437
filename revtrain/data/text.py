"""Byte-level text for language models, from local files only (vocabulary 256, like enwik8).

Where the bytes come from (:func:`load_corpus`):

- ``data_dir=None``: the Python standard library's own ``.py`` sources, found from the running
  interpreter (``sysconfig``'s ``stdlib`` path, else the folder of ``os.py``), so a text run
  works offline on every machine revtrain runs on. Test suites and installed packages
  (``test``, ``tests``, ``site-packages``, ``dist-packages``) are left out; files are read in
  sorted path order and the corpus is cut at :data:`DEFAULT_CORPUS_BYTES` (8 MiB). The same
  Python version gives the same corpus.
- ``data_dir`` a file: that file. A folder: every file below it (recursively, sorted by
  path), except hidden ones, ``__pycache__`` and binary files (a NUL byte in the first 8 KiB,
  git's test; this also skips UTF-16 text). If the folder holds ``enwik8`` (raw, ``.zip`` or
  ``.gz``, as distributed by the Hutter Prize), the corpus is enwik8 alone.

Bytes are bytes: files are never decoded, so any encoding (and invalid UTF-8) is read as it
is, one token per byte. A missing path, a folder with nothing to read and an unreadable file
each raise a :class:`~revtrain.data.errors.DatasetError` that names the path.

The split is contiguous and deterministic: the last ``valid_fraction`` of the bytes is the
validation split (the loaders call it "test"). enwik8 uses its standard split, the first 90%
for training, the next 5% for validation (the last 5% is the test set, not loaded).

Samples are windows of ``context + 1`` bytes: inputs ``(T,)`` and targets shifted by one,
int64. Windows start at multiples of ``context``; in training, each window is also shifted by
a random offset in ``[0, context)`` drawn from the batch's generator, so successive epochs see
different cuts while batch ``b`` of epoch ``e`` still depends only on ``(seed, e, b)`` (see
:mod:`revtrain.data.loader`).
"""

from __future__ import annotations

import gzip
import os
import sysconfig
import zipfile
import zlib
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from revtrain.data.errors import DatasetError, DatasetNotFoundError
from revtrain.data.loader import DatasetInfo, DatasetSplits

__all__ = [
    "DEFAULT_CORPUS_BYTES",
    "ByteWindows",
    "TextCorpus",
    "WindowOffsets",
    "build_text",
    "load_corpus",
    "stdlib_dir",
]

DEFAULT_CORPUS_BYTES = 8 * 2**20
"""Size cap of the default corpus (the standard library's sources), in bytes."""
VOCAB_SIZE = 256
ENWIK8_NAMES = ("enwik8", "enwik8.zip", "enwik8.gz")
_SKIPPED_STDLIB_DIRS = {"test", "tests", "site-packages", "dist-packages", "__pycache__"}
_BINARY_PROBE = 8192


@dataclass(frozen=True)
class TextCorpus:
    """A byte corpus and where it came from."""

    data: Tensor
    """All bytes, uint8 ``(N,)``, in reading order."""
    root: str
    """The folder or file read (the standard library's folder for the default corpus)."""
    files: tuple[str, ...]
    """Files read, relative to ``root``, in order."""
    skipped: tuple[str, ...] = ()
    """Files left out as binary."""
    enwik8: bool = False
    """Whether the corpus is enwik8 (standard 90/5/5 split)."""

    def describe(self) -> str:
        """One line: what was read, how much."""
        what = "enwik8" if self.enwik8 else f"{len(self.files)} file(s)"
        skipped = f", {len(self.skipped)} binary file(s) skipped" if self.skipped else ""
        return f"{what} from {self.root}: {len(self.data):,} bytes{skipped}"


def stdlib_dir() -> Path:
    """The running interpreter's standard library folder."""
    path = sysconfig.get_paths().get("stdlib")
    return Path(path) if path and Path(path, "os.py").exists() else Path(os.__file__).parent


def _read(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except OSError as err:
        raise DatasetError(f"cannot read text file {path}: {err.strerror or err}; fix its "
                           "permissions or move it out of the data folder") from err


def _stdlib_corpus(max_bytes: int) -> TextCorpus:
    root = stdlib_dir()
    files = []
    for folder, dirs, names in os.walk(root):
        # Pruned while walking: site-packages can hold gigabytes of installed packages.
        dirs[:] = [d for d in dirs if d not in _SKIPPED_STDLIB_DIRS and not d.startswith(".")]
        files += [Path(folder, n) for n in names if n.endswith(".py")]
    files.sort(key=lambda p: p.relative_to(root).as_posix())
    chunks, names, size = [], [], 0
    for path in files:
        if size >= max_bytes:
            break
        data = _read(path)[: max_bytes - size]
        chunks.append(data)
        names.append(path.relative_to(root).as_posix())
        size += len(data)
    if not size:
        raise DatasetError(f"found no Python sources under {root} for the default text corpus; "
                           "pass a folder of text files (--data-dir)")
    return TextCorpus(data=_as_tensor(b"".join(chunks)), root=str(root), files=tuple(names))


def _read_enwik8(path: Path) -> bytes:
    if path.suffix == ".zip":
        try:
            with zipfile.ZipFile(path) as archive:
                return archive.read("enwik8")
        except (zipfile.BadZipFile, KeyError) as err:
            raise DatasetError(f"{path} is not the enwik8 archive (a zip holding 'enwik8'): {err}") from err
        except (OSError, EOFError, zlib.error) as err:
            raise DatasetError(f"cannot decompress {path} ({type(err).__name__}: {err}): the file is damaged or "
                               "cut short; download enwik8 again, or pass the unpacked enwik8") from None
    if path.suffix == ".gz":
        try:
            with gzip.open(path) as f:
                return f.read()
        except (OSError, EOFError, zlib.error) as err:
            raise DatasetError(f"cannot decompress {path} ({type(err).__name__}: {err}): the file is damaged or "
                               "cut short; download enwik8 again, or pass the unpacked enwik8") from None
    return _read(path)


def _folder_corpus(root: Path) -> TextCorpus:
    for name in ENWIK8_NAMES:
        if (root / name).is_file():
            return TextCorpus(data=_as_tensor(_read_enwik8(root / name)), root=str(root),
                              files=(name,), enwik8=True)
    try:
        paths = sorted(
            p for p in root.rglob("*")
            if not any(part.startswith(".") or part == "__pycache__" for part in p.relative_to(root).parts)
        )
    except OSError as err:
        raise DatasetError(f"cannot list the text folder {root}: {err}") from err
    chunks, names, skipped = [], [], []
    for path in paths:
        if not path.is_file():
            continue
        data = _read(path)
        name = path.relative_to(root).as_posix()
        if b"\0" in data[:_BINARY_PROBE]:
            skipped.append(name)
            continue
        chunks.append(data)
        names.append(name)
    data = b"".join(chunks)
    if not data:
        found = f"{len(skipped)} binary file(s) and no text" if skipped else "no non-empty file"
        raise DatasetError(f"the text folder {root} holds {found}; put text files (any encoding, read "
                           "as bytes) in it, or leave data_dir unset for the default corpus")
    return TextCorpus(data=_as_tensor(data), root=str(root), files=tuple(names), skipped=tuple(skipped))


def _as_tensor(data: bytes) -> Tensor:
    # bytearray: torch.frombuffer wants a writable buffer; one copy of the corpus.
    return torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)


def load_corpus(data_dir: str | os.PathLike[str] | None = None, *, max_bytes: int | None = None) -> TextCorpus:
    """Read a byte corpus; see the module docstring for what is read from where.

    Args:
        data_dir: A text file, a folder of text files, or ``None`` for the standard library.
        max_bytes: Keep at most this many bytes (default: everything of a given path,
            :data:`DEFAULT_CORPUS_BYTES` of the standard library).

    Raises:
        DatasetNotFoundError: ``data_dir`` does not exist.
        DatasetError: Nothing readable in it, or a file that cannot be read.
    """
    if max_bytes is not None and max_bytes < 1:
        raise ValueError(f"max_bytes must be positive, got {max_bytes}")
    if data_dir is None:
        return _stdlib_corpus(max_bytes or DEFAULT_CORPUS_BYTES)
    path = Path(data_dir).expanduser()
    if path.is_file():
        enwik8 = path.name in ENWIK8_NAMES
        raw = _read_enwik8(path) if enwik8 else _read(path)
        if not raw:
            raise DatasetError(f"the text file {path} is empty; give a file or folder with text in it")
        corpus = TextCorpus(data=_as_tensor(raw), root=str(path.parent), files=(path.name,), enwik8=enwik8)
    elif path.is_dir():
        corpus = _folder_corpus(path)
    else:
        raise DatasetNotFoundError(f"text data path {path} does not exist; give a text file or a folder "
                                   "of text files, or leave data_dir unset for the default corpus")
    if max_bytes is not None:
        corpus = TextCorpus(data=corpus.data[:max_bytes], root=corpus.root, files=corpus.files,
                            skipped=corpus.skipped, enwik8=corpus.enwik8)
    return corpus


@dataclass(frozen=True)
class WindowOffsets:
    """Where windows are cut: at multiples of the context, plus a random shift in training."""

    random: bool
    """Shift each window by a random offset in ``[0, context)`` (drawn per window, per batch)."""

    @property
    def is_random(self) -> bool:
        """Whether batches need a generator (what the loader asks every dataset's transform)."""
        return self.random


class ByteWindows:
    """Fixed-length windows of a byte sequence, served in batches by a ``ResumableLoader``.

    Args:
        data: The bytes, uint8 ``(N,)``.
        context: Window length ``T``: inputs are ``data[s:s+T]``, targets ``data[s+1:s+T+1]``.
        random_offset: Shift each window start by a random offset in ``[0, T)`` (training).
    """

    def __init__(self, data: Tensor, context: int, *, random_offset: bool) -> None:
        if context < 1:
            raise ValueError(f"context must be >= 1, got {context}")
        self.data = data
        self.context = context
        self.transform = WindowOffsets(random_offset)
        # Room for the offset (< T) and the one extra target byte after the last window.
        self._windows = (len(data) - 1) // context - (1 if random_offset else 0)
        if self._windows < 1:
            need = (2 if random_offset else 1) * context + 1
            raise DatasetError(f"a split of {len(data):,} bytes is too short for one window of "
                               f"{context} tokens (needs {need:,} bytes); use more text or a shorter context")

    def __len__(self) -> int:
        return self._windows

    def __getitem__(self, index: int) -> tuple[Tensor, Tensor]:
        """One window without offset (for inspection; training uses :meth:`get_batch`)."""
        x, y = self.get_batch(torch.tensor([index]))
        return x[0], y[0]

    def get_batch(self, indices: Tensor, generator: torch.Generator | None = None) -> tuple[Tensor, Tensor]:
        """Windows at ``indices``: inputs and targets, int64 ``(B, T)`` each."""
        starts = indices.to(torch.int64) * self.context
        if self.transform.random and generator is not None:
            starts = starts + torch.randint(0, self.context, starts.shape, generator=generator)
        # A view of every (T + 1)-window of the data, no copy; gather the ones we need.
        windows = self.data.unfold(0, self.context + 1, 1)[starts].to(torch.int64)  # (B, T + 1)
        return windows[:, :-1], windows[:, 1:]


def build_text(
    data_dir: str | os.PathLike[str] | None = None,
    *,
    context: int = 128,
    augment: bool = True,
    valid_fraction: float = 0.1,
    max_bytes: int | None = None,
) -> DatasetSplits:
    """Train and validation windows of a byte corpus, ready for ``ResumableLoader``.

    Args:
        data_dir: A text file, a folder, or ``None`` for the standard library's sources.
        context: Tokens per sample (the model's sequence length).
        augment: Random window offsets in training (the validation windows never move).
        valid_fraction: Share of the bytes, at the end, held out for validation (enwik8: its
            standard 5%, after the first 90%).
        max_bytes: Read at most this many bytes (see :func:`load_corpus`).
    """
    if not 0.0 < valid_fraction < 1.0:
        raise ValueError(f"valid_fraction must be in (0, 1), got {valid_fraction}")
    corpus = load_corpus(data_dir, max_bytes=max_bytes)
    n = len(corpus.data)
    if corpus.enwik8:
        train_end, valid_end = round(0.9 * n), round(0.95 * n)
    else:
        train_end, valid_end = n - round(valid_fraction * n), n
    try:
        train = ByteWindows(corpus.data[:train_end], context, random_offset=augment)
        valid = ByteWindows(corpus.data[train_end:valid_end], context, random_offset=False)
    except DatasetError as err:
        raise DatasetError(f"{corpus.root}: {err}") from None
    info = DatasetInfo(name="text", input_shape=(context,), num_classes=VOCAB_SIZE,
                       train_size=len(train), test_size=len(valid))
    return DatasetSplits(train=train, test=valid, info=info)  # type: ignore[arg-type]
