"""Logs users read (issue 24 §4): steps.csv / epochs.csv and TensorBoard events match metrics.jsonl
(after a crash and a resume too), curves.png at the end of every run; checkpoint retention keeps
exactly the last k evaluated checkpoints and the best one."""

from __future__ import annotations

import csv
import io
import json
from pathlib import Path
from typing import Any

import pytest
import torch
from PIL import Image

from revtrain.train import Trainer, load_checkpoint, resolve_run
from revtrain.train.retention import CheckpointRetention

from .conftest import interrupt_at, make_tiny_config


def _records(run: Path, event: str) -> list[dict[str, Any]]:
    lines = (run / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["event"] == event]


def _csv(path: Path) -> list[dict[str, str]]:
    with path.open(newline="") as f:
        return list(csv.DictReader(f))


def _same_as_csv(records: list[dict[str, Any]], rows: list[dict[str, str]]) -> None:
    assert len(rows) == len(records) and rows
    for record, row in zip(records, rows, strict=True):
        assert set(row) == set(record) - {"event"}
        for key, value in record.items():
            if key == "event":
                continue
            if value is None:
                assert row[key] == ""
            elif isinstance(value, (int, float)) and not isinstance(value, bool):
                assert float(row[key]) == value, key  # floats written with repr: exact
            else:
                assert row[key] == str(value), key


def _tensorboard_scalars(folder: Path, tag: str) -> dict[int, float]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(folder), size_guidance={"scalars": 0})
    acc.Reload()
    events = acc.Scalars(tag)
    steps = [e.step for e in events]
    assert len(steps) == len(set(steps)), f"duplicate steps in {tag}: {steps}"
    return {e.step: e.value for e in events}


def _float32(value: float) -> float:
    return float(torch.tensor(value, dtype=torch.float32))


def test_csv_and_tensorboard_match_metrics_after_a_crash_and_a_resume(tmp_path: Path) -> None:
    pytest.importorskip("tensorboard")
    run = tmp_path / "run"
    # Steps 4 and 5 are logged, then the process dies without saving (the last checkpoint is step 3).
    with pytest.raises(RuntimeError):
        Trainer(make_tiny_config(run, epochs=2, tensorboard=True), callbacks=[interrupt_at(5, RuntimeError)],
                out=io.StringIO()).fit()
    assert [r["step"] for r in _records(run, "step")] == [1, 2, 3, 4, 5]
    Trainer(resolve_run({"resume": str(run)}), out=io.StringIO()).fit()
    steps, epochs = _records(run, "step"), _records(run, "epoch")
    assert [r["step"] for r in steps] == [1, 2, 3, 4, 5, 6] and [r["epoch"] for r in epochs] == [0, 1]
    _same_as_csv(steps, _csv(run / "steps.csv"))
    _same_as_csv(epochs, _csv(run / "epochs.csv"))
    losses = _tensorboard_scalars(run / "tensorboard", "step/loss")
    assert losses == {r["step"]: _float32(r["loss"]) for r in steps}  # steps 4, 5 of the dead process purged
    accuracy = _tensorboard_scalars(run / "tensorboard", "epoch/test_acc")
    assert accuracy == {r["step"]: _float32(r["test_acc"]) for r in epochs}


def test_every_run_ends_with_a_curve_png(tmp_path: Path) -> None:
    run = tmp_path / "run"
    out = io.StringIO()
    Trainer(make_tiny_config(run), out=out).fit()
    with Image.open(run / "curves.png") as image:
        assert image.format == "PNG" and image.width > image.height > 100
    assert f"curves: {run / 'curves.png'}" in out.getvalue()
    assert not (run / "tensorboard").exists()  # an extra, only when asked


def test_tensorboard_without_the_package_names_the_extra(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import builtins

    real_import = builtins.__import__

    def no_tensorboard(name: str, *args: Any, **kwargs: Any) -> Any:
        if name.startswith("torch.utils.tensorboard"):
            raise ImportError(name)
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_tensorboard)
    from revtrain.train import ConfigError

    with pytest.raises(ConfigError, match=r"pip install 'revtrain\[tensorboard\]'"):
        Trainer(make_tiny_config(tmp_path / "run", tensorboard=True), out=io.StringIO())
    assert not (tmp_path / "run").exists()


def test_retention_keeps_exactly_the_last_k_and_the_best(tmp_path: Path) -> None:
    run = tmp_path / "run"
    trainer = Trainer(make_tiny_config(run, epochs=4, keep_checkpoints=2), out=io.StringIO())
    trainer.fit()
    history = trainer.history
    assert [r["step"] for r in history] == [3, 6, 9, 12]
    best = max(history, key=lambda r: (r["test_acc"], -r["step"]))
    kept = sorted(p.name for p in (run / "checkpoints").iterdir())
    assert kept == sorted({"step-00000009.pt", "step-00000012.pt", "best.pt"})
    for name in ("step-00000009.pt", "step-00000012.pt"):
        assert load_checkpoint(run / "checkpoints" / name)["progress"]["step"] == int(name[5:13])
    assert load_checkpoint(run / "checkpoints" / "best.pt")["progress"]["step"] == best["step"]
    assert (run / "checkpoints" / "step-00000012.pt").read_bytes() == (run / "checkpoint.pt").read_bytes()
    # A kept checkpoint belongs to the run: a branch from it carries the run's history up to it.
    branch = Trainer(make_tiny_config(tmp_path / "branch", epochs=4,
                                      resume=str(run / "checkpoints" / "step-00000009.pt")), out=io.StringIO())
    branch.fit()
    with (tmp_path / "branch" / "epochs.csv").open() as f:
        assert [int(r["step"]) for r in csv.DictReader(f)] == [3, 6, 9, 12]
    assert resolve_run({"resume": str(run / "checkpoints" / "best.pt")}).run_dir == run  # in place: the run's folder


def _history(*values: float) -> list[dict[str, Any]]:
    return [{"step": 10 * (i + 1), "test_acc": v} for i, v in enumerate(values)]


@pytest.mark.parametrize(("values", "higher", "best_step", "last"), [
    ((0.5, 0.9, 0.7, 0.6, 0.8), True, 20, (40, 50)),  # the best is older than the last two: kept as well
    ((0.9, 0.9, 0.1), True, 10, (20, 30)),            # a tie keeps the earliest
    ((3.0, 1.0, 2.0), False, 20, (20, 30)),           # lower is better (bits per byte); best among the last
])
def test_retention_rule(tmp_path: Path, values: tuple[float, ...], higher: bool, best_step: int,
                        last: tuple[int, ...]) -> None:
    retention = CheckpointRetention(tmp_path / "kept", keep=2, metric="test_acc", higher_is_better=higher)
    source = tmp_path / "checkpoint.pt"
    history = _history(*values)
    for i, record in enumerate(history):
        (tmp_path / "new").write_text(f"state at {record['step']}")
        (tmp_path / "new").replace(source)  # as checkpoints are written: a new file moved over the old
        assert retention.after_save(source, record["step"] - 1, history[: i + 1]) == []  # not evaluated: no-op
        retention.after_save(source, record["step"], history[: i + 1])
    files = {p.name: p.read_text() for p in (tmp_path / "kept").iterdir()}
    assert set(files) == {f"step-{s:08d}.pt" for s in last} | {"best.pt"}
    assert files["best.pt"] == f"state at {best_step}"
    assert all(files[f"step-{s:08d}.pt"] == f"state at {s}" for s in last)
