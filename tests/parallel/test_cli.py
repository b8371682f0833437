"""``revtrain train`` on several processes: --stages (PETRA), --data-parallel (DDP), --shard (FSDP2).

Tiny runs (a few steps on digits, 2 gloo processes, one thread each): the CLI's PETRA run on
processes equals its simulator run bit for bit; DDP and FSDP2 runs equal one process on the
same batches; their checkpoint folders resume in one process; bad input fails before any process
starts; a killed worker ends the run with a message naming it, within the bound.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from revtrain.cli import main
from revtrain.train.checkpoint import load_checkpoint, save_checkpoint
from revtrain.train.checkpoint_folder import latest_checkpoint, read_checkpoint

from .launched import launch_until_training

pytestmark = pytest.mark.multiprocess

REPO = Path(__file__).resolve().parents[2]

PETRA = ["--stages", "2", "--balance", "count", "--epochs", "1", "--max-steps-per-epoch", "3", "--batch-size", "16",
         "--threads", "1", "--quiet"]
DATA_PARALLEL = ["--model", "revvit_digits", "--epochs", "1", "--max-steps-per-epoch", "3", "--batch-size", "15",
                 "--threads", "1", "--no-memory-report", "--quiet"]


def _stage_states(run: Path) -> list[dict]:
    files = sorted((run / "checkpoints").glob("stage*-step*.pt"))
    assert [f.name for f in files] == ["stage0-step3.pt", "stage1-step3.pt"]
    return [torch.load(f, weights_only=False)["worker"] for f in files]


def test_petra_from_the_cli_on_processes_equals_the_simulator(tmp_path: Path, monkeypatch) -> None:
    """The Trainer with the PETRA engine on 2 processes and in the simulator: the same records
    (one writer), the same stage states and the same gathered model, bit for bit. The caller
    keeps its signal handlers: torch's elastic agent replaces them while the ranks run."""
    monkeypatch.delenv("TORCHELASTIC_SIGNALS_TO_HANDLE", raising=False)
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT)}
    assert main(["train", *PETRA, "--run-dir", str(tmp_path / "proc")]) == 0
    assert {sig: signal.getsignal(sig) for sig in handlers} == handlers
    assert "TORCHELASTIC_SIGNALS_TO_HANDLE" not in os.environ
    assert main(["train", *PETRA, "--engine", "simulator", "--run-dir", str(tmp_path / "sim")]) == 0
    for run in ("proc", "sim"):
        records = [json.loads(line) for line in (tmp_path / run / "metrics.jsonl").read_text().splitlines()]
        assert [r["step"] for r in records if r["event"] == "step"] == [1, 2, 3]
        assert [r["epoch"] for r in records if r["event"] == "epoch"] == [0]
        summary = json.loads((tmp_path / run / "summary.json").read_text())
        assert [m["stage"] for m in summary["petra"]["memory"]] == [0, 1]
        assert [m["updates"] for m in summary["petra"]["memory"]] == [3, 3]
    for proc, sim in zip(_stage_states(tmp_path / "proc"), _stage_states(tmp_path / "sim")):
        for unit, state in sim["units"].items():
            for key, value in state.items():
                assert torch.equal(proc["units"][unit][key], value), (unit, key)
    proc, sim = _weights(tmp_path / "proc"), _weights(tmp_path / "sim")
    assert proc.keys() == sim.keys() and all(torch.equal(proc[k], sim[k]) for k in sim)


def _latest(run: Path) -> dict:
    """The run's latest checkpoint, file or folder (data-parallel runs write folders), read whole."""
    latest = latest_checkpoint(run)
    assert latest is not None, f"{run} holds no checkpoint"
    return read_checkpoint(latest)


def _weights(run: Path) -> dict[str, torch.Tensor]:
    return _latest(run)["model"]


