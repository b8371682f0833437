"""Checkpoint folders (``torch.distributed.checkpoint``), in one process without a process group.

The data-parallel engine saves its checkpoints through :class:`FolderStore`; here a local engine
does the same (DCP runs without a process group), so the layout, the exact resume, retention,
crash safety and the checks on load are tested in one fast process. The multi-process runs
(other replica counts, FSDP2 shards) are in tests/parallel/test_distributed_checkpoint.py.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch

import revtrain
from revtrain.train import Trainer
from revtrain.train.checkpoint import CorruptCheckpointError
from revtrain.train.checkpoint_folder import (
    MANIFEST_NAME,
    checkpoint_folders,
    latest_checkpoint,
    read_checkpoint,
)
from revtrain.train.checkpoint_store import FolderStore
from revtrain.train.engine import LocalEngine
from revtrain.train.resume import resolve_run
from revtrain.train.runs import RunExistsError, holds_run
from tests.train.conftest import TinyConfig, assert_same_training_state, interrupt_at


class FolderEngine(LocalEngine):
    """One process, checkpoints as the data-parallel engine writes them."""

    def checkpoint_store(self, trainer: Trainer) -> FolderStore:
        return FolderStore(trainer)


def _folders(run: Path) -> list[str]:
    return sorted(p.name for p in (run / "checkpoints").iterdir())


def test_a_folder_run_resumes_exactly_and_keeps_only_its_latest_folder(tiny_config: TinyConfig) -> None:
    """Interrupted at step 4 (mid-epoch), then resumed: weights, momentum, loader and counters
    equal an uninterrupted run's bit for bit; one folder per save, the older ones removed."""
    reference = Trainer(tiny_config("reference"), engine=FolderEngine())
    reference.fit()
    config = tiny_config("interrupted")
    first = Trainer(config, engine=FolderEngine(), callbacks=[interrupt_at(4)])
    with pytest.raises(KeyboardInterrupt):
        first.fit()
    run = Path(config.run_dir)
    assert _folders(run) == ["step-00000004"] and not (run / "checkpoint.pt").exists()
    assert sorted(p.name for p in (run / "checkpoints" / "step-00000004").iterdir()) == [
        ".metadata", "__0_0.distcp", MANIFEST_NAME, "state.pt"]
    resumed = Trainer(config.replace(resume=str(run)), engine=FolderEngine())
    resumed.fit()
    assert_same_training_state(resumed, reference)
    assert _folders(run) == ["step-00000006"]
    # the folder holds what the live run held: one process reads it whole
    state = read_checkpoint(latest_checkpoint(run))  # type: ignore[arg-type]
    for key, value in resumed.model.state_dict().items():
        assert torch.equal(state["model"][key], value), key
    assert state["progress"]["step"] == 6


def test_a_single_process_run_resumes_a_folder_and_a_folder_run_resumes_a_file(tiny_config: TinyConfig) -> None:
    """Either format continues in the other: the file written after a folder is what
    ``--resume`` picks next, and a folder written after a file replaces it."""
    reference = Trainer(tiny_config("reference", epochs=3))
    reference.fit()
    config = tiny_config("mixed", epochs=3)
    run = Path(config.run_dir)
    with pytest.raises(KeyboardInterrupt):
        Trainer(config, engine=FolderEngine(), callbacks=[interrupt_at(2)]).fit()
    with pytest.raises(KeyboardInterrupt):  # one process: checkpoint.pt
        Trainer(config.replace(resume=str(run)), callbacks=[interrupt_at(5)]).fit()
    assert latest_checkpoint(run) == run / "checkpoint.pt"
    last = Trainer(config.replace(resume="auto"), engine=FolderEngine())
    last.fit()
    assert latest_checkpoint(run) == run / "checkpoints" / "step-00000009"
    assert not (run / "checkpoint.pt").exists()
    assert_same_training_state(last, reference)


def test_keep_checkpoints_keeps_the_last_evaluated_folders_and_a_copy_of_the_best(tiny_config: TinyConfig) -> None:
    config = tiny_config("kept", epochs=3, keep_checkpoints=1, checkpoint_every=2)
    trainer = Trainer(config, engine=FolderEngine())
    trainer.fit()
    run = Path(config.run_dir)
    best = max(trainer.history, key=lambda r: (r["test_acc"], -r["step"]))
    names = {"step-00000009", "best"}
    assert set(_folders(run)) == names
    kept = read_checkpoint(run / "checkpoints" / "best")
    assert kept["progress"]["step"] == best["step"]
    net = revtrain.load(run / "checkpoints" / "best")
    assert net.state_dict().keys() == trainer.model.state_dict().keys()
    config2 = tiny_config("kept2", epochs=3, keep_checkpoints=2)
    Trainer(config2, engine=FolderEngine()).fit()
    assert [step for step, _ in checkpoint_folders(config2.run_dir)] == [6, 9]


