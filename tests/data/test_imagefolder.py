"""``--dataset imagefolder``: real PNG/JPEG files in the ImageFolder layout, written by the tests."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from revtrain.data import DatasetFormatError, DatasetNotFoundError, build_dataloaders, scan_image_folder
from revtrain.data.imagefolder import IMAGENET_MEAN, IMAGENET_STD, _torchvision_image_folder
from tests.data_files import COLOURS, make_image_folder, write_image

def test_classes_samples_and_pixels(tmp_path: Path) -> None:
    root = make_image_folder(tmp_path / "pics")
    classes, samples = scan_image_folder(root / "train")
    assert classes == ["cat", "dog", "owl"]
    assert [Path(p).relative_to(root / "train").as_posix() for p, _ in samples[:3]] == \
        ["cat/0.png", "cat/1.jpg", "cat/nested/2.png"]
    assert [i for _, i in samples] == [0, 0, 0, 1, 1, 1, 2, 2, 2]
    train, test, info = build_dataloaders("imagefolder", data_dir=root, batch_size=4, image_size=8, augment=False)
    assert info.input_shape == (3, 8, 8) and info.num_classes == 3 and info.class_names == ("cat", "dog", "owl")
    assert (info.train_size, info.test_size) == (9, 9)
    x, y = next(iter(test))
    assert x.shape == (4, 3, 8, 8) and x.dtype == torch.float32 and y.tolist() == [0, 0, 0, 1]
    # A solid PNG decodes to its colour exactly: (v / 255 - mean) / std per channel.
    expected = torch.tensor([(c / 255 - m) / s for c, m, s in zip(COLOURS["cat"], IMAGENET_MEAN, IMAGENET_STD)])
    torch.testing.assert_close(x[0].mean(dim=(1, 2)), expected, rtol=0, atol=1e-5)
    torch.testing.assert_close(x[0], expected.view(3, 1, 1).expand(3, 8, 8), rtol=0, atol=1e-5)


def test_matches_torchvision_where_it_imports(tmp_path: Path) -> None:
    image_folder = _torchvision_image_folder()
    if image_folder is None:
        pytest.skip("torchvision does not import beside this torch; the built-in reader is used (tested above)")
    root = make_image_folder(tmp_path / "pics")
    found = image_folder(str(root / "train"))
    assert scan_image_folder(root / "train") == (found.classes, [(p, i) for p, i in found.samples])


def test_workers_give_the_same_batches(tmp_path: Path) -> None:
    root = make_image_folder(tmp_path / "pics")
    loaders = [build_dataloaders("imagefolder", data_dir=root, batch_size=4, image_size=8, num_workers=n)[0]
               for n in (0, 2)]
    assert loaders[1].num_workers == 2
    for (xa, ya), (xb, yb) in zip(*loaders, strict=True):
        assert torch.equal(xa, xb) and torch.equal(ya, yb)


def test_empty_class_folder_names_it(tmp_path: Path) -> None:
    root = make_image_folder(tmp_path / "pics")
    (root / "train" / "emu").mkdir()
    (root / "val" / "emu").mkdir()
    with pytest.raises(DatasetFormatError, match=re.escape(f"class folder(s) {root / 'train' / 'emu'} hold no image")):
        build_dataloaders("imagefolder", data_dir=root, batch_size=4)


def test_unreadable_image_names_the_file(tmp_path: Path) -> None:
    root = make_image_folder(tmp_path / "pics")
    bad = root / "val" / "dog" / "broken.jpg"
    bad.write_bytes(b"\xff\xd8 this is not a jpeg")
    with pytest.raises(DatasetFormatError, match=f"not readable images: {bad}; replace or remove them"):
        build_dataloaders("imagefolder", data_dir=root, batch_size=4)


def test_different_classes_in_train_and_val_are_named(tmp_path: Path) -> None:
    root = make_image_folder(tmp_path / "pics")
    write_image(root / "train" / "emu" / "0.png", (1, 2, 3))
    write_image(root / "val" / "yak" / "0.png", (1, 2, 3))
    with pytest.raises(DatasetFormatError, match="different classes .only in train/: emu; only in val/: yak."):
        build_dataloaders("imagefolder", data_dir=root, batch_size=4)


def test_missing_folders_say_the_layout(tmp_path: Path) -> None:
    with pytest.raises(DatasetNotFoundError, match="needs --data-dir D"):
        build_dataloaders("imagefolder", batch_size=4)
    (tmp_path / "train" / "a").mkdir(parents=True)
    with pytest.raises(DatasetNotFoundError, match="has no val/ folder.*train/<class>/"):
        build_dataloaders("imagefolder", data_dir=tmp_path, batch_size=4)


def test_augmentation_is_seeded_and_flips(tmp_path: Path) -> None:
    root = tmp_path / "pics"
    left_red = np.zeros((8, 8, 3), dtype=np.uint8)
    left_red[:, :4, 0] = 255
    for split in ("train", "val"):
        for i in range(4):
            path = root / split / "a" / f"{i}.png"
            path.parent.mkdir(parents=True, exist_ok=True)
            Image.fromarray(left_red).save(path)
    first = [x for x, _ in build_dataloaders("imagefolder", data_dir=root, batch_size=4, image_size=8, seed=3)[0]]
    again = [x for x, _ in build_dataloaders("imagefolder", data_dir=root, batch_size=4, image_size=8, seed=3)[0]]
    assert all(torch.equal(a, b) for a, b in zip(first, again, strict=True))
    plain = next(iter(build_dataloaders("imagefolder", data_dir=root, batch_size=4, image_size=8,
                                        augment=False)[0]))[0]
    assert not torch.equal(first[0], plain)  # cropped or flipped


def _write_noise(path: Path, fmt: str, side: int = 64) -> bytes:
    """A noisy image (so it compresses badly and its data runs well past the header); its bytes."""
    path.parent.mkdir(parents=True, exist_ok=True)
    pixels = np.random.default_rng(0).integers(0, 256, (side, side, 3), dtype=np.uint8)
    Image.fromarray(pixels).save(path, format=fmt)
    return path.read_bytes()


@pytest.mark.parametrize(("fmt", "name", "keep"), [("PNG", "trunc.png", lambda n: 300),
                                                   ("JPEG", "trunc.jpg", lambda n: n // 2),
                                                   ("JPEG", "no_end.jpg", lambda n: n - 2)])
def test_truncated_image_is_refused_before_training(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                    fmt: str, name: str, keep) -> None:
    from revtrain.cli import main

    root = make_image_folder(tmp_path / "pics")
    bad = root / "train" / "dog" / name
    data = _write_noise(bad, fmt)
    bad.write_bytes(data[:keep(len(data))])
    with Image.open(bad) as image:  # the header is intact: opening the file alone does not see the damage
        assert image.size == (64, 64)
    message = f"1 file(s) with an image extension are not readable images: {bad}; replace or remove them"
    with pytest.raises(DatasetFormatError, match=re.escape(message)):
        build_dataloaders("imagefolder", data_dir=root, batch_size=4, image_size=8)
    run = tmp_path / "run"
    assert main(["train", "--dataset", "imagefolder", "--data-dir", str(root), "--image-size", "8",
                 "--batch-size", "4", "--epochs", "1", "--device", "cpu", "--quiet", "--no-memory-report",
                 "--run-dir", str(run)]) == 2
    assert capsys.readouterr().err == f"revtrain train: error: {message}\n"
    assert not (run / "checkpoint.pt").exists() and not (run / "summary.json").exists()


def test_an_intact_noisy_image_passes_the_check(tmp_path: Path) -> None:
    root = make_image_folder(tmp_path / "pics")
    for fmt, ext in (("PNG", "png"), ("JPEG", "jpg")):
        _write_noise(root / "val" / "owl" / f"noise.{ext}", fmt)
    assert build_dataloaders("imagefolder", data_dir=root, batch_size=4, image_size=8)[2].test_size == 11


def _read_error(loader) -> DatasetFormatError:
    with pytest.raises(DatasetFormatError) as caught:
        for _ in loader:
            pass
    return caught.value


def test_a_read_error_in_a_worker_is_the_plain_one_line_error(tmp_path: Path) -> None:
    """A file that breaks after the check (here: overwritten once the loaders exist) stops the epoch
    with the same error, type and message, with worker processes as without."""
    root = make_image_folder(tmp_path / "pics")
    loaders = {n: build_dataloaders("imagefolder", data_dir=root, batch_size=4, image_size=8, num_workers=n)[1]
               for n in (0, 2)}
    bad = root / "val" / "dog" / "0.png"
    bad.write_bytes(b"\x89PNG\r\n\x1a\n and then nothing")
    plain, from_workers = _read_error(loaders[0]), _read_error(loaders[2])
    assert type(from_workers) is type(plain) is DatasetFormatError
    assert str(from_workers) == str(plain)
    assert str(plain).startswith(f"cannot read image {bad} (") and "\n" not in str(plain)
    # Nothing is lost: torch's report, with the worker's traceback, is the cause.
    assert "in DataLoader worker process" in str(from_workers.__cause__)
    assert "Traceback" in str(from_workers.__cause__)


def test_a_read_error_in_a_worker_is_one_line_from_the_command_line(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    from revtrain.cli import main
    from revtrain.data import imagefolder

    root = make_image_folder(tmp_path / "pics")
    bad = root / "train" / "owl" / "0.png"
    bad.write_bytes(b"not a png")
    monkeypatch.setattr(imagefolder, "_check_readable", lambda samples: None)  # it breaks after the check
    assert main(["train", "--dataset", "imagefolder", "--data-dir", str(root), "--image-size", "8",
                 "--batch-size", "4", "--epochs", "1", "--num-workers", "2", "--device", "cpu", "--quiet",
                 "--no-memory-report", "--run-dir", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"revtrain train: error: cannot read image {bad} (") and err.count("\n") == 1
    assert err.endswith("; replace or remove the file\n")


def test_a_resume_on_another_data_folder_says_so(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Moving or replacing the data between two parts of a run is allowed, and said out loud."""
    from revtrain.cli import main

    first, moved = make_image_folder(tmp_path / "pics"), make_image_folder(tmp_path / "moved")
    argv = ["train", "--dataset", "imagefolder", "--image-size", "8", "--batch-size", "4", "--device", "cpu",
            "--no-memory-report", "--max-steps-per-epoch", "1"]
    assert main([*argv, "--data-dir", str(first), "--epochs", "1", "--quiet", "--run-dir", str(tmp_path / "run")]) == 0
    capsys.readouterr()
    assert main([*argv, "--data-dir", str(moved), "--epochs", "2", "--resume", str(tmp_path / "run")]) == 0
    assert f"data_dir {first} -> {moved}" in capsys.readouterr().out