def test_data_parallel_and_sharded_runs_equal_one_process_and_resume_anywhere(tmp_path: Path) -> None:
    """Batch 15 on 2 processes (slices of 8 and 7): the weighted slice losses make DDP's average
    the whole batch's gradient. revvit_digits has layer norms only (no batch statistics), so
    the runs agree up to float32 rounding: the loss is summed in another order (two slice
    means, then their all-reduce) — measured 4e-7 relative after 3 steps."""
    assert main(["train", *DATA_PARALLEL, "--run-dir", str(tmp_path / "one")]) == 0
    assert main(["train", *DATA_PARALLEL, "--data-parallel", "2", "--run-dir", str(tmp_path / "ddp")]) == 0
    assert main(["train", *DATA_PARALLEL, "--data-parallel", "2", "--shard", "--run-dir", str(tmp_path / "fsdp")]) == 0
    one = _weights(tmp_path / "one")
    start = torch.load(tmp_path / "one" / "checkpoint.pt", weights_only=False)
    for run in ("ddp", "fsdp"):
        got = _weights(tmp_path / run)
        assert got.keys() == one.keys()
        for key, value in one.items():
            torch.testing.assert_close(got[key], value, rtol=1e-5, atol=1e-6, msg=f"{run}: {key}")
        records = [json.loads(line) for line in (tmp_path / run / "metrics.jsonl").read_text().splitlines()]
        assert [r["step"] for r in records if r["event"] == "step"] == [1, 2, 3]  # one writer: rank 0
    assert start["progress"]["step"] == 3
    for run, layout in [("one", (None, False)), ("ddp", (2, False)), ("fsdp", (2, True))]:  # config.json: the whole run
        config = json.loads((tmp_path / run / "config.json").read_text())
        assert (config["data_parallel"], config["shard"]) == layout, run
    # A sharded run's checkpoint folder (each rank wrote its shards) resumes in one process.
    assert latest_checkpoint(tmp_path / "fsdp") == tmp_path / "fsdp" / "checkpoints" / "step-00000003"
    assert main(["train", *DATA_PARALLEL, "--epochs", "2", "--resume", str(tmp_path / "fsdp")]) == 0
    resumed = torch.load(tmp_path / "fsdp" / "checkpoint.pt", weights_only=False)
    assert resumed["progress"]["step"] == 6
    config = json.loads((tmp_path / "fsdp" / "config.json").read_text())  # the resumed run's own processes
    assert (config["data_parallel"], config["shard"], config["epochs"]) == (None, False, 2)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--stages", "0"], "stages (--stages) must be an integer >= 1"),
        (["--stages", "40"], "blocks"),
        (["--stages", "2", "--split", "1,1"], "split"),
        (["--stages", "2", "--split", "3,x"], "mixes counts and names"),
        (["--stages", "2", "--input-buffer", "none"], "input_buffer"),
        (["--stages", "2", "--accumulation", "0"], "accumulation must be an integer >= 1"),
        (["--stages", "2", "--backend", "nccl"], "nccl"),
        (["--stages", "2", "--optimizer", "adamw"], "--optimizer: PETRA uses SGD"),
        (["--stages", "2", "--check-every", "4"], "--check-every: PETRA's rebuilds use moved parameters"),
        (["--stages", "2", "--data-parallel", "2", "--shard"], "drop --shard"),
        (["--stages", "2", "--data-parallel", "2", "--engine", "simulator"], "drop --data-parallel"),
        (["--stages", "2", "--data-parallel", "2", "--batch-size", "15"], "use a multiple of 2"),
        (["--shard"], "add --data-parallel N"),
        (["--data-parallel", "0"], "data_parallel (--data-parallel) must be an integer >= 1, got 0"),
        (["--data-parallel", "2", "--budget", "1MiB"], "--budget is not available with --data-parallel"),
        (["--data-parallel", "2", "--backend", "nccl"], "nccl"),
        (["--port", "5000"], "--port: options of a run on several processes; add --data-parallel N"),
        (["--stages", "2", "--engine", "simulator", "--timeout", "5"], "--timeout: options of a run on several"),
        (["--data-parallel", "2", "--port", "70000"], "port (--port) must be an integer in [0, 65535]"),
        (["--data-parallel", "2", "--timeout", "0"], "timeout (--timeout) must be > 0 seconds"),
        (["--data-parallel", "2", "--timeout", "inf"], "timeout (--timeout) must be a finite number"),
        (["--data-parallel", "2", "--grad-angle-every", "2"], "--grad-angle-every is not available with --data-parallel"),
    ],
)
def test_bad_input_fails_before_any_process_starts(argv: list[str], message: str, tmp_path: Path,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    run_dir = tmp_path / "run"
    assert main(["train", "--epochs", "1", "--max-steps-per-epoch", "2", "--run-dir", str(run_dir), *argv]) == 2
    err = capsys.readouterr().err
    assert message in err, err
    assert not (run_dir / "metrics.jsonl").exists() and not (run_dir / "errors").exists()


def test_a_petra_run_resumes_with_its_stages_and_replicas_only(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    """Its checkpoint holds one state per stage: another stage count or replica count is refused
    before any process starts, and the run is left as it was. ``--resume`` alone takes the
    stages (and the saved split) from the run: the launcher starts PETRA's ranks, never a
    data-parallel run of a PETRA checkpoint."""
    run = tmp_path / "run"
    sim = ["--stages", "2", "--engine", "simulator", "--balance", "count", "--batch-size", "16", "--threads", "1",
           "--max-steps-per-epoch", "1", "--quiet", "--no-memory-report"]
    assert main(["train", *sim, "--epochs", "1", "--run-dir", str(run)]) == 0
    # The same run as 2 stages x 2 replicas (its saved config says so; launching is captured below).
    hybrid = tmp_path / "hybrid"
    hybrid.mkdir()
    state = load_checkpoint(run / "checkpoint.pt")
    state["config"] = {**state["config"], "data_parallel": 2, "engine": "processes", "run_dir": str(hybrid)}
    save_checkpoint(state, hybrid / "checkpoint.pt")
    # Saved before the config recorded data_parallel: its replicas are unknown, its stages are not.
    old = tmp_path / "old"
    old.mkdir()
    state["config"] = {k: v for k, v in state["config"].items() if k != "data_parallel"} | {"run_dir": str(old)}
    save_checkpoint(state, old / "checkpoint.pt")
    before = {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}
    for argv, message in [
        (["--stages", "3", "--engine", "simulator"], "cannot resume .* as 3 PETRA stage.s. x 1 replica.s.: the run "
                                                     "trained 2 stages x 1 replica.s.*pass --stages 2 without --data-parallel"),
        (["--stages", "2", "--data-parallel", "2"], "as 2 PETRA stage.s. x 2 replica.s."),
        (["--data-parallel", "2"], "as 2 PETRA stage.s. x 2 replica.s."),
        (["--resume", str(hybrid)], "as 2 PETRA stage.s. x 1 replica.s.: the run trained 2 stages x 2 replica.s.*"
                                    "pass --stages 2 --data-parallel 2"),
        (["--resume", str(hybrid), "--data-parallel", "4"], "as 2 PETRA stage.s. x 4 replica.s."),
        (["--resume", str(old), "--stages", "3", "--data-parallel", "2"],
         "as 3 PETRA stage.s.: the run trained 2 stages.*pass --stages 2 .with the run's --data-parallel."),
    ]:
        assert main(["train", "--resume", str(run), *argv, "--epochs", "2"]) == 2, argv
        err = capsys.readouterr().err
        assert re.search(message, err), (argv, err)
    assert {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()} == before

    import revtrain.parallel.launch as launch

    started: list[tuple[list[str], int, list[str]]] = []
    monkeypatch.setattr(launch, "launch_ranks", lambda argv, world, *, role, run, port: started.append(
        (argv, world, [role(r) for r in range(world)])))
    assert main(["train", "--resume", str(hybrid), "--data-parallel", "2", "--epochs", "2"]) == 0
    argv, world, roles = started.pop()
    assert world == 4 and roles == ["stage 0, replica 0", "stage 0, replica 1", "stage 1, replica 0",
                                    "stage 1, replica 1"]
    assert argv[argv.index("--resume", argv.index("--data-parallel")) + 1] == str(hybrid / "checkpoint.pt")
    assert main(["train", "--resume", str(old), "--data-parallel", "2", "--epochs", "2"]) == 0
    assert started.pop()[1:] == (4, roles)
    monkeypatch.undo()

    # For real: 2 PETRA ranks continue the simulator's run (a data-parallel rank would refuse it).
    assert main(["train", "--resume", str(run), "--data-parallel", "1", "--epochs", "2"]) == 0
    config = json.loads((run / "config.json").read_text())
    assert (config["stages"], config["data_parallel"], config["engine"], config["epochs"]) == (2, 1, "processes", 2)
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["epoch"] for r in records if r["event"] == "epoch"] == [0, 1]


def test_a_one_process_engine_names_both_ways_to_continue_a_petra_run() -> None:
    from revtrain.parallel.command import single_process_engine
    from revtrain.parallel.errors import PipelineConfigError
    from revtrain.train import TrainConfig

    from types import SimpleNamespace

    from revtrain.train.config import ConfigError
    from revtrain.train.engine import refuse_stages

    with pytest.raises(PipelineConfigError, match="pass --stages 2 --engine simulator to train them in this process, "
                                                  "or --stages 2 for one process per stage"):
        single_process_engine(TrainConfig(stages=2))
    with pytest.raises(ConfigError, match="pass --stages 2 --engine simulator to train them in one process, "
                                          "or --stages 2 for one process per stage"):
        refuse_stages(SimpleNamespace(config=TrainConfig(stages=2)))  # type: ignore[arg-type]


@pytest.mark.parametrize("flag", ["--stages", "--data-parallel"])
def test_a_port_in_use_is_refused(flag: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        argv = ["train", flag, "2", "--port", str(port), "--epochs", "1", "--run-dir", str(tmp_path / "run")]
        assert main(argv) == 2
    assert f"port {port} is in use" in capsys.readouterr().err


@pytest.mark.parametrize(("flags", "who"), [
    (["--stages", "2", "--data-parallel", "2", "--balance", "count"], "rank 1 (stage 0, replica 1, pid"),
    (["--data-parallel", "2"], "rank 1 (replica 1 of 2, pid"),
])
def test_a_killed_worker_ends_a_cli_run_with_a_clear_message(flags: list[str], who: str, tmp_path: Path) -> None:
    """kill -9 of one rank of a 4-process hybrid (2 stages x 2 replicas) or a data-parallel run."""
    run_dir = tmp_path / "run"
    cmd = [sys.executable, "-m", "revtrain.cli", "train", *flags, "--dataset", "synthetic", "--image-size", "8",
           "--batch-size", "16", "--max-steps-per-epoch", "4", "--epochs", "1000", "--timeout", "30",
           "--run-dir", str(run_dir), "--quiet"]
    env = dict(os.environ, PYTHONPATH=str(REPO))
    launcher = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 300  # starting 4 processes on a busy 2-core machine takes a while
        while not (run_dir / "config.json").exists():  # every rank is up (rank 0 wrote the run's config)
            assert launcher.poll() is None, launcher.communicate()
            assert time.monotonic() < deadline, "the run did not start"
            time.sleep(0.2)
        ranks = _children(launcher.pid)
        assert sorted(ranks) == list(range(4 if "--stages" in flags else 2))
        os.kill(ranks[1], signal.SIGKILL)
        killed = time.monotonic()
        _, err = launcher.communicate(timeout=60)
        elapsed = time.monotonic() - killed
    finally:
        if launcher.poll() is None:
            launcher.kill()
    assert launcher.returncode == 1
    assert elapsed < 60
    assert who in err and "killed by SIGKILL" in err and "StageFailedError" in err, err


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL])  # one Ctrl-C: test_engine_conformance.py
def test_a_signal_to_the_launcher_ends_every_rank_and_saves_a_checkpoint(sig: signal.Signals, tmp_path: Path) -> None:
    """SIGTERM and one Ctrl-C (SIGINT) reach every rank once (the agent forwards them): the run
    saves a checkpoint at one step on every rank and ends with 128 + the signal. ``kill -9`` of
    the launcher ends every rank too (the kernel kills them: ``PR_SET_PDEATHSIG``): none is left running."""
    run_dir = tmp_path / "run"
    cmd = [sys.executable, "-m", "revtrain.cli", "train", "--data-parallel", "2", "--dataset", "synthetic",
           "--image-size", "8", "--batch-size", "16", "--eval-batch-size", "256", "--max-steps-per-epoch", "4",
           "--epochs", "1000", "--run-dir", str(run_dir), "--quiet"]
    launcher = launch_until_training(cmd, run_dir, 120)
    try:
        ranks = _children(launcher.pid)
        assert sorted(ranks) == [0, 1]
        os.kill(launcher.pid, sig)
        _, err = launcher.communicate(timeout=60)
        deadline = time.monotonic() + 30
        while any(_alive(pid) for pid in ranks.values()) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not any(_alive(pid) for pid in ranks.values()), "a rank outlived its launcher"
    finally:
        if launcher.poll() is None:
            launcher.kill()
    if sig == signal.SIGKILL:
        return
    assert launcher.returncode == 128 + sig, err
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    stop = [r for r in records if r["event"] == "interrupt"]
    assert len(stop) == 1 and stop[0]["signal"] == sig.name, err
    saved = _latest(run_dir)
    assert saved["progress"]["step"] == stop[0]["step"]



