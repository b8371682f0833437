"""Train suite: the README's training commands run as a user runs them, each in a fresh process
one after another, in a fresh run folder; the figures come from each run's ``summary.json``.

``--models`` keeps the runs whose name contains one of the words (``digits``, ``text``, ``petra``).
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from revtrain.bench.report import Column, Report, Table

LM = ("--dataset text --optimizer adamw --lr 3e-3 --grad-clip 1 --warmup-epochs 0.1 --batch-size 32 --epochs 1 "
      "--max-steps-per-epoch 600")
RUNS: dict[str, str] = {
    "digits-revnet38": "revtrain train",
    "digits-resnet32": "revtrain train --model resnet32",
    "digits-petra-2-stages": "revtrain train --stages 2",
    "digits-data-parallel-2": "revtrain train --data-parallel 2",
    "text-revformer-small": f"revtrain train --model revformer-small {LM}",
    "text-transformer-small": f"revtrain train --model transformer-small {LM}",
}
"""Name -> the command as the README prints it (``--run-dir`` and ``--quiet`` are added)."""
QUICK_RUNS = {"digits-revnet38": "revtrain train --epochs 1 --max-steps-per-epoch 3"}


def train_run(command: str, run_dir: Path, device: torch.device | None = None) -> dict:
    """Run ``revtrain train ...`` in a fresh process writing to ``run_dir``; its summary, wall
    time, the last lines it printed and the records of its ``metrics.jsonl``."""
    argv = [*shlex.split(command), "--run-dir", str(run_dir), "--quiet"]
    argv[0:1] = [sys.executable, "-m", "revtrain.cli"]
    if device is not None:
        argv += ["--device", str(device)]
    root = str(Path(__file__).resolve().parents[3])  # this checkout's revtrain in the child too
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)}
    load_before = os.getloadavg()[0]
    start = time.perf_counter()
    proc = subprocess.run(argv, capture_output=True, text=True, env=env)
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        raise RuntimeError(f"{command!r} failed with exit status {proc.returncode}:\n{proc.stderr[-2000:]}")
    summary = json.loads((run_dir / "summary.json").read_text())
    metrics = run_dir / "metrics.jsonl"
    records = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()] if metrics.exists() else []
    tail = [line for line in proc.stdout.splitlines() if line.strip()][-5:]
    return {"summary": summary, "wall_s": wall, "tail": tail, "records": records, "load_before": load_before,
            "load_after": os.getloadavg()[0]}


def run(options, device: torch.device, out: Path, log) -> Report:
    runs = QUICK_RUNS if options.quick else RUNS
    if options.models:
        runs = {n: c for n, c in runs.items() if any(word in n for word in options.models)}
        if not runs:
            raise ValueError(f"no run's name contains {' or '.join(options.models)}; runs: {', '.join(RUNS)}")
    rows, tails = [], []
    with tempfile.TemporaryDirectory(prefix="revtrain-bench-train-") as tmp:
        for name, command in runs.items():
            log(f"{name}: {command}")
            done = train_run(command, Path(tmp) / name, device if options.device != "auto" else None)
            s = done["summary"]
            head = s.get("headline")
            rows.append({
                "run": name, "command": command, "metric": f"test {head}" if head else None,
                "value": s.get(f"test_{head}") if head else None,
                "train_time_s": s.get("train_time_s"), "process_wall_s": done["wall_s"],
                "samples_per_s": s.get("samples_per_s"), "step_peak_bytes": s.get("step_peak_bytes"),
                "plain_backprop_peak_bytes": s.get("plain_backprop_peak_bytes"),
                "load_before": done["load_before"], "load_after": done["load_after"],
            })
            tails.append(f"`{command}` ended with:\n\n```\n" + "\n".join(done["tail"]) + "\n```")
            log("  " + "\n  ".join(done["tail"]))
    table = Table(
        "runs", "The README's runs",
        [Column("run", "run"), Column("command", "command"), Column("metric", "metric"), Column("value", "value", ".4g"),
         Column("train_time_s", "training time", "s"), Column("process_wall_s", "process wall", "s"),
         Column("samples_per_s", "samples/s", ".0f"), Column("step_peak_bytes", "step memory", "bytes"),
         Column("plain_backprop_peak_bytes", "plain backprop", "bytes"), Column("load_before", "load before", ".2f"),
         Column("load_after", "load after", ".2f")],
        rows,
        note=("Each command in a fresh process and run folder (`--run-dir`, `--quiet` added). Runs without a training "
              "time in their summary (the multi-process launchers) have only the process's wall time."),
    )
    return Report("train", "The README's training runs, as a user runs them", {}, [table],
                  appendix="\n\n".join(tails))
