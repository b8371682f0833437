"""Your own model (issue 24 §2): ``Trainer(model=...)``, ``--model module:factory``, and
``revtrain.load`` / ``revtrain export`` round trips (weights equal, same predictions)."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
import torch
from torch import nn

import revtrain
from revtrain import ReversibleBlock, ReversibleSequence, get_modes
from revtrain.cli import main
from revtrain.data import build_dataloaders
from revtrain.train import ConfigError, IncompatibleCheckpointError, Trainer, load_checkpoint

from .conftest import make_tiny_config

MY_NETS = '''
from torch import nn
from revtrain import ReversibleBlock, ReversibleSequence


def half(channels):
    return nn.Sequential(nn.Conv2d(channels, channels, 3, padding=1), nn.BatchNorm2d(channels), nn.ReLU())


def small_revnet(in_channels=3, num_classes=10, width=8):
    return nn.Sequential(
        nn.Conv2d(in_channels, 2 * width, 3, padding=1),
        ReversibleSequence([ReversibleBlock(half(width), half(width)) for _ in range(2)]),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(2 * width, num_classes),
    )
'''


def small_revnet(in_channels: int = 1, num_classes: int = 10, width: int = 8) -> nn.Module:
    def half() -> nn.Module:
        return nn.Sequential(nn.Conv2d(width, width, 3, padding=1), nn.BatchNorm2d(width), nn.ReLU())

    return nn.Sequential(
        nn.Conv2d(in_channels, 2 * width, 3, padding=1),
        ReversibleSequence([ReversibleBlock(half(), half()) for _ in range(2)]),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(2 * width, num_classes),
    )


def _test_batch() -> torch.Tensor:
    return next(iter(build_dataloaders("digits", batch_size=32)[1]))[0]


def _same_state(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert list(a) == list(b)
    for name in a:
        assert torch.equal(a[name].cpu(), b[name].cpu()), name


def test_trainer_trains_a_model_object(tmp_path: Path) -> None:
    torch.manual_seed(0)
    net = small_revnet()
    before = {k: v.clone() for k, v in net.state_dict().items()}
    config = make_tiny_config(tmp_path / "run", model="my-revnet", mode="M")
    trainer = Trainer(config, model=net, out=io.StringIO())
    summary = trainer.fit()
    assert trainer.model is net and summary["model"] == "my-revnet"
    assert set(get_modes(net).values()) == {"M"} and len(get_modes(net)) == 2
    assert any(not torch.equal(before[k], v) for k, v in net.state_dict().items() if v.is_floating_point())
    _same_state(load_checkpoint(tmp_path / "run" / "checkpoint.pt")["model"], net.state_dict())
    # No name rebuilds an object: load says so, and loads into a fresh one of the same architecture.
    with pytest.raises(IncompatibleCheckpointError, match="a model object given to the Trainer.*model=net"):
        revtrain.load(tmp_path / "run")
    loaded = revtrain.load(tmp_path / "run", model=small_revnet())
    _same_state(loaded.state_dict(), net.state_dict())
    x = _test_batch()
    torch.testing.assert_close(loaded(x), net.eval()(x), rtol=0, atol=0)


def test_cli_trains_a_module_factory_and_load_rebuilds_it(tmp_path: Path) -> None:
    (tmp_path / "my_nets.py").write_text(MY_NETS)
    factory, run = f"{tmp_path / 'my_nets.py'}:small_revnet", tmp_path / "run"
    assert main(["train", "--model", factory, "--image-size", "8", "--batch-size", "16", "--epochs", "1",
                 "--max-steps-per-epoch", "3", "--device", "cpu", "--quiet", "--no-memory-report", "--mode", "C",
                 "--run-dir", str(run)]) == 0
    state = load_checkpoint(run / "checkpoint.pt")
    model = revtrain.load(run)
    assert not model.training and set(get_modes(model).values()) == {"C"}
    assert model[0].in_channels == 1 and model[-1].out_features == 10  # built for the digits
    _same_state(model.state_dict(), state["model"])
    assert json.loads((run / "config.json").read_text())["model"] == factory


def test_resume_auto_finds_the_default_run_folder_of_a_module_factory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The default folder is named by the factory (runs/small_revnet-digits-...): --resume auto
    looks for it under that name, not under the path the model was given as."""
    (tmp_path / "my_nets.py").write_text(MY_NETS)
    monkeypatch.chdir(tmp_path)
    argv = ["train", "--model", "my_nets.py:small_revnet", "--image-size", "8", "--batch-size", "16",
            "--max-steps-per-epoch", "2", "--device", "cpu", "--quiet", "--no-memory-report"]
    assert main([*argv, "--epochs", "1"]) == 0
    (run,) = Path("runs").iterdir()
    assert run.name.startswith("small_revnet-digits-")
    capsys.readouterr()
    assert main([*argv, "--epochs", "2", "--resume", "auto"]) == 0
    assert "resuming" in capsys.readouterr().out
    assert [p.name for p in Path("runs").iterdir()] == [run.name]
    assert json.loads((run / "summary.json").read_text())["steps"] == 4
    # The file is recorded by its absolute path: the run resumes and loads from any folder.
    assert json.loads((run / "config.json").read_text())["model"] == f"{tmp_path / 'my_nets.py'}:small_revnet"
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    assert main(["train", "--epochs", "3", "--resume", str(tmp_path / run)]) == 0
    assert isinstance(revtrain.load(tmp_path / run), nn.Module)