def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def _children(pid: int) -> dict[int, int]:
    """{rank: pid} of the worker processes started by the launcher ``pid``."""
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            env = (entry / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if int(stat.rsplit(")", 1)[1].split()[1]) != pid:
            continue
        for item in env:
            if item.startswith(b"RANK="):
                found[int(item[5:])] = int(entry.name)
    return found


def test_torchrun_without_a_parallel_option_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    """N trainers in one folder would corrupt its metrics: the rank refuses before writing anything."""
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "test")
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert main(["train", "--epochs", "1", "--max-steps-per-epoch", "1", "--run-dir", str(tmp_path / "run")]) == 2
    assert "add --data-parallel 2" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()


ENGINES = {"local": [], "data-parallel": ["--data-parallel", "2"], "petra": ["--stages", "2"]}
REFUSALS = [
    (["--lr", "inf"], "lr (--lr) must be a finite number"),
    (["--weight-decay", "nan"], "weight_decay (--weight-decay) must be a finite number"),
    (["--warmup-epochs", "-1"], "warmup_epochs must be >= 0"),
    (["--eval-batch-size", "0"], "eval_batch_size must be an integer >= 1"),
    (["--gamma", "5"], "gamma must be in (0, 1]"),
    (["--milestones", "0.7", "0.3"], "milestones must be increasing"),
    (["--image-size", "0"], "image_size must be an integer >= 1"),
    (["--accumulation", "0"], "accumulation must be an integer >= 1"),
]


