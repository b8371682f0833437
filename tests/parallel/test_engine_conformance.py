"""Every engine of the one Trainer keeps the same run features and refuses the same things.

Parametrised over the engines: ``local`` (one process), ``data-parallel`` (DDP, 2 gloo ranks),
``petra-simulator`` (2 stages in this process) and ``petra-processes`` (2 stages, 2 gloo ranks).
For each: the metrics records, the evaluation and the memory report of a finished run; a run
checkpointed after epoch 1 and resumed equals the uninterrupted run bit for bit (for PETRA's
processes, the simulator's uninterrupted run, which they equal bit for bit); each engine's
checkpoint store (``checkpoint.pt``; a data-parallel run's ``torch.distributed.checkpoint``
folders); one Ctrl-C saves a checkpoint at the step it names; and the same refusals before anything runs (a bad
option, a folder holding a run, a resume with another batch size). Tiny runs: RevNet-38 on
digits, 2 steps an epoch, one thread per process.
"""

from __future__ import annotations

import json
import os
import signal
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from revtrain.cli import main
from revtrain.train.checkpoint_folder import latest_checkpoint, read_checkpoint

from .launched import launch_until_training

pytestmark = pytest.mark.multiprocess

ENGINES = {
    "local": [],
    "data-parallel": ["--data-parallel", "2"],
    "petra-simulator": ["--stages", "2", "--engine", "simulator", "--balance", "count"],
    "petra-processes": ["--stages", "2", "--balance", "count"],
}
RUN = ["--epochs", "2", "--max-steps-per-epoch", "2", "--batch-size", "16", "--eval-batch-size", "360",
       "--threads", "1", "--quiet"]


def _records(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def _latest(run: Path, engine: str, *, weights: bool = True) -> dict:
    """The run's latest checkpoint, read: ``checkpoint.pt`` (one process, PETRA) or, for a
    data-parallel run, its newest ``torch.distributed.checkpoint`` folder."""
    latest = latest_checkpoint(run)
    if engine == "data-parallel":
        assert latest is not None and latest.parent == run / "checkpoints" and latest.is_dir(), latest
    else:
        assert latest == run / "checkpoint.pt", latest
    return read_checkpoint(latest, weights=weights)


def _weights(run: Path, engine: str) -> dict[str, torch.Tensor]:
    return _latest(run, engine)["model"]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    """The folder of an engine's uninterrupted run, trained once for the module. PETRA's
    processes equal its simulator bit for bit (test_cli.py): their uninterrupted run is the
    simulator's."""
    runs: dict[str, Path] = {}

    def run(engine: str) -> Path:
        engine = "petra-simulator" if engine == "petra-processes" else engine
        if engine not in runs:
            folder = tmp_path_factory.mktemp(engine) / "full"
            assert main(["train", *ENGINES[engine], *RUN, "--run-dir", str(folder)]) == 0
            runs[engine] = folder
        return runs[engine]

    return run


@pytest.mark.parametrize("engine", list(ENGINES))
def test_records_evaluation_memory_report_and_exact_resume(engine: str, tmp_path: Path,
                                                           uninterrupted: Callable[[str], Path]) -> None:
    flags = ENGINES[engine]
    full, split = uninterrupted(engine), tmp_path / "split"
    records = _records(full)
    assert [r["step"] for r in records if r["event"] == "step"] == [1, 2, 3, 4]  # one writer
    epochs = [r for r in records if r["event"] == "epoch"]
    assert [r["epoch"] for r in epochs] == [0, 1]
    assert all(0 <= r["test_acc"] <= 1 and r["test_loss"] > 0 and r["train_loss"] > 0 for r in epochs)
    summary = json.loads((full / "summary.json").read_text())
    assert summary["steps"] == 4 and summary["test_acc"] == epochs[-1]["test_acc"]
    if engine.startswith("petra"):  # every stage's memory
        memory = summary["petra"]["memory"]
        assert [m["stage"] for m in memory] == [0, 1] and all(m["param_bytes"] > 0 for m in memory)
    else:  # one step's memory in the run's modes and with plain backprop
        assert summary["step_peak_bytes"] > 0 and summary["plain_backprop_peak_bytes"] > 0
    config = json.loads((full / "config.json").read_text())  # the whole run: stages, processes
    assert config["stages"] == (2 if engine.startswith("petra") else None)
    assert config["data_parallel"] == (2 if engine == "data-parallel" else None)
    assert config["engine"] == ("simulator" if engine.startswith("petra") else "processes")

    assert main(["train", *flags, *RUN, "--epochs", "1", "--no-memory-report", "--run-dir", str(split)]) == 0
    assert main(["train", *flags, *RUN, "--no-memory-report", "--resume", str(split)]) == 0
    want = _weights(full, "petra-simulator" if engine == "petra-processes" else engine)
    got = _weights(split, engine)
    assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want)
    again = [r for r in _records(split) if r["event"] == "epoch"]
    assert again[-1]["test_loss"] == epochs[-1]["test_loss"]
    resumed = json.loads((split / "config.json").read_text())  # the processes this command ran on
    assert (resumed["engine"], resumed["data_parallel"]) == (
        "simulator" if engine == "petra-simulator" else "processes", 2 if engine == "data-parallel" else None)


@pytest.mark.parametrize("engine", list(ENGINES))
def test_one_ctrl_c_saves_a_checkpoint_and_the_refusals_are_the_same(engine: str, tmp_path: Path,
                                                                      capsys: pytest.CaptureFixture[str]) -> None:
    run = tmp_path / "run"
    cmd = [sys.executable, "-m", "revtrain.cli", "train", *ENGINES[engine], "--epochs", "1000",
           "--max-steps-per-epoch", "4", "--batch-size", "16", "--eval-batch-size", "360", "--threads", "1",
           "--no-memory-report", "--quiet", "--run-dir", str(run)]
    proc = launch_until_training(cmd, run, 180)
    try:
        os.kill(proc.pid, signal.SIGINT)
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 128 + signal.SIGINT, err
    stop = [r for r in _records(run) if r["event"] == "interrupt"]
    assert len(stop) == 1 and stop[0]["signal"] == "SIGINT", err
    assert _latest(run, engine, weights=False)["progress"]["step"] == stop[0]["step"]

    before = sorted(p.relative_to(run) for p in run.rglob("*"))
    refusals = [
        (["--lr", "inf", "--run-dir", str(tmp_path / "new")], "lr (--lr) must be a finite number"),
        (["--run-dir", str(run)], "already holds a run"),
        (["--resume", str(run), "--batch-size", "32"], "cannot resume"),
    ]
    for argv, message in refusals:
        assert main(["train", *ENGINES[engine], "--epochs", "1000", *argv]) == 2, argv
        err = capsys.readouterr().err
        assert message in err, (argv, err)
    assert sorted(p.relative_to(run) for p in run.rglob("*")) == before
    assert not (tmp_path / "new").exists()