def test_load_and_export_round_trip(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("safetensors")
    run = tmp_path / "run"
    Trainer(make_tiny_config(run, epochs=1, mode="C"), out=io.StringIO()).fit()
    state = load_checkpoint(run / "checkpoint.pt")
    from_run = revtrain.load(run)
    _same_state(from_run.state_dict(), state["model"])
    assert get_modes(from_run) == state["modes"] and not from_run.training
    assert main(["export", str(run), "--out", str(tmp_path / "exported")]) == 0
    assert (tmp_path / "exported" / "model.safetensors").is_file()
    recipe = json.loads((tmp_path / "exported" / "model.json").read_text())
    assert recipe["model"] == "revnet38" and recipe["kwargs"] == {"num_classes": 10, "in_channels": 1}
    assert recipe["input"] == {"kind": "image", "shape": [1, 8, 8], "num_classes": 10}
    from_export = revtrain.load(tmp_path / "exported")
    _same_state(from_export.state_dict(), state["model"])
    _same_state(revtrain.load(tmp_path / "exported" / "model.safetensors").state_dict(), state["model"])
    assert get_modes(from_export) == state["modes"]
    x = _test_batch()
    with torch.no_grad():
        torch.testing.assert_close(from_export(x), from_run(x), rtol=0, atol=0)
    assert main(["export", str(run), "--out", str(tmp_path / "exported")]) == 2
    assert "exists already; pass --overwrite (overwrite=True in Python)" in capsys.readouterr().err
    assert main(["export", str(run), "--out", str(tmp_path / "exported"), "--overwrite"]) == 0


def test_bad_factory_paths_are_explained(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "my_nets.py").write_text(MY_NETS + "\nnot_a_model = lambda **kw: 3\n")
    base = ["train", "--device", "cpu", "--quiet", "--run-dir", str(tmp_path / "r")]
    cases = [
        (f"{tmp_path / 'nope.py'}:small_revnet", "nope.py does not exist"),
        ("no_such_module_xyz:f", "cannot import module no_such_module_xyz"),
        (f"{tmp_path / 'my_nets.py'}:big_revnet", "has no big_revnet; its callables: .*small_revnet"),
        (f"{tmp_path / 'my_nets.py'}:not_a_model", "returned int, not a torch.nn.Module"),
    ]
    for model, message in cases:
        assert main([*base, "--model", model]) == 2
        err = capsys.readouterr().err
        assert "Traceback" not in err
        assert __import__("re").search(message, err), err
    with pytest.raises(ConfigError, match="unknown model|module:factory"):
        Trainer(make_tiny_config(tmp_path / "r2", model="revnet-999"), out=io.StringIO())


@pytest.mark.parametrize("name", ["revvit_cifar", "vit_digits"])
def test_a_vit_is_built_for_the_image_size_of_the_data(name: str, tmp_path: Path) -> None:
    """A ViT's patch grid is fixed when it is built: a CIFAR ViT trained on 8×8 digits and a digits
    ViT on 16×16 images are built for those sizes, and load and export rebuild them the same way."""
    size = 8 if name == "revvit_cifar" else 16
    run = tmp_path / "run"
    assert main(["train", "--model", name, "--image-size", str(size), "--batch-size", "16", "--epochs", "1",
                 "--max-steps-per-epoch", "2", "--device", "cpu", "--quiet", "--no-memory-report",
                 "--run-dir", str(run)]) == 0
    x = torch.randn(2, 1, size, size)
    model = revtrain.load(run)
    assert main(["export", str(run), "--out", str(tmp_path / "exported")]) == 0
    exported = revtrain.load(tmp_path / "exported")
    torch.testing.assert_close(exported(x), model(x), rtol=0, atol=0)
    assert model(x).shape == (2, 10)


def test_a_run_that_recorded_its_factory_file_relative_to_its_folder_still_resumes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Runs recorded their file.py:factory as given (relative): from that folder, with or without
    --model, they resume as the run they are."""
    from revtrain.train.checkpoint import save_checkpoint

    (tmp_path / "my_nets.py").write_text(MY_NETS)
    monkeypatch.chdir(tmp_path)
    argv = ["train", "--model", "my_nets.py:small_revnet", "--image-size", "8", "--batch-size", "16",
            "--max-steps-per-epoch", "2", "--device", "cpu", "--quiet", "--no-memory-report", "--run-dir", "run"]
    assert main([*argv, "--epochs", "1"]) == 0
    state = torch.load("run/checkpoint.pt", weights_only=True)
    state["config"] = {**state["config"], "model": "my_nets.py:small_revnet"}  # as recorded before
    state["model_name"] = "my_nets.py:small_revnet"
    save_checkpoint({k: v for k, v in state.items() if k not in ("format", "version", "revtrain_version")},
                    "run/checkpoint.pt")
    assert main([*argv[:3], "--epochs", "2", "--quiet", "--no-memory-report", "--resume", "run"]) == 0
    assert json.loads(Path("run/summary.json").read_text())["steps"] == 4


def test_resume_auto_tells_two_factories_of_one_name_apart(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "my_nets.py").write_text(MY_NETS)
    (tmp_path / "other_nets.py").write_text(MY_NETS)
    monkeypatch.chdir(tmp_path)
    argv = ["train", "--image-size", "8", "--batch-size", "16", "--max-steps-per-epoch", "2", "--epochs", "1",
            "--device", "cpu", "--quiet", "--no-memory-report"]
    assert main([*argv, "--model", "my_nets.py:small_revnet"]) == 0
    capsys.readouterr()
    assert main([*argv, "--model", "other_nets.py:small_revnet", "--resume", "auto"]) == 0
    assert "no run of" in capsys.readouterr().out  # a new run of the other file's model
    assert len(list(Path("runs").iterdir())) == 2