@pytest.mark.parametrize("engine", list(ENGINES))
def test_every_engine_refuses_the_same_bad_options_before_anything_runs(
        engine: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run_dir = tmp_path / "run"
    for argv, message in REFUSALS:
        assert main(["train", *ENGINES[engine], *argv, "--run-dir", str(run_dir)]) == 2, argv
        err = capsys.readouterr().err
        assert message in err, (argv, err)
    assert not run_dir.exists()


@pytest.mark.parametrize(("engine", "layout"), [(e, layout) for e in ENGINES for layout in
                                                 ("checkpoint.pt", "checkpoints/step-00000001/manifest.json")])
def test_every_engine_refuses_a_folder_holding_a_run(engine: str, layout: str, tmp_path: Path,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    """A folder holding a run (checkpoint.pt, or a data-parallel run's complete checkpoint folder)
    is refused without --resume and left as it was."""
    run_dir = tmp_path / "run"
    (run_dir / layout).parent.mkdir(parents=True, exist_ok=True)
    (run_dir / layout).write_text("{}")
    before = sorted(p.relative_to(run_dir) for p in run_dir.rglob("*"))
    assert main(["train", *ENGINES[engine], "--epochs", "1", "--run-dir", str(run_dir)]) == 2
    assert "already holds a run" in capsys.readouterr().err
    assert sorted(p.relative_to(run_dir) for p in run_dir.rglob("*")) == before
