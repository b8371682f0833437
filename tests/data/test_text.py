"""Byte-level text data: what is read from where, the split, the windows, resume, and bad folders."""

from __future__ import annotations

import gzip
import zipfile
from pathlib import Path

import pytest
import torch

from revtrain.data import DatasetError, DatasetNotFoundError, ResumableLoader, build_dataloaders
from revtrain.data.text import DEFAULT_CORPUS_BYTES, ByteWindows, build_text, load_corpus, stdlib_dir


def _write(root: Path, files: dict[str, bytes]) -> Path:
    for name, data in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
    return root


def test_folder_is_read_recursively_in_path_order_as_raw_bytes(tmp_path):
    not_utf8 = b"caf\xe9 \xff\xfe latin-1 and junk\n"  # invalid UTF-8 is kept byte for byte
    root = _write(tmp_path / "corpus", {
        "b.txt": b"second\n",
        "a/z.md": b"first\n",
        "c.txt": not_utf8,
        ".hidden/x.txt": b"hidden\n",
        "__pycache__/m.pyc": b"cached\n",
        "image.png": b"\x89PNG\r\n\x1a\n\0\0\0binary",
        "empty.txt": b"",
    })
    corpus = load_corpus(root)
    assert corpus.files == ("a/z.md", "b.txt", "c.txt", "empty.txt")
    assert corpus.skipped == ("image.png",)
    assert bytes(corpus.data.tolist()) == b"first\nsecond\n" + not_utf8
    assert "1 binary file(s) skipped" in corpus.describe()


def test_a_single_file_and_max_bytes(tmp_path):
    path = _write(tmp_path, {"one.txt": bytes(range(256)) * 2}) / "one.txt"
    corpus = load_corpus(path)
    assert corpus.files == ("one.txt",) and len(corpus.data) == 512
    assert load_corpus(path, max_bytes=10).data.tolist() == list(range(10))


def test_split_is_contiguous_and_windows_are_shifted_by_one(tmp_path):
    data = bytes((7 * i) % 256 for i in range(1000))
    path = _write(tmp_path, {"t.txt": data}) / "t.txt"  # a file given by name: NUL bytes are fine
    splits = build_text(path, context=8, valid_fraction=0.1, augment=False)
    assert bytes(splits.train.data.tolist()) + bytes(splits.test.data.tolist()) == data
    assert len(splits.test.data) == 100
    assert (splits.info.name, splits.info.input_shape, splits.info.num_classes) == ("text", (8,), 256)
    x, y = splits.train.get_batch(torch.tensor([0, 3]))
    assert x.dtype == y.dtype == torch.int64 and x.shape == y.shape == (2, 8)
    assert x[1].tolist() == list(data[24:32]) and y[1].tolist() == list(data[25:33])
    assert len(splits.train) == (900 - 1) // 8 and len(splits.test) == (100 - 1) // 8


def test_training_windows_move_between_epochs_and_resume_exactly(tmp_path):
    path = _write(tmp_path, {"t.txt": bytes(range(256)) * 40}) / "t.txt"
    splits = build_text(path, context=16)
    loader = ResumableLoader(splits.train, batch_size=8, shuffle=True, seed=3)
    epoch0 = [x for x, _ in loader]
    epoch1 = [x for x, _ in loader]
    assert not torch.equal(epoch0[0], epoch1[0])
    for x in epoch0:  # windows are consecutive bytes wherever they start
        assert torch.equal((x[:, 1:] - x[:, :-1]) % 256, torch.ones_like(x[:, 1:]))
    again = ResumableLoader(splits.train, batch_size=8, shuffle=True, seed=3)
    again.load_state_dict({**loader.state_dict(), "epoch": 1, "next_batch": 2})
    assert all(torch.equal(a, b) for (a, _), b in zip(again, epoch1[2:], strict=True))
    # Validation windows never move.
    valid = ResumableLoader(splits.test, batch_size=4, shuffle=False)
    first, second = [x for x, _ in valid], [x for x, _ in valid]  # two epochs
    assert all(torch.equal(a, b) for a, b in zip(first, second, strict=True))