def test_a_save_killed_midway_leaves_the_previous_folder_to_resume(tiny_config: TinyConfig,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """Killed after the shards were written but before the manifest: the half-written folder is
    a hidden temporary one, the run resumes from the previous folder, and the next save removes
    the leftovers. Killed between the two renames of a same-step save: the old folder stands in."""
    config = tiny_config("killed", epochs=2)
    trainer = Trainer(config, engine=FolderEngine(), callbacks=[interrupt_at(2)])
    with pytest.raises(KeyboardInterrupt):
        trainer.fit()
    run = Path(config.run_dir)
    import revtrain.train.checkpoint_folder as folder_module

    def killed(*args: object, **kwargs: object) -> None:
        raise KeyboardInterrupt("killed while writing state.pt")

    monkeypatch.setattr(folder_module, "save_checkpoint", killed)
    resumed = Trainer(config.replace(resume=str(run)), engine=FolderEngine(), callbacks=[interrupt_at(3)])
    with pytest.raises(KeyboardInterrupt):
        resumed.fit()
    monkeypatch.undo()
    assert _folders(run) == [".step-00000003.tmp", "step-00000002"]
    assert latest_checkpoint(run) == run / "checkpoints" / "step-00000002"
    again = Trainer(config.replace(resume=str(run)), engine=FolderEngine())
    assert again.step == 2
    again.fit()
    assert _folders(run) == ["step-00000006"]
    # a same-step save killed between its renames: only ".step-6.old" is left, and it counts
    os.replace(run / "checkpoints" / "step-00000006", run / "checkpoints" / ".step-00000006.old")
    assert holds_run(run) and latest_checkpoint(run) == run / "checkpoints" / ".step-00000006.old"
    assert read_checkpoint(latest_checkpoint(run))["progress"]["step"] == 6  # type: ignore[arg-type]


def test_damaged_or_partial_folders_are_refused_with_the_folder_named(tiny_config: TinyConfig) -> None:
    config = tiny_config("damaged", epochs=1)
    Trainer(config, engine=FolderEngine()).fit()
    folder = Path(config.run_dir) / "checkpoints" / "step-00000003"
    copies = {}
    for name in ("flipped", "no-manifest", "no-metadata"):
        copies[name] = folder.with_name(name)
        shutil.copytree(folder, copies[name])
    shard = copies["flipped"] / "__0_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x01
    shard.write_bytes(bytes(data))
    (copies["no-manifest"] / MANIFEST_NAME).unlink()
    (copies["no-metadata"] / ".metadata").unlink()
    expected = {"flipped": "__0_0.distcp fails its checksum", "no-manifest": "has no manifest.json: its save did not finish",
                "no-metadata": "lacks .metadata"}
    for name, message in expected.items():
        for read in (lambda p: read_checkpoint(p), lambda p: resolve_run(config.replace(resume=str(p)))):
            with pytest.raises(CorruptCheckpointError) as err:
                read(copies[name])
            assert f"checkpoint folder {copies[name]}" in str(err.value) and message in str(err.value)
            assert "resume from the run folder" in str(err.value)


def test_resume_auto_load_and_export_find_the_newest_folder(tiny_config: TinyConfig, tmp_path: Path,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    config = tiny_config(epochs=1).replace(run_dir=None)
    trainer = Trainer(config, engine=FolderEngine())
    trainer.fit()
    run = trainer.run_dir
    assert run.parent.name == "runs" and holds_run(run)
    resolved = resolve_run({"model": config.model, "dataset": config.dataset, "image_size": 8, "resume": "auto",
                            "epochs": 2})
    assert resolved.checkpoint == run / "checkpoints" / "step-00000003" and resolved.run_dir == run
    with pytest.raises(RunExistsError, match="already holds a run"):
        resolve_run({**config.to_dict(), "run_dir": str(run)})
    net = revtrain.load(run)
    want = trainer.model.state_dict()
    assert all(torch.equal(v, want[k]) for k, v in net.state_dict().items())
    pytest.importorskip("safetensors")
    revtrain.export(run, tmp_path / "exported")
    recipe = json.loads((tmp_path / "exported" / "model.json").read_text())
    assert recipe["model"] == config.model
    again = revtrain.load(tmp_path / "exported")
    assert all(torch.equal(v, want[k]) for k, v in again.state_dict().items())