def test_resume_auto_takes_the_latest_run_on_the_data_folder_given(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from revtrain.cli import main

    monkeypatch.chdir(tmp_path)
    first, second = make_image_folder(tmp_path / "pics"), make_image_folder(tmp_path / "more", per_class=4)
    argv = ["train", "--dataset", "imagefolder", "--image-size", "8", "--batch-size", "4", "--device", "cpu",
            "--no-memory-report", "--max-steps-per-epoch", "1", "--quiet"]
    assert main([*argv, "--data-dir", str(first), "--epochs", "1", "--run-dir", "runs/revnet38-imagefolder-a"]) == 0
    assert main([*argv, "--data-dir", str(second), "--epochs", "1", "--run-dir", "runs/revnet38-imagefolder-b"]) == 0
    capsys.readouterr()
    assert main([*argv, "--data-dir", str(first), "--epochs", "2", "--resume", "auto"]) == 0  # not b, the latest
    assert f"resuming runs/revnet38-imagefolder-a, the latest run of revnet38 on imagefolder from {first}" \
        in capsys.readouterr().out
    third = make_image_folder(tmp_path / "other")
    assert main([*argv, "--data-dir", str(third), "--epochs", "1", "--resume", "auto"]) == 0
    assert f"no run of revnet38 on imagefolder from {third}" in capsys.readouterr().out