def test_enwik8_in_the_folder_is_the_corpus_with_its_standard_split(tmp_path):
    text = bytes(i % 251 for i in range(2000))
    root = _write(tmp_path, {"other.txt": b"ignored\n" * 100})
    with zipfile.ZipFile(root / "enwik8.zip", "w") as archive:
        archive.writestr("enwik8", text)
    splits = build_text(root, context=4)
    assert bytes(splits.train.data.tolist()) == text[:1800]
    assert bytes(splits.test.data.tolist()) == text[1800:1900]
    gz = tmp_path / "gz" / "enwik8.gz"
    gz.parent.mkdir()
    gz.write_bytes(gzip.compress(text))
    assert load_corpus(gz.parent).enwik8 and bytes(load_corpus(gz).data.tolist()) == text


def test_default_corpus_is_the_standard_library_capped_and_deterministic():
    corpus = load_corpus(max_bytes=50_000)
    assert Path(corpus.root) == stdlib_dir() and (stdlib_dir() / "os.py").is_file()
    assert len(corpus.data) == 50_000 and list(corpus.files) == sorted(corpus.files)
    assert not any(part in ("test", "tests", "site-packages") for f in corpus.files for part in f.split("/")[:-1])
    first = (stdlib_dir() / corpus.files[0]).read_bytes()
    assert bytes(corpus.data[: len(first)].tolist()) == first[:50_000]
    assert torch.equal(load_corpus(max_bytes=50_000).data, corpus.data)
    assert DEFAULT_CORPUS_BYTES == 8 * 2**20


def test_missing_empty_and_binary_only_folders_are_named(tmp_path):
    with pytest.raises(DatasetNotFoundError, match="nowhere does not exist"):
        load_corpus(tmp_path / "nowhere")
    (tmp_path / "empty").mkdir()
    with pytest.raises(DatasetError, match=r"empty holds no non-empty file"):
        load_corpus(tmp_path / "empty")
    _write(tmp_path / "bin", {"a.bin": b"\0\1\2"})
    with pytest.raises(DatasetError, match=r"bin holds 1 binary file\(s\) and no text"):
        load_corpus(tmp_path / "bin")
    _write(tmp_path, {"void.txt": b""})
    with pytest.raises(DatasetError, match="void.txt is empty"):
        load_corpus(tmp_path / "void.txt")


def test_an_unreadable_file_is_named(tmp_path, monkeypatch):
    root = _write(tmp_path / "c", {"ok.txt": b"fine\n", "locked.txt": b"secret\n"})
    real = Path.read_bytes

    def read_bytes(self):
        if self.name == "locked.txt":  # chmod does not stop root, so fail the read itself
            raise PermissionError(13, "Permission denied")
        return real(self)

    monkeypatch.setattr(Path, "read_bytes", read_bytes)
    with pytest.raises(DatasetError, match=r"cannot read text file .*locked\.txt: Permission denied"):
        load_corpus(root)


def test_too_little_text_for_one_window(tmp_path):
    _write(tmp_path, {"t.txt": b"x" * 20})
    with pytest.raises(DatasetError, match=f"{tmp_path}: a split of .* bytes is too short for one window of 16 tokens"):
        build_text(tmp_path, context=16)
    with pytest.raises(ValueError, match="context must be >= 1"):
        ByteWindows(torch.zeros(10, dtype=torch.uint8), 0, random_offset=False)
    from revtrain.data import build_dataloaders

    with pytest.raises(ValueError, match="context must be >= 1"):  # not replaced by the default of 128
        build_dataloaders("text", batch_size=2, data_dir=str(tmp_path), context=0)


def test_dataset_factory_builds_text_loaders(tmp_path):
    _write(tmp_path, {"t.txt": b"hello world\n" * 200})
    train, test, info = build_dataloaders("text", data_dir=tmp_path, batch_size=4, context=32)
    x, y = next(iter(train))
    assert x.shape == y.shape == (4, 32) and info.input_shape == (32,) and info.num_classes == 256
    assert len(test) == -(-info.test_size // 4)
    with pytest.raises(ValueError, match="context only applies to the 'text' dataset"):
        build_dataloaders("digits", batch_size=4, context=32)
    with pytest.raises(ValueError, match="image_size does not apply"):
        build_dataloaders("text", data_dir=tmp_path, batch_size=4, image_size=8)
